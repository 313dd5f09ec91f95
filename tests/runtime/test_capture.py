"""Arrival capture, live profile and batch cut delay: the pure parts with an injected clock, then
the admin endpoints of a real runtime process (real torch, real HTTP)."""

from __future__ import annotations

import asyncio
import json
import math
import os
import statistics
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from bp_rt_harness import Server, body, infer, lane, wait_for

from batchpilot_operator.tune.profile import LatencyProfile
from batchpilot_runtime.capture import (
    ARRIVAL_SLOT_BYTES,
    FAILED,
    OUTCOME_SLOT_BYTES,
    SLOT_BYTES,
    ArrivalRing,
    Capture,
    FrontEndMeter,
    LiveProfile,
    OutcomeRing,
    capture_bounds_from_env,
)
from batchpilot_runtime.config import LaneConfig, RuntimeConfig
from batchpilot_runtime.scheduler import Pending, cut_delay

# ----------------------------------------------------------------------------- the ring


def test_ring_holds_everything_below_its_bounds() -> None:
    ring = ArrivalRing(capacity=8, max_age=100.0)
    for k in range(5):
        ring.record(10.0 + k, k + 1)
    times, rows = ring.snapshot(now=20.0)
    assert times == [10.0, 11.0, 12.0, 13.0, 14.0]
    assert rows == [1, 2, 3, 4, 5]
    assert ring.overwritten == 0


def test_ring_wraps_around_keeping_the_newest_in_order() -> None:
    ring = ArrivalRing(capacity=4, max_age=100.0)
    for k in range(11):  # wraps twice and a bit: slots hold arrivals 7..10
        ring.record(float(k), 100 + k)
    times, rows = ring.snapshot(now=11.0)
    assert times == [7.0, 8.0, 9.0, 10.0]
    assert rows == [107, 108, 109, 110]
    assert ring.total == 11 and ring.overwritten == 7


def test_ring_is_bounded_by_age_and_by_since() -> None:
    ring = ArrivalRing(capacity=100, max_age=10.0)
    for k in range(30):
        ring.record(float(k), 1)
    times, _ = ring.snapshot(now=30.0)
    assert times == [float(k) for k in range(20, 30)]  # older than 10 s are never served
    times, _ = ring.snapshot(now=30.0, since=3.0)
    assert times == [27.0, 28.0, 29.0]
    times, _ = ring.snapshot(now=30.0, since=1000.0)  # since cannot widen past max_age
    assert times[0] == 20.0


def test_ring_memory_is_fixed_at_start() -> None:
    ring = ArrivalRing(capacity=1000, max_age=60.0)
    before = ring.nbytes
    for k in range(5000):
        ring.record(float(k), 3)
    assert ring.nbytes == before == 1000 * ARRIVAL_SLOT_BYTES


def test_outcome_ring_serves_the_window_in_arrival_order_with_fixed_memory() -> None:
    ring = OutcomeRing(capacity=8, max_age=100.0)
    before = ring.nbytes
    # Answered out of arrival order (a fast request overtakes a slow one), 12 of them: the ring
    # keeps the 8 newest answers.
    for k in range(12):
        arrival = float(k if k % 2 else k + 1.5)
        if k == 9:
            ring.record(arrival, FAILED, 0.001 * k)
        else:
            ring.record(arrival, 0.01 * k, 0.001 * k, 0.002 * k, 0.0001 * k)
    assert ring.nbytes == before == 8 * OUTCOME_SLOT_BYTES
    arrivals, latencies, waits, passes, handoffs = ring.snapshot_arrays(now=20.0)
    assert arrivals.tolist() == sorted(arrivals.tolist()) and len(arrivals) == 8
    held = {
        a: rest
        for a, *rest in zip(
            arrivals.tolist(), latencies.tolist(), waits.tolist(), passes.tolist(), handoffs.tolist(), strict=True
        )
    }
    # not served: recorded as such, not dropped; nor a pass nor a hand-off
    assert held[9.0][0] == held[9.0][2] == held[9.0][3] == FAILED
    assert held[7.0] == pytest.approx((0.07, 0.007, 0.014, 0.0007))
    assert 0.0 not in held and 1.0 not in held  # the oldest answers were overwritten
    arrivals, *_ = ring.snapshot_arrays(now=20.0, since=10.0)
    assert arrivals.tolist() == [11.0, 11.5]


def test_ring_rejects_bad_bounds() -> None:
    with pytest.raises(ValueError, match="capacity"):
        ArrivalRing(capacity=0)
    with pytest.raises(ValueError, match="max age"):
        ArrivalRing(capacity=4, max_age=0)


