"""One batching rule: the runtime's Scheduler and every engine the tuner uses cut the same batches.

The tuner's exact engine *is* the runtime's :class:`~batchpilot_runtime.scheduler.Scheduler`
(admission, readiness, batch forming, timeouts) stepped on a simulated clock; the fast engine
(batch by batch over sorted arrivals) and the early-exit verdict (``meets_slo``) are
re-derivations of it for speed. Here the same arrivals go through all of them and must give
the same batches, in order: the same sizes cut at the same instants, the same waits, the same
drops and timeouts, and the same SLO verdict. Arrivals: both real traces of ``shared/traces``
(the conversation trace's 3-second buckets spread uniformly with a fixed seed, as its README
asks), Poisson, and on/off; settings from batch-1 to wide windows, with and without the
runtime's measured dispatch delay. No tolerance: the engines do the same arithmetic, so the
instants are equal to the last bit.
"""

from __future__ import annotations

import random

import pytest

from batchpilot_operator.tune.simulator import (
    LaneSettings,
    SimResult,
    Targets,
    simulate,
    simulate_exact,
    simulate_requests,
)
from batchpilot_operator.tune.slo_check import meets_slo
from batchpilot_operator.tune.trace import Trace, load_trace
from batchpilot_runtime.config import LaneConfig
from batchpilot_runtime.scheduler import Pending, QueueFull, Scheduler, State
from bptest import REPO

TRACES = REPO.parent / "shared" / "traces"
MS = 1e-3


def code_trace(rate: float, start: int, n: int = 1500) -> list[float]:
    times = load_trace(TRACES / "azure-llm-2023-code.csv").arrivals[start : start + n]
    scale = (len(times) - 1) / (times[-1] - times[0]) / rate
    return [(t - times[0]) * scale for t in times]


def conversation_trace(rate: float, n: int = 1500, seed: int = 3) -> list[float]:
    """The bucketed timestamps spread uniformly over their 3 s buckets (fixed seed)."""
    trace = Trace.from_times(load_trace(TRACES / "mooncake-2025-conversation.csv").arrivals[:n]).spread(3.0, seed)
    return [t * trace.mean_rate / rate for t in trace.arrivals]


def poisson(rate: float, n: int = 1500, seed: int = 5) -> list[float]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def on_off(rate: float, n: int = 1500, seed: int = 7) -> list[float]:
    """Poisson at 4x the rate for 0.5 s, then silence for 1.5 s: the same mean rate."""
    rng = random.Random(seed)
    t, out = 0.0, []
    while len(out) < n:
        t += rng.expovariate(4 * rate)
        if (t % 2.0) < 0.5:
            out.append(t)
    return out


ARRIVALS = {
    "code-calm": lambda: code_trace(60, 2000),
    "code-bursty": lambda: code_trace(150, 6000),
    "conversation": lambda: conversation_trace(120),
    "poisson": lambda: poisson(180),
    "on-off": lambda: on_off(120),
    "overload": lambda: poisson(900),
}
SETTINGS = [
    LaneSettings(1, 0.0),
    LaneSettings(4, 1 * MS),
    LaneSettings(8, 5 * MS),
    LaneSettings(32, 20 * MS),
    LaneSettings(16, 2 * MS, max_queue_length=24, request_timeout=0.25),
    LaneSettings(2, 1 * MS, max_queue_length=24, request_timeout=0.03),  # overloaded: drops and timeouts
]
TABLE = [0.0] + [2.1 * MS + 0.37 * MS * b for b in range(1, 33)]


def batches(res: SimResult) -> list[tuple[int, float]]:
    """Each batch in the order it was cut: (rows, the oldest row's wait at the cut)."""
    return list(zip(res.batch_sizes, res.oldest_ages, strict=True))


