"""Python fallback of bench/loadgen.mjs (same SPEC file, same JSON summary), for machines without Node.js.

Open loop on asyncio + aiohttp: each request is sent at its scheduled time without waiting for
earlier replies; latency is measured from the scheduled time. Slower per request than the
Node.js generator: read ``send_lag_ms`` and ``generator_cpu_frac`` to see whether it kept up.
"""

from __future__ import annotations

import asyncio
import json
import math
import resource
import sys
import time
from typing import Any
from urllib.parse import urlsplit

import aiohttp


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    i = min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))
    return values[i]


def _r(x: float | None) -> float | str | None:
    if x is None:
        return None
    if x == math.inf:
        return "inf"
    return round(x, 3)


async def run(spec: dict[str, Any]) -> dict[str, Any]:
    host = urlsplit(spec["url"]).hostname
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit(f"refusing non-loopback target {host}")
    body = spec["body"].encode()
    headers = {"Content-Type": "application/json", **spec.get("headers", {})}
    expect = spec.get("expect_status", 200)
    timeout = aiohttp.ClientTimeout(total=spec.get("timeout", 10))
    lat_ok: list[float] = []
    lags: list[float] = []
    statuses: dict[str, int] = {}
    errors = 0
    sent = 0
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:

        async def send(scheduled: float) -> None:
            nonlocal errors, sent
            lags.append((time.perf_counter() - scheduled) * 1000)
            sent += 1
            try:
                async with session.post(spec["url"], data=body, headers=headers) as resp:
                    await resp.read()
                    status: Any = resp.status
            except (TimeoutError, aiohttp.ClientError):
                status = "error"
            lat = (time.perf_counter() - scheduled) * 1000
            statuses[str(status)] = statuses.get(str(status), 0) + 1
            if status == expect:
                lat_ok.append(lat)
            else:
                errors += 1

        t0 = time.perf_counter() + 0.02
        tasks: set[asyncio.Task[None]] = set()
        if spec.get("mode") == "closed":
            end = t0 + spec["duration"]

            async def worker() -> None:
                while time.perf_counter() < end:
                    await send(time.perf_counter())

            await asyncio.gather(*(worker() for _ in range(spec["concurrency"])))
        else:
            for off in spec["offsets"]:
                due = t0 + off
                delay = due - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                task = asyncio.ensure_future(send(due))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    ok = sorted(lat_ok)
    slo = sorted(lat_ok + [math.inf] * errors)
    lg = sorted(lags)
    return {
        "sent": sent, "completed": len(ok) + errors, "ok": len(ok), "errors": errors, "statuses": statuses,
        "wall_s": _r(wall), "ok_per_s": _r(len(ok) / wall if wall > 0 else 0.0),
        "latency_ms": {"p50": _r(_pct(ok, 0.5)), "p90": _r(_pct(ok, 0.9)), "p99": _r(_pct(ok, 0.99)),
                       "max": _r(ok[-1] if ok else None)},
        "slo_p99_ms": _r(_pct(slo, 0.99)),
        "send_lag_ms": {"p50": _r(_pct(lg, 0.5)), "p99": _r(_pct(lg, 0.99)), "max": _r(lg[-1] if lg else None)},
        "generator_cpu_s": _r(cpu), "generator_cpu_frac": _r(cpu / wall if wall > 0 else 0.0),
        "generator": "python",
    }  # fmt: skip


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    print(json.dumps(asyncio.run(run(spec))))


if __name__ == "__main__":
    main()