def test_bounds_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHPILOT_ARRIVAL_CAPACITY", "10")
    monkeypatch.setenv("BATCHPILOT_ARRIVAL_MAX_AGE", "30")
    assert capture_bounds_from_env() == (10, 30.0)
    monkeypatch.setenv("BATCHPILOT_ARRIVAL_CAPACITY", "lots")
    with pytest.raises(ValueError, match="BATCHPILOT_ARRIVAL_CAPACITY"):
        capture_bounds_from_env()


# ----------------------------------------------------------------------------- the document

CFG = RuntimeConfig.model_validate(
    {
        "policy": "shop",
        "revision": "abc123",
        "model": {"name": "m", "source": "builtin:tiny-mlp"},
        "lanes": [
            {"name": "interactive", "maxBatchSize": 8, "maxQueueDelay": "2ms", "maxQueueLength": 64,
             "requestTimeout": "1s", "priority": 10},
            {"name": "background", "maxBatchSize": 64, "maxQueueDelay": "20ms", "maxQueueLength": 512,
             "requestTimeout": "10s"},
        ],
    }
)  # fmt: skip


class Clock:
    def __init__(self, perf: float, wall: float) -> None:
        self.perf, self.wall_at = perf, wall

    def now(self) -> float:
        return self.perf

    def wall(self) -> float:
        return self.wall_at


def test_arrivals_doc_carries_revision_settings_and_wall_times() -> None:
    clock = Clock(perf=500.0, wall=1_700_000_000.0)
    cap = Capture(CFG, "canary", capacity=16, max_age=60.0, clock=clock.now, wall=clock.wall)
    cap.record(0, 490.0, 1)
    cap.record(0, 495.5, 3)
    cap.record(1, 499.0, 2)
    cap.cut[0].add(0.001)
    doc = cap.arrivals_doc(pod="shop-stable-x")
    assert (doc["kind"], doc["policy"], doc["revision"], doc["track"], doc["pod"]) == (
        "ArrivalCapture", "shop", "abc123", "canary", "shop-stable-x"
    )  # fmt: skip
    assert doc["bounds"] == {"capacity": 16, "maxAge": 60.0, "bytesPerLane": 16 * SLOT_BYTES}
    inter, back = doc["lanes"]
    assert inter["name"] == "interactive"
    assert inter["settings"] == {
        "maxBatchSize": 8, "maxQueueDelay": "2ms", "maxQueueLength": 64, "requestTimeout": "1s", "priority": 10
    }  # fmt: skip
    # perf 490 is wall 1_700_000_000 - 10
    assert inter["base"] == pytest.approx(1_700_000_000.0 - 10.0)
    assert inter["times"] == [0.0, 5.5] and inter["rows"] == [1, 3]
    assert back["times"] == [0.0] and back["rows"] == [2]
    assert inter["batchCutDelay"]["samples"] == 1
    assert back["batchCutDelay"] == {"samples": 0}
    # The window starts when the process started (it has run less than maxAge).
    assert doc["windowStart"] == pytest.approx(1_700_000_000.0)
    json.dumps(doc)  # serialisable as is


def test_arrivals_doc_marks_a_wrapped_ring_as_covering_only_what_it_holds() -> None:
    clock = Clock(perf=0.0, wall=1000.0)
    cap = Capture(CFG, "stable", capacity=4, max_age=3600.0, clock=clock.now, wall=clock.wall)
    clock.perf, clock.wall_at = 100.0, 1100.0
    for k in range(10):
        cap.record(0, 90.0 + k, 1)
    doc = cap.arrivals_doc()
    inter = doc["lanes"][0]
    assert inter["held"] == 4 and inter["overwritten"] == 6
    assert inter["coveredFrom"] == pytest.approx(1096.0)  # the oldest held arrival, not the window start


def test_capture_off_records_nothing() -> None:
    cap = Capture(CFG, "stable", capacity=0)
    cap.record(0, 1.0, 1)
    doc = cap.arrivals_doc()
    assert doc["enabled"] is False and "times" not in doc["lanes"][0]
    assert cap.nbytes == 0