@pytest.mark.parametrize("delay", [0.0, 0.7 * MS])
@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: f"B{s.max_batch_size}-W{s.max_queue_delay * 1e3:g}ms")
@pytest.mark.parametrize("shape", sorted(ARRIVALS))
def test_every_engine_cuts_the_runtime_schedulers_batches(shape: str, settings: LaneSettings, delay: float) -> None:
    arrivals = ARRIVALS[shape]()
    exact = simulate_exact(arrivals, settings, TABLE, dispatch_delay=delay)  # the runtime's Scheduler
    auto = simulate(arrivals, settings, TABLE, dispatch_delay=delay)  # the fast engine (exact on a drop)
    assert batches(auto) == batches(exact)
    assert auto.queue_waits == exact.queue_waits and auto.latencies == exact.latencies
    assert (auto.dropped, auto.timeouts) == (exact.dropped, exact.timeouts)
    assert sum(exact.batch_sizes) + exact.dropped + exact.timeouts == len(arrivals), "every request accounted for"
    assert max(exact.batch_sizes) <= settings.max_batch_size
    # canary_eval's per-request view: the batch-by-batch walk (exact on a drop) gives every
    # request the exact engine's fate.
    records = simulate_requests(arrivals, settings, TABLE)
    exact_records = simulate_requests(arrivals, settings, TABLE, engine="exact")
    assert sorted(records, key=lambda r: r.arrival) == sorted(exact_records, key=lambda r: r.arrival)
    if delay == 0.0:
        assert sorted(r.latency for r in records if r.outcome == "ok") == sorted(exact.latencies)
    # The early-exit verdict agrees with the exact engine's quantiles (targets off the time grid).
    for lat in (0.00713, 0.0213, 0.0613):
        for age in (0.00307, 0.0117):
            want = exact.latency_quantile() <= lat and exact.queue_age_quantile() <= age
            assert meets_slo([arrivals], settings, TABLE, Targets(lat, age), dispatch_delay=delay) == want


def test_the_grid_covers_each_regime() -> None:
    """The cases above are not all alike: full batches, window cuts, drops and timeouts occur."""
    seen = {"full": False, "window": False, "dropped": False, "timed out": False}
    for make in ARRIVALS.values():
        arrivals = make()
        for s in SETTINGS:
            res = simulate_exact(arrivals, s, TABLE)
            seen["full"] |= s.max_batch_size > 1 and s.max_batch_size in res.batch_sizes
            seen["window"] |= any(0 < n < s.max_batch_size for n in res.batch_sizes)
            seen["dropped"] |= res.dropped > 0
            seen["timed out"] |= res.timeouts > 0
    assert all(seen.values()), seen


def test_the_scheduler_as_the_runtime_steps_it_agrees() -> None:
    """The runtime literally, on a fine simulated clock: each request's timer withdraws it at
    its timeout (the server's ``call_later``), and the worker loop selects and takes a batch at
    each instant the model is free. The batches, drops and timeouts are the exact engine's for
    the same arrivals (window cuts land on the clock's grid, so arrivals and window are on it)."""
    tick = 1.0  # whole-number instants: no float rounding decides a tie between a timer and an arrival
    rng = random.Random(11)
    arrivals = sorted(float(rng.randrange(0, 1200)) for _ in range(900))  # overloaded
    settings = LaneSettings(8, 8.0, max_queue_length=30, request_timeout=40.0)
    table = [0.0] + [6.0 + b for b in range(1, 9)]
    cfg = LaneConfig(name="lane", maxBatchSize=8, maxQueueDelay="8s", maxQueueLength=30, requestTimeout="40s")
    sched = Scheduler([cfg])
    free, i, step = 0.0, 0, 0
    cut: list[tuple[int, float]] = []
    dropped = timed_out = 0
    timers: list[Pending] = []
    while i < len(arrivals) or sched.pending_count():
        now = step * tick
        step += 1
        due = [p for p in timers if p.arrival + settings.request_timeout <= now + tick / 2]
        timed_out += sum(sched.withdraw(p, State.TIMED_OUT) for p in due)
        timers = [p for p in timers if p not in due and p.state is State.QUEUED]
        while i < len(arrivals) and arrivals[i] <= now + tick / 2:
            try:
                sched.admit(p := Pending(None, 0, arrivals[i], rows=1))
                timers.append(p)
            except QueueFull:
                dropped += 1
            i += 1
        if now + tick / 2 < free:
            continue  # the model is busy
        lane, _ = sched.select(now + tick / 2)  # a worker waking at the grid instant
        if lane is None:
            continue
        batch, expired = sched.take(lane, now + tick / 2)
        timed_out += len(expired)
        if batch:
            cut.append((len(batch), round((now - batch[0].arrival) / tick)))
            free = now + table[len(batch)]
    exact = simulate_exact(arrivals, settings, table)
    assert (dropped, timed_out) == (exact.dropped, exact.timeouts)
    assert cut == [(n, round(age / tick)) for n, age in batches(exact)]
    assert dropped and timed_out and len({n for n, _ in cut}) >= 2, "drops, timeouts, full and window cuts"
