"""Drill 8's tools: one real runtime server process (the builtin MLP on torch) and load
generators against it: closed loop (capacity), open loop at a rate, and open loop whose clients
retry on 429 (honouring ``Retry-After`` or at once). Pure measurement; the drill asserts."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from batchpilot_localdev import free_port
from batchpilot_localdev.processes import stop_process
from bptest import REPO

# The builtin transformer (64 token ids a row, ~0.5 GFLOP): a capacity of tens of requests/s
# on one CPU thread, so that 3x capacity is cheap for the load generator on a shared machine.
SOURCE = "builtin:transformer"
BODY = {
    "inputs": [{"name": "input", "shape": [1, 64], "datatype": "INT64", "data": [(7 * i) % 8192 for i in range(64)]}]
}


def lane(request_timeout: str = "500ms", queue: int = 64, batch: int = 8, window: str = "5ms") -> dict[str, Any]:
    return {
        "name": "interactive",
        "maxBatchSize": batch,
        "maxQueueDelay": window,
        "maxQueueLength": queue,
        "requestTimeout": request_timeout,
    }


# The runtime on one CPU and the load generator on another, as clients run on other machines
# in production: the load generator's own CPU use must not count as the runtime's overload.
# (Other processes of the machine still run anywhere; the report records the load average.)
_CPUS = sorted(os.sched_getaffinity(0))
RUNTIME_CPUS = set(_CPUS[:1]) if len(_CPUS) > 1 else set(_CPUS)
CLIENT_CPUS = set(_CPUS[1:]) if len(_CPUS) > 1 else set(_CPUS)


def pin(pid: int, cpus: set[int]) -> None:
    """Run ``pid`` (0: this process) on ``cpus`` only."""
    os.sched_setaffinity(pid, cpus)


class RuntimeServer:
    """``python -m batchpilot_runtime.server`` on a free port, with one lane."""

    def __init__(self, workdir: Path, lane_cfg: dict[str, Any], source: str = SOURCE, name: str = "rt") -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = {
            "policy": "drill",
            "revision": name,
            "model": {"name": "m", "source": source, "device": "cpu", "dtype": "float32", "threads": 1},
            "lanes": [lane_cfg],
            "drainTimeout": "5s",
        }
        config = workdir / f"{name}.json"
        config.write_text(json.dumps(cfg))
        self.log_path = workdir / f"{name}.log"
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": f"{REPO / 'runtime'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        }
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "batchpilot_runtime.server", "--config", str(config), "--port", str(self.port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        pin(self.proc.pid, RUNTIME_CPUS)
        deadline = time.monotonic() + 120
        while not self.ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"runtime exited {self.proc.returncode}: {self.log_path.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"runtime not ready in 120 s: {self.log_path.read_text()[-2000:]}")
            time.sleep(0.1)

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/v2/health/ready", timeout=2) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def answered(self) -> int:
        """Requests this runtime answered 200 so far (its own ``batchpilot_requests_total``)."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=2) as r:
            text = r.read().decode()
        return sum(
            int(float(line.rsplit(" ", 1)[1]))
            for line in text.splitlines()
            if line.startswith("batchpilot_requests_total{") and 'outcome="ok"' in line
        )

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def stop(self) -> None:
        stop_process(self.proc, 15)


@dataclass
class Tally:
    sent: int = 0
    """HTTP requests sent (retries included)."""
    statuses: dict[str, int] = field(default_factory=dict)
    ok_latencies: list[float] = field(default_factory=list)
    """Client-measured seconds of each 200 (transit and the client's own delays included)."""
    server_latencies: list[float] = field(default_factory=list)
    """The runtime's own seconds of each 200 (its Server-Timing header)."""
    logical: int = 0
    """Client requests (a request and its retries are one)."""
    logical_ok: int = 0
    gave_up: int = 0
    ok_times: list[float] = field(default_factory=list)
    """When each 200 came back (seconds from the start of the load)."""
    stopped_at: float = 0.0
    """When the load stopped (seconds from its start)."""
    recovered_after: float | None = None
    """Seconds from ``stopped_at`` to the first probe answered 200 within the probe bound."""

    def goodput(self, seconds: float) -> float:
        """200s per second that came back within the first ``seconds`` of the load."""
        return sum(1 for t in self.ok_times if t <= seconds) / seconds

    def count(self, status: str) -> None:
        self.statuses[status] = self.statuses.get(status, 0) + 1

    def p99(self, server: bool = False) -> float:
        ordered = sorted(self.server_latencies if server else self.ok_latencies)
        return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else float("nan")