def test_live_profile_prefers_live_samples_and_is_a_latency_profile() -> None:
    prof = LiveProfile(per_size=50)
    for _ in range(3):
        prof.add_warmup(1, 0.010)
        prof.add_warmup(4, 0.020)
    for k in range(60):  # more than per_size: only the last 50 are kept
        prof.add_live(1, 0.001 * (1 + k % 5))
    points = {p["batchSize"]: p for p in prof.points(min_live=20)}
    assert points[1]["source"] == "live" and points[1]["samples"] == 50
    assert points[1]["p50"] == "3ms" and points[1]["p99"] == "5ms"
    # Size 4 has warm-up passes only: scaled by what size 1 shows (live 3 ms / warm-up 10 ms).
    assert prof.warmup_scale(min_live=20) == pytest.approx(0.3)
    assert points[4]["source"] == "warmup" and points[4]["p50"] == "6ms"
    cap = Capture(CFG, "stable", capacity=4)
    cap.profile = prof
    doc = cap.profile_doc("cpu", 1)
    parsed = LatencyProfile.model_validate(doc)  # the format `batchpilot profile` writes
    assert parsed.exec_time(1, "p50") == pytest.approx(0.003)
    assert parsed.model.source == "builtin:tiny-mlp"
    # The simulator reads the mean (a busy period lasts the sum of its passes); the merge keeps
    # live points over warm-up ones.
    assert parsed.quantile == "mean" and parsed.exec_time(1) == pytest.approx(0.003)
    assert [p.source for p in parsed.points] == ["live", "warmup"]
    assert parsed.warmup_scale == pytest.approx(0.3)


def test_warm_up_passes_are_scaled_to_the_level_live_batches_run_at() -> None:
    # Warm-up timed on an idle machine (or beside other pods starting): the sizes served live show
    # how far off that level is now, and the sizes with warm-up passes only (past the lanes'
    # maxima) move with them, by the median ratio over the sizes that have both.
    prof = LiveProfile()
    assert prof.warmup_scale() is None
    for size, warm in ((1, 0.004), (2, 0.005), (8, 0.010), (32, 0.020)):
        for _ in range(3):
            prof.add_warmup(size, warm)
    assert prof.warmup_scale() is None  # no live batches yet: the warm-up level stands
    assert {p["batchSize"]: p["p50"] for p in prof.points()}[32] == "20ms"
    for _ in range(30):
        prof.add_live(1, 0.006)  # x1.5
        prof.add_live(2, 0.010)  # x2.0
        prof.add_live(8, 0.018)  # x1.8
    assert prof.warmup_scale() == pytest.approx(1.8)
    points = {p["batchSize"]: p for p in prof.points()}
    assert points[32]["source"] == "warmup" and points[32]["p50"] == "36ms"
    assert points[8]["source"] == "live" and points[8]["p50"] == "18ms"  # live points are as measured
    # A size with a few live batches pools them with its scaled warm-up passes.
    prof.add_live(32, 0.040)
    assert {p["batchSize"]: p for p in prof.points()}[32]["source"] == "warmup+live"
    assert {p["batchSize"]: p for p in prof.points()}[32]["p99"] == "40ms"


# ----------------------------------------------------------------------------- front end


class FakeCpu:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def feed(meter: FrontEndMeter, cpu: FakeCpu, now: float, seconds: int, rate: int, fill: int) -> float:
    """``seconds`` of ``rate`` requests/s in batches of ``fill``, at 0.25 ms per request and
    1.2 ms per batch on top of a 2% idle rate; returns the clock after them."""
    for _ in range(seconds):
        for k in range(rate):
            now += 1 / rate
            cpu.t += 0.00025 + 0.02 / rate
            if k % fill == 0:
                cpu.t += 0.0012
                meter.count_batch()
            meter.count(now)
    return now


def test_front_end_cost_splits_the_cpu_into_per_request_and_per_batch() -> None:
    cpu = FakeCpu()
    meter = FrontEndMeter(window=1.0, min_requests=100, cpu=cpu)
    now = 0.0
    meter.tick(now)
    for _ in range(10):  # idle seconds closed by scrapes
        now += 1.0
        cpu.t += 0.02
        meter.tick(now)
    assert meter.cost() is None  # no requests yet
    now = feed(meter, cpu, now, 5, 50, 1)  # a trickle: every request its own batch
    meter.tick(now + 1.0)
    # Requests and batches in lockstep: their costs cannot be told apart, so nothing is stated
    # (1.45 ms per request would bound the pod to a fifth of what it serves at load).
    assert meter.cost() is None
    now = feed(meter, cpu, now + 1.0, 5, 1000, 50)  # at load: batches of 50
    cpu.t += 0.02
    meter.tick(now + 1.0)
    got = meter.split()
    assert got is not None
    assert got[0] == pytest.approx(0.00025, rel=0.05) and got[1] == pytest.approx(0.0012, rel=0.1)
    assert meter.cost() == got[0] and meter.total == 5250


