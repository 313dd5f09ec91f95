"""Drill 8: overload and retry storms against ONE real runtime process (the builtin transformer
on one CPU thread), and a runtime killed mid-batch.

The capacity is measured first (closed loop, two full batches in flight), then the load is
3x that, open loop. Expected: only 429 (queue full) and 504 (request timeout) beyond capacity,
no 5xx of any other kind and no dropped connection; RSS bounded (the peak is reported); the
p99 of the 200s within the lane's requestTimeout as the runtime measures it (its Server-Timing
header; the client's figure, transit and its own delays included, is reported beside it); full recovery within
one requestTimeout after the load stops (a fresh request served as fast as when idle). Clients
that retry on 429, honouring Retry-After or not, keep the goodput at >= 80% of capacity.

The overload and retry drills measure throughput on the machine they run on, so they are long
drills (``make drills``), not CI tests; CI runs the kill drill.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bpdrill import Drill
from bpdrill_runtime import RuntimeServer, Tally, closed_loop, lane, open_loop, run

pytestmark = pytest.mark.runtime_server

REQUEST_TIMEOUT_S = 1.0
LANE = lane(request_timeout="1s", queue=64, batch=8, window="5ms")
CAPACITY_CONCURRENCY = 16
SHED = {"429", "504"}


class RssSampler:
    def __init__(self, server: RuntimeServer, every: float = 0.2) -> None:
        self.server, self.every = server, every
        self.peak = server.rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.peak = max(self.peak, self.server.rss_bytes())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RuntimeServer]:
    s = RuntimeServer(tmp_path, LANE)
    try:
        yield s
    finally:
        s.stop()


def capacity(url: str, seconds: float = 8.0) -> tuple[float, float]:
    """(requests/s answered 200, p99 s) at saturation without queueing beyond two batches.

    A machine stalled by other work can hold 16 requests past their requestTimeout: the server
    then answers 504 as it should, and the capacity is what it did serve (make test, the suite's
    two halves at once on 2 cores: 61 answered and 8 timed out in 4 s). Anything but 200/429/504
    is still a failure."""
    run(closed_loop(url, CAPACITY_CONCURRENCY, 2.0))  # warm the connections and the allocator
    t = run(closed_loop(url, CAPACITY_CONCURRENCY, seconds))
    assert set(t.statuses) <= {"200"} | SHED and t.logical_ok > 0, t.statuses
    return t.logical_ok / seconds, t.p99()


def idle_p99(url: str) -> float:
    return float(run(closed_loop(url, 1, 2.0)).p99())


def overload(server: RuntimeServer, drill: Drill, seconds: float) -> None:
    url = server.url + "/v2/models/m/infer"
    idle = idle_p99(url)
    cap, cap_p99 = capacity(url)
    rss0 = server.rss_bytes()
    drill.fault = f"3x measured capacity ({cap:.0f} req/s) open loop for {seconds:g} s against one runtime"
    drill.expected = (
        "only 429/504 beyond capacity, RSS bounded, p99 of admitted <= requestTimeout (1 s), "
        "recovered within one requestTimeout after the load"
    )
    sampler = RssSampler(server)
    t = run(open_loop(url, 3 * cap, seconds, probe_bound=max(3 * idle, 0.1)))
    peak = sampler.stop()
    other = {k: v for k, v in t.statuses.items() if k not in SHED | {"200"}}
    shed = sum(v for k, v in t.statuses.items() if k in SHED)
    p99 = t.p99(server=True)
    client_p99 = t.p99()
    drill.requests_sent = t.sent
    drill.requests_failed = shed + sum(other.values())
    drill.requests_lost = sum(other.values())
    drill.figures.update(
        {
            "capacity_rps": round(cap, 1),
            "capacity_p99_s": round(cap_p99, 3),
            "idle_p99_s": round(idle, 3),
            "offered_rps": round(3 * cap, 1),
            "goodput_rps": round(t.goodput(seconds), 1),
            "admitted_p99_s": round(p99, 3),
            "admitted_p99_client_s": round(client_p99, 3),
            "status_counts": str(dict(sorted(t.statuses.items()))),
            "rss_before_mib": rss0 >> 20,
            "rss_peak_mib": peak >> 20,
            "load_average": " ".join(Path("/proc/loadavg").read_text().split()[:3]),
        }
    )
    if t.recovered_after is not None:
        drill.recovered(t.recovered_after)
    drill.observed = (
        f"{t.sent} sent: {t.statuses}; goodput {t.goodput(seconds):.0f} req/s of {cap:.0f}; admitted p99 "
        f"{p99 * 1000:.0f} ms at the runtime ({client_p99 * 1000:.0f} ms at the client); RSS {rss0 >> 20} -> peak {peak >> 20} MiB; recovered "
        f"{t.recovered_after if t.recovered_after is None else round(t.recovered_after, 2)} s after the load"
    )
    assert not other, f"answers other than 200/429/504 under overload: {other}"
    assert shed > 0, "3x capacity shed nothing: the capacity measurement is wrong"
    assert len(t.server_latencies) == t.statuses.get("200", 0), "every 200 carries Server-Timing"
    assert p99 <= REQUEST_TIMEOUT_S, f"p99 of admitted requests {p99:.3f}s > requestTimeout"
    assert peak - rss0 < 256 << 20, f"RSS grew {(peak - rss0) >> 20} MiB under overload"
    assert t.recovered_after is not None and t.recovered_after <= REQUEST_TIMEOUT_S, t.recovered_after
    assert server.proc.poll() is None


@pytest.mark.long_drill
def test_overload_3x_60s(server: RuntimeServer, drill: Drill) -> None:
    overload(server, drill, 60.0)


def retry_storm(server: RuntimeServer, drill: Drill, mode: str, seconds: float) -> None:
    url = server.url + "/v2/models/m/infer"
    cap, _ = capacity(url)
    drill.fault = f"3x capacity ({cap:.0f} req/s) for {seconds:g} s, clients retrying every 429 ({mode})"
    drill.expected = "goodput >= 80% of the measured capacity; no answer but 200/429/504"
    t = run(open_loop(url, 3 * cap, seconds, retry=mode, give_up_after=10.0))
    goodput = t.goodput(seconds)
    other = {k: v for k, v in t.statuses.items() if k not in SHED | {"200"}}
    drill.requests_sent = t.sent
    drill.requests_failed = t.logical - t.logical_ok
    drill.requests_lost = sum(other.values())
    drill.figures.update(
        {
            "capacity_rps": round(cap, 1),
            "goodput_rps": round(goodput, 1),
            "goodput_share": round(goodput / cap, 3),
            "client_requests": t.logical,
            "http_requests": t.sent,
            "gave_up": t.gave_up,
            "status_counts": str(dict(sorted(t.statuses.items()))),
            "load_average": " ".join(Path("/proc/loadavg").read_text().split()[:3]),
        }
    )
    drill.observed = (
        f"goodput {goodput:.0f} req/s = {goodput / cap:.0%} of capacity {cap:.0f}; {t.sent} HTTP requests for "
        f"{t.logical} client requests ({t.statuses}); {t.gave_up} gave up after 10 s"
    )
    assert not other, other
    assert goodput >= 0.8 * cap, f"goodput {goodput:.1f} req/s < 80% of capacity {cap:.1f}"


@pytest.mark.long_drill
@pytest.mark.parametrize("mode", ["retry-after", "immediate"])
def test_retry_storm_60s(server: RuntimeServer, drill: Drill, mode: str) -> None:
    retry_storm(server, drill, mode, 60.0)


# Alone: both runtimes carry a quarter of a capacity measured seconds before, and the other
# runtime must answer 95% of it. Beside the operator's half of the suite on 2 cores the machine's
# share for them fell mid-load (make test, 2026-12-07: the other runtime answered 191 of its 360
# requests, 162 timed out at its 1 s requestTimeout); alone it passed 3 of 3.
@pytest.mark.alone
def test_runtime_killed_mid_batch(tmp_path: Path, drill: Drill) -> None:
    """Two runtimes under load; one is SIGKILLed mid-batch: only its own requests fail."""
    drill.fault = "SIGKILL of one of two runtime processes under load (mid-batch)"
    drill.expected = (
        "only the killed runtime's requests fail; the other runtime drops no connection and answers >= 95% 200"
    )
    a = RuntimeServer(tmp_path / "a", LANE, name="a")
    b = RuntimeServer(tmp_path / "b", LANE, name="b")
    try:
        url_a, url_b = (s.url + "/v2/models/m/infer" for s in (a, b))
        cap, _ = capacity(url_b, seconds=4.0)
        rate = 0.25 * cap  # each runtime at a quarter of its capacity: headroom on a busy machine
        killed_at: list[float] = []

        due = int(rate * 4)  # the fault lands once runtime a has served 4 s of its load

        def kill_later() -> None:
            deadline = time.monotonic() + 10.0  # the load's length
            while time.monotonic() < deadline:
                try:
                    if a.answered() >= due:
                        os.kill(a.proc.pid, signal.SIGKILL)
                        killed_at.append(time.monotonic())
                        return
                except OSError:
                    pass
                time.sleep(0.02)

        killer = threading.Thread(target=kill_later)
        killer.start()

        async def both() -> list[Tally]:
            return list(await asyncio.gather(open_loop(url_a, rate, 10.0), open_loop(url_b, rate, 10.0)))

        ta, tb = run(both())
        killer.join()
        assert killed_at, f"runtime a never answered {due} requests under the load: {ta.statuses}"
        assert a.proc.wait(timeout=5) == -signal.SIGKILL
        a_failed = ta.sent - ta.statuses.get("200", 0)
        a_lost = sum(v for k, v in ta.statuses.items() if not k.isdigit())
        drill.requests_sent = ta.sent + tb.sent
        drill.requests_failed = a_failed + tb.sent - tb.statuses.get("200", 0)
        drill.requests_lost = a_lost
        drill.figures.update(
            {
                "killed_runtime_statuses": str(ta.statuses),
                "other_runtime_statuses": str(tb.statuses),
                "other_runtime_p99_s": round(tb.p99(), 3),
            }
        )
        drill.observed = f"killed runtime: {ta.statuses}; other runtime: {tb.statuses}, p99 {tb.p99() * 1000:.0f} ms"
        # The other runtime: every request answered over HTTP (no dropped connection), and at
        # most 5% shed (429/504), which only a machine busy with other work explains.
        assert set(tb.statuses) <= {"200", "429", "504"}, f"the other runtime was affected: {tb.statuses}"
        assert tb.statuses.get("200", 0) >= 0.95 * tb.sent, f"the other runtime was affected: {tb.statuses}"
        transport = {k: v for k, v in ta.statuses.items() if not k.isdigit()}
        assert transport, f"the kill cost the killed runtime's clients nothing? {ta.statuses}"
        assert b.ready()
    finally:
        a.stop()
        b.stop()