async def _post(
    session: aiohttp.ClientSession, url: str, tally: Tally, start: float = 0.0
) -> tuple[int, float, str | None]:
    tally.sent += 1
    t0 = time.perf_counter()
    try:
        async with session.post(url, json=BODY) as resp:
            await resp.read()
            status = resp.status
            retry_after = resp.headers.get("Retry-After")
            timing = resp.headers.get("Server-Timing", "")
    except (aiohttp.ClientError, TimeoutError) as exc:
        tally.count(type(exc).__name__)
        return -1, time.perf_counter() - t0, None
    latency = time.perf_counter() - t0
    tally.count(str(status))
    if status == 200:
        tally.ok_latencies.append(latency)
        if timing.startswith("total;dur="):
            tally.server_latencies.append(float(timing.split("=", 1)[1]) / 1000)
        tally.ok_times.append(time.perf_counter() - start)
    return status, latency, retry_after


async def closed_loop(url: str, concurrency: int, seconds: float) -> Tally:
    """``concurrency`` clients each sending the next request when the last is answered."""
    tally = Tally()
    end = time.perf_counter() + seconds
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=30)) as session:

        async def client() -> None:
            while time.perf_counter() < end:
                tally.logical += 1
                status, _, _ = await _post(session, url, tally)
                tally.logical_ok += status == 200

        await asyncio.gather(*(client() for _ in range(concurrency)))
    return tally


async def open_loop(
    url: str,
    rate: float,
    seconds: float,
    *,
    retry: str | None = None,
    give_up_after: float = 10.0,
    connections: int = 256,
    probe_bound: float | None = None,
) -> Tally:
    """Requests arrive at ``rate``/s for ``seconds`` whatever the answers. ``retry``: None (a
    429 is final), ``"retry-after"`` (wait what the header says, then again) or ``"immediate"``
    (send again at once). A client gives up ``give_up_after`` seconds after its first try.
    ``probe_bound``: once the load stops, send one request at a time until one is answered 200
    within ``probe_bound`` seconds (``recovered_after``)."""
    tally = Tally()
    conn = aiohttp.TCPConnector(limit=connections)
    tasks: set[asyncio.Task[None]] = set()
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=30)) as session:
        start = time.perf_counter()

        async def one() -> None:
            tally.logical += 1
            first = time.perf_counter()
            while True:
                status, _, retry_after = await _post(session, url, tally, start)
                if status == 200:
                    tally.logical_ok += 1
                    return
                if retry is None or status != 429:
                    return
                if time.perf_counter() - first > give_up_after:
                    tally.gave_up += 1
                    return
                if retry == "retry-after":
                    await asyncio.sleep(float(retry_after or "1"))

        n = 0
        while True:
            now = time.perf_counter() - start
            if now >= seconds:
                break
            due = int(now * rate) + 1
            while n < due:
                task = asyncio.create_task(one())
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                n += 1
            await asyncio.sleep(0.002)
        tally.stopped_at = time.perf_counter() - start
        if probe_bound is not None:
            probes = Tally()
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as fresh:
                while time.perf_counter() - start < tally.stopped_at + 60:
                    status, latency, _ = await _post(fresh, url, probes)
                    if status == 200 and latency <= probe_bound:
                        tally.recovered_after = time.perf_counter() - start - tally.stopped_at
                        break
        if tasks:
            await asyncio.wait(tasks, timeout=give_up_after + 35)
    return tally


def run(coro: Any) -> Any:
    """Run a load generator on the client CPU (the process's affinity is restored after)."""
    before = os.sched_getaffinity(0)
    pin(0, CLIENT_CPUS)
    try:
        return asyncio.run(coro)
    finally:
        os.sched_setaffinity(0, before)