def test_front_end_cost_needs_enough_requests_and_never_goes_negative() -> None:
    cpu = FakeCpu()
    meter = FrontEndMeter(window=1.0, min_requests=50, cpu=cpu)
    for k in range(40):
        meter.count(k * 0.1)
        meter.count_batch()
    meter.tick(10.0)
    assert meter.cost() is None  # 40 requests < 50
    for k in range(400):
        meter.count(10.0 + k * 0.01)
        if k % 8 == 0:
            meter.count_batch()
    meter.tick(20.0)
    assert meter.cost() == 0.0  # a clock that never moved: no CPU, not a negative cost


def test_profile_doc_states_the_front_end_cost_once_measured() -> None:
    cpu = FakeCpu()
    cap = Capture(CFG, "stable", capacity=4)
    cap.profile.add_warmup(1, 0.002)
    cap.front_end = FrontEndMeter(window=0.5, min_requests=10, cpu=cpu)
    assert "frontEndCost" not in cap.profile_doc("cpu", 1)
    now = feed(cap.front_end, cpu, cap._clock(), 3, 20, 1)
    now = feed(cap.front_end, cpu, now, 3, 400, 20)
    cap.front_end.tick(now + 1.0)
    parsed = LatencyProfile.model_validate(cap.profile_doc("cpu", 1))
    assert parsed.front_end_cost == pytest.approx(0.00025, rel=0.1)


# ----------------------------------------------------------------------------- cut delay

LANE = LaneConfig.model_validate(
    {"name": "x", "maxBatchSize": 4, "maxQueueDelay": "10ms", "maxQueueLength": 10, "requestTimeout": "1s"}
)


def pend(t: float, rows: int = 1) -> Pending:
    import numpy as np

    return Pending(np.zeros((rows, 2), dtype="float32"), 0, t)


def test_cut_delay_of_a_window_batch_on_an_idle_model() -> None:
    batch = [pend(1.000), pend(1.004)]
    # due when the head's window (10 ms) expired: 1.010; cut at 1.0125 -> 2.5 ms late
    assert cut_delay(LANE, batch, 2, 1.0125, free_at=-math.inf) == pytest.approx(0.0025)


def test_cut_delay_of_a_full_batch_counts_from_the_filling_arrival() -> None:
    batch = [pend(1.000), pend(1.001), pend(1.002), pend(1.003)]
    assert cut_delay(LANE, batch, 4, 1.0035, free_at=0.5) == pytest.approx(0.0005)


def test_cut_delay_counts_from_when_the_model_freed() -> None:
    batch = [pend(1.000), pend(1.001)]
    # window expired at 1.010, but the model ran until 1.050: cut at 1.051 -> 1 ms late
    assert cut_delay(LANE, batch, 2, 1.051, free_at=1.050) == pytest.approx(0.001)
    assert cut_delay(LANE, batch, 2, 1.049, free_at=1.050) == 0.0


# ----------------------------------------------------------------------------- a real runtime

LANES = [lane("interactive", 8, "1ms", 100, "5s", priority=10), lane("background", 32, "5ms", 200, "10s")]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    os.environ["BATCHPILOT_ARRIVAL_CAPACITY"] = "50"  # small, so the test wraps the ring
    try:
        srv = Server(tmp_path_factory.mktemp("rt-capture"), LANES, extra={"revision": "rev-cap"})
    finally:
        del os.environ["BATCHPILOT_ARRIVAL_CAPACITY"]
    with srv:
        yield srv


def get_json(srv: Server, path: str) -> tuple[int, Any]:
    status, raw = srv.get(path)
    return status, json.loads(raw)


async def send(srv: Server, specs: list[tuple[str, int]]) -> None:
    async with aiohttp.ClientSession() as session:
        for lane_name, rows in specs:
            status, doc = await infer(session, srv, body([1.0] * rows), lane_header=lane_name)
            assert status == 200, doc


