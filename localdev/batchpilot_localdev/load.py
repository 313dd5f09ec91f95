"""Open-loop replay of an arrival trace against a policy's local runtime processes.

Requests are sent on the trace's schedule (time-scaled to a mean rate) whether or not earlier
ones were answered, so queueing shows up as latency instead of slowing the sender. Each
request goes to a uniformly chosen ready process of the policy, as a Service would route it.
The trace repeats until the replay is stopped. Latencies are measured from the scheduled send
time and kept per (revision, track) for progress lines; the SLO verdicts come from Prometheus.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import aiohttp

from batchpilot_runtime.config import TENANT_HEADER

LATE_S = 0.02
"""A send started this much after its scheduled time counts as late (see ``TraceReplay.late``)."""

ROW = [round(random.Random(7).uniform(-1, 1), 4) for _ in range(512)]


class Endpoint(Protocol):
    """Where a request goes: a local runtime process (``harness.RuntimeProcess``) or a real
    pod (``realnode.PodEndpoint``)."""

    @property
    def url(self) -> str: ...

    @property
    def revision(self) -> str: ...

    @property
    def track(self) -> str: ...


@dataclass
class TrackStats:
    sent: int = 0
    ok: int = 0
    errors: int = 0
    failures: Counter[str] = field(default_factory=Counter)
    """The errors by kind: the HTTP status, or the client exception's name."""
    latencies: deque[float] = field(default_factory=lambda: deque(maxlen=2000))

    def p99(self) -> float | None:
        if not self.latencies:
            return None
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


class TraceReplay:
    def __init__(
        self,
        arrivals: Sequence[float],
        endpoints: Callable[[], Sequence[Endpoint]],
        model: str,
        lane: str | None = None,
        seed: int = 1,
        body: Mapping[str, object] | None = None,
        headers: Mapping[str, str] | None = None,
        tenants: Sequence[tuple[str, float]] | None = None,
        raw: bytes | None = None,
    ) -> None:
        """``body``: the infer request to send (default: one FP32 row of 512, the MLPs' input);
        ``headers``: extra request headers (e.g. the tenant's, ``X-Batchpilot-Tenant``);
        ``tenants``: (name, weight) pairs: each request names one, drawn by weight, in the
        ``X-Batchpilot-Tenant`` header (several clients sharing the policy); ``raw``: a ready
        request body sent instead of ``body`` (e.g. the binary tensor extension, with its
        ``Inference-Header-Content-Length`` in ``headers``: many rows without 40 KB of JSON)."""
        if not arrivals:
            raise ValueError("empty arrival trace")
        self.arrivals = list(arrivals)
        self.endpoints = endpoints
        self.model = model
        self.lane = lane
        self.body = body
        self.raw = raw
        self.extra_headers = dict(headers or {})
        self.tenants = [name for name, _ in tenants or []]
        self.tenant_weights = [weight for _, weight in tenants or []]
        self.rng = random.Random(seed)
        self.stats: dict[tuple[str, str], TrackStats] = defaultdict(TrackStats)
        self.dropped_no_endpoint = 0
        self.late: deque[tuple[float, float]] = deque(maxlen=10_000)
        """(wall-clock time, seconds late) of each send this process started more than
        ``LATE_S`` after its scheduled time: a loaded machine's sender falling behind and catching
        up sends a burst the trace does not have."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> TraceReplay:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="trace-replay", daemon=True)
        self._thread.start()
        return self

    @property
    def running(self) -> bool:
        """The replay thread is alive (started and neither stopped nor crashed)."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=30)

    async def _run(self) -> None:
        body: Mapping[str, object] = self.body or {
            "inputs": [{"name": "input", "shape": [1, 512], "datatype": "FP32", "data": ROW}]
        }
        headers = {"X-Batchpilot-Lane": self.lane} if self.lane else {}
        headers |= {"Content-Type": "application/json"} | self.extra_headers
        payload = self.raw if self.raw is not None else json.dumps(body).encode()  # encoded once
        period = self.arrivals[-1] + max(1e-3, self.arrivals[-1] / max(1, len(self.arrivals)))
        conn = aiohttp.TCPConnector(limit=512)
        timeout = aiohttp.ClientTimeout(total=30)
        pending: set[asyncio.Task[None]] = set()
        async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
            start = time.perf_counter()
            loop_index = 0
            while not self._stop.is_set():
                for offset in self.arrivals:
                    if self._stop.is_set():
                        break
                    scheduled = start + loop_index * period + offset
                    delay = scheduled - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    elif -delay > LATE_S:
                        self.late.append((time.time(), -delay))
                    targets = self.endpoints()
                    if not targets:
                        self.dropped_no_endpoint += 1
                        continue
                    target = self.rng.choice(targets)
                    sent = headers
                    if self.tenants:
                        tenant = self.rng.choices(self.tenants, self.tenant_weights)[0]
                        sent = headers | {TENANT_HEADER: tenant}
                    task = asyncio.create_task(self._send(session, target, payload, sent, scheduled))
                    pending.add(task)
                    task.add_done_callback(pending.discard)
                loop_index += 1
            if pending:
                await asyncio.wait(pending, timeout=10)

    async def _send(
        self,
        session: aiohttp.ClientSession,
        target: Endpoint,
        payload: bytes,
        headers: dict[str, str],
        scheduled: float,
    ) -> None:
        stats = self.stats[(target.revision, target.track)]
        stats.sent += 1
        try:
            url = f"{target.url}/v2/models/{self.model}/infer"
            async with session.post(url, data=payload, headers=headers) as r:
                await r.read()
                ok = r.status == 200
                kind = str(r.status)
        except (aiohttp.ClientError, TimeoutError) as exc:
            ok = False
            kind = type(exc).__name__
        if ok:
            stats.ok += 1
            stats.latencies.append(time.perf_counter() - scheduled)
        else:
            stats.errors += 1
            stats.failures[kind] += 1