@pytest.mark.runtime_server
def test_arrivals_endpoint_serves_what_was_admitted(server: Server) -> None:
    specs = [("interactive", 1), ("interactive", 3), ("background", 2), ("interactive", 2)]
    asyncio.run(send(server, specs))
    status, doc = get_json(server, "/admin/arrivals")
    assert status == 200
    assert doc["revision"] == "rev-cap" and doc["policy"] == "test" and doc["track"] == "canary"
    assert doc["bounds"]["capacity"] == 50
    lanes = {entry["name"]: entry for entry in doc["lanes"]}
    assert lanes["interactive"]["settings"]["maxBatchSize"] == 8
    assert lanes["background"]["settings"]["maxQueueDelay"] == "5ms"
    inter_rows = lanes["interactive"]["rows"][-3:]
    assert inter_rows == [1, 3, 2]
    assert lanes["background"]["rows"][-1] == 2
    times = lanes["interactive"]["times"]
    assert times == sorted(times)
    # Every admitted request's outcome, keyed by the same arrival time (sent one at a time, so
    # each was answered before the next arrived): served, its queue wait within its latency.
    out = lanes["interactive"]["outcomes"]
    assert out["recorded"] == lanes["interactive"]["recorded"]
    assert out["times"][-3:] == times[-3:]
    # After the cut, the batch's pass and the answer's hand-off to the loop: within the latency.
    for latency, wait, pass_s, handoff in zip(
        out["latency"][-3:], out["queueWait"][-3:], out["pass"][-3:], out["handoff"][-3:], strict=True
    ):
        assert 0 <= wait <= latency < 5.0
        assert pass_s > 0 and handoff >= 0 and wait + pass_s + handoff <= latency + 1e-5  # rounded to 1 us
    # Wall-clock times: the last arrival happened within the last minute.
    assert abs(lanes["interactive"]["base"] + times[-1] - doc["capturedAt"]) < 60
    # A lane filter and a since filter.
    status, only = get_json(server, "/admin/arrivals?lane=background&since=1h")
    assert status == 200 and [e["name"] for e in only["lanes"]] == ["background"]
    status, err = get_json(server, "/admin/arrivals?lane=nope")
    assert status == 404 and "unknown lane" in err["error"]
    status, err = get_json(server, "/admin/arrivals?since=soon")
    assert status == 400 and "since" in err["error"]


@pytest.mark.runtime_server
def test_arrivals_ring_wraps_in_a_real_runtime(server: Server) -> None:
    _, before = get_json(server, "/admin/arrivals?lane=interactive")
    recorded = before["lanes"][0]["recorded"]
    asyncio.run(send(server, [("interactive", 1 + k % 4) for k in range(60)]))
    _, doc = get_json(server, "/admin/arrivals?lane=interactive")
    entry = doc["lanes"][0]
    assert entry["recorded"] == recorded + 60
    assert entry["held"] == 50 and entry["overwritten"] == recorded + 60 - 50
    assert entry["rows"] == [1 + k % 4 for k in range(10, 60)]  # the newest 50, in order


@pytest.mark.runtime_server
def test_profile_endpoint_serves_a_latency_profile_from_warmup_and_live(server: Server) -> None:
    status, doc = get_json(server, "/admin/profile")
    assert status == 200
    profile = LatencyProfile.model_validate(doc)
    assert profile.model.source == "python:bp_rt_models:testmodel"
    assert profile.model.device == "cpu" and profile.model.threads == 1
    # warm-up timed every warm size (1..16, 32 for the lanes' maxima 8 and 32), and sizes past
    # them for the tuner's larger candidates (up to 4 x 32)
    assert {1, 8, 16, 32, 64, 128} <= set(profile.batch_sizes)
    assert all(p.samples is not None and p.samples >= 3 for p in profile.points)
    status, raw = server.get("/admin/profile?format=yaml")
    assert status == 200 and raw.startswith(b"apiVersion: batchpilot.dev/v1alpha1")


@pytest.mark.runtime_server
def test_profile_states_the_time_requests_spend_outside_the_queue_and_the_model(server: Server) -> None:
    asyncio.run(send(server, [("interactive", 1)] * 40))
    _, doc = get_json(server, "/admin/profile")
    overhead = LatencyProfile.model_validate(doc).request_overhead
    _, arrivals = get_json(server, "/admin/arrivals?lane=interactive&since=1h")
    outcomes = arrivals["lanes"][0]["outcomes"]
    served = [(lat, wait) for lat, wait in zip(outcomes["latency"], outcomes["queueWait"], strict=True) if lat >= 0]
    assert len(served) >= 40
    # A part of every served request's latency, beyond its queue wait (the batch's pass is the rest).
    assert 0 < overhead < statistics.fmean(lat - wait for lat, wait in served)


@pytest.mark.runtime_server
def test_cut_delay_is_exported(server: Server) -> None:
    asyncio.run(send(server, [("interactive", 1)] * 5))
    count = wait_for(
        lambda: server.metric("batchpilot_batch_cut_delay_seconds_count", lane="interactive", revision="rev-cap"),
        what="cut delay samples",
    )
    assert count >= 5
    _, doc = get_json(server, "/admin/arrivals?lane=interactive")
    summary = doc["lanes"][0]["batchCutDelay"]
    assert summary["samples"] >= 5 and 0 <= summary["p50"] <= summary["p99"] < 1.0
