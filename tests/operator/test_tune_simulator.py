"""The batcher simulator against closed-form cases, and its two engines against each other."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence

import pytest

from batchpilot_operator.tune.simulator import (
    LaneSettings,
    SimResult,
    Targets,
    allowed_misses,
    front_end,
    nearest_rank,
    simulate,
    simulate_exact,
    simulate_requests,
    split_arrivals,
)
from batchpilot_operator.tune.slo_check import meets_slo

MS = 1e-3


def linear_table(fixed: float, per_row: float, top: int) -> list[float]:
    return [0.0] + [fixed + per_row * b for b in range(1, top + 1)]


@pytest.mark.parametrize("engine", [simulate, simulate_exact])
def test_deterministic_arrivals_fill_batches_exactly(engine: object) -> None:
    # One arrival every 1 ms, batches of 4, a long window: every batch is full at its 4th
    # arrival, and runs 2 ms (< the 4 ms it takes the next batch to fill): no contention.
    n, d = 40, 1 * MS
    arrivals = [k * d for k in range(n)]
    table = [0.0, 1 * MS, 1.2 * MS, 1.6 * MS, 2 * MS]
    res = engine(arrivals, LaneSettings(4, 1.0), table)  # type: ignore[operator]
    assert res.batch_sizes == [4] * 10
    # Batch m dispatches at its 4th arrival (4m+3) ms and completes 2 ms later.
    expected = sorted((4 * (k // 4) + 3) * d + 2 * MS - k * d for k in range(n))
    assert sorted(res.latencies) == pytest.approx(expected)
    assert sorted(res.queue_waits) == pytest.approx(sorted((3 - k % 4) * d for k in range(n)))
    assert res.oldest_ages == pytest.approx([3 * d] * 10)
    assert res.utilization == pytest.approx(10 * 2 * MS / (39 * d + 2 * MS))
    assert res.dropped == res.timeouts == 0


@pytest.mark.parametrize("engine", [simulate, simulate_exact])
@pytest.mark.parametrize(("window", "third_dispatch"), [(10 * MS, 10 * MS), (0.0, 4 * MS)])
def test_single_burst_takes_ceil_n_over_b_batches(engine: object, window: float, third_dispatch: float) -> None:
    # 10 simultaneous requests, batches of 4, exec(b) = 1 ms + 0.25 ms/row (exec(4) = 2 ms):
    # two full batches back to back at 0 and 2 ms, then the 2 left over go when their window
    # expires (10 ms) or, with no window, as soon as the executor frees (4 ms).
    table = linear_table(1 * MS, 0.25 * MS, 4)
    res = engine([0.0] * 10, LaneSettings(4, window), table)  # type: ignore[operator]
    assert res.batch_sizes == [4, 4, 2]
    assert len(res.batch_sizes) == math.ceil(10 / 4)
    done = [2 * MS] * 4 + [4 * MS] * 4 + [third_dispatch + 1.5 * MS] * 2
    assert sorted(res.latencies) == pytest.approx(done)
    assert res.oldest_ages == pytest.approx([0.0, 2 * MS, third_dispatch])
    assert res.busy == pytest.approx(2 * MS + 2 * MS + 1.5 * MS)


@pytest.mark.parametrize("engine", [simulate, simulate_exact])
def test_isolated_requests_wait_out_the_window(engine: object) -> None:
    arrivals = [float(k) for k in range(20)]  # one per second, batches never fill
    table = linear_table(3 * MS, 1 * MS, 8)
    res = engine(arrivals, LaneSettings(8, 5 * MS), table)  # type: ignore[operator]
    assert res.batch_sizes == [1] * 20
    assert res.latencies == pytest.approx([5 * MS + 4 * MS] * 20)
    assert res.queue_age_quantile() == pytest.approx(5 * MS)
    assert res.latency_quantile(0.99) == pytest.approx(9 * MS)


@pytest.mark.parametrize("engine", [simulate, simulate_exact])
def test_utilization_and_throughput_without_batching(engine: object) -> None:
    n, d, e = 100, 10 * MS, 4 * MS
    arrivals = [k * d for k in range(n)]
    res = engine(arrivals, LaneSettings(1, 0.0), [0.0, e])  # type: ignore[operator]
    span = (n - 1) * d + e
    assert res.span == pytest.approx(span)
    assert res.utilization == pytest.approx(n * e / span)
    assert res.throughput == pytest.approx(n / span)
    assert res.latencies == pytest.approx([e] * n)


def test_busy_executor_dispatches_expired_window_at_once() -> None:
    # The first request goes alone when its 5 ms window expires and runs 20 ms (until 25 ms).
    # Two more arrive at 11 and 12 ms; their window expires at 16 ms while the model is busy,
    # so their batch goes the instant the model frees (25 ms) and carries both.
    table = [0.0] + [20 * MS] * 4
    res = simulate([0.0, 11 * MS, 12 * MS], LaneSettings(4, 5 * MS), table)
    assert res.batch_sizes == [1, 2]
    assert res.oldest_ages == pytest.approx([5 * MS, 14 * MS])
    assert sorted(res.latencies) == pytest.approx([25 * MS, 33 * MS, 34 * MS])


def test_queue_length_bound_drops_arrivals() -> None:
    # The model is busy 10 ms with the first request; a burst of 5 arrives at 1 ms and the
    # queue holds 2: three are rejected, the two admitted run one by one afterwards.
    table = [0.0, 10 * MS]
    arrivals = [0.0] + [1 * MS] * 5
    for engine in (simulate, simulate_exact):
        res = engine(arrivals, LaneSettings(1, 0.0, max_queue_length=2), table)
        assert (res.dropped, res.timeouts) == (3, 0)
        assert sorted(res.latencies) == pytest.approx([10 * MS, 19 * MS, 29 * MS])
        # Rejected requests count as infinitely late: 3 of 6 failed.
        assert res.latency_quantile(0.5) == pytest.approx(29 * MS)
        assert res.latency_quantile(0.6) == math.inf


def test_request_timeout_expires_queued_rows_unrun() -> None:
    # Exec 10 ms, timeout 15 ms, 4 simultaneous requests: two run (done at 10 and 20 ms; the
    # second was dispatched at 10 ms, before its timeout), the other two expire at 15 ms.
    table = [0.0, 10 * MS]
    for engine in (simulate, simulate_exact):
        res = engine([0.0] * 4, LaneSettings(1, 0.0, request_timeout=15 * MS), table)
        assert res.timeouts == 2
        assert sorted(res.latencies) == pytest.approx([10 * MS, 20 * MS])
        assert res.busy == pytest.approx(20 * MS)
        assert sorted(res.queue_waits) == pytest.approx([0.0, 10 * MS, 15 * MS, 15 * MS])


def test_request_overhead_adds_to_latency_only() -> None:
    arrivals = [0.0, 0.0, 0.0]
    res = simulate(arrivals, LaneSettings(1, 0.0), [0.0, 1 * MS], request_overhead=0.5 * MS)
    assert sorted(res.latencies) == pytest.approx([1.5 * MS, 2.5 * MS, 3.5 * MS])
    assert res.busy == pytest.approx(3 * MS)


def test_split_depends_on_index_only() -> None:
    arrivals = [k * 0.01 for k in range(1000)]
    a = split_arrivals(arrivals, 3, "random", seed=7)
    b = split_arrivals([t * 5 for t in arrivals], 3, "random", seed=7)
    assert [len(p) for p in a] == [len(p) for p in b]
    assert sum(len(p) for p in a) == 1000
    assert all(abs(len(p) - 333) < 60 for p in a)
    rr = split_arrivals(arrivals, 4, "round-robin")
    assert rr[1][:2] == [0.01, 0.05]


def test_quantile_definition_matches_miss_budget() -> None:
    values = sorted(float(k) for k in range(1, 201))
    assert nearest_rank(values, 0.99) == 198.0
    assert allowed_misses(200, 0.99) == 2  # 199 and 200 exceed 198
    assert allowed_misses(8819, 0.99) == 88


def _random_case(rng: random.Random) -> tuple[list[float], LaneSettings, list[float], int]:
    n = rng.randint(2, 250)
    t = 0.0
    arrivals = []
    for _ in range(n):
        t += rng.choice([0.0, 0.0, rng.expovariate(100), rng.expovariate(10), 0.001])
        arrivals.append(round(t, 4))
    b = rng.choice([1, 2, 3, 4, 8, 16])
    w = rng.choice([0.0, 0.001, 0.005, 0.02])
    timeout = rng.choice([math.inf, 0.03, 0.1])
    settings = LaneSettings(b, w, rng.choice([1, 2, 5, 1_000_000]), timeout)
    table = linear_table(2 * MS, 0.5 * MS, 16)
    return arrivals, settings, table, rng.choice([1, 2, 3])


Run = tuple[list[float], LaneSettings, list[float], int, dict[str, float], SimResult, SimResult]


def _random_runs(seed: int, n: int, option: str | None = None, values: Sequence[float] = ()) -> Iterator[Run]:
    """``n`` random cases, each simulated by both engines, with ``option`` (a keyword argument of
    both) drawn from ``values`` after the case: (arrivals, settings, table, replicas, the
    options, the fast engine's result, the exact one's)."""
    rng = random.Random(seed)
    for _ in range(n):
        arrivals, settings, table, replicas = _random_case(rng)
        options = {option: rng.choice(values)} if option else {}
        fast = simulate(arrivals, settings, table, replicas=replicas, **options)
        exact = simulate_exact(arrivals, settings, table, replicas=replicas, **options)
        yield arrivals, settings, table, replicas, options, fast, exact


def _meets_slo_agrees(run: Run, ages: Sequence[float]) -> None:
    """meets_slo, at targets off the simulation's time grid (so that no float tie decides a
    verdict), says what the exact engine's quantiles say."""
    arrivals, settings, table, replicas, options, _, exact = run
    parts = split_arrivals(arrivals, replicas)
    for lat in (0.00313, 0.0103, 0.0513):
        for age in ages:
            want = exact.latency_quantile() <= lat and exact.queue_age_quantile() <= age
            assert meets_slo(parts, settings, table, Targets(lat, age), **options) == want


def test_fast_and_exact_engines_agree_and_meets_slo_matches_quantiles() -> None:
    for run in _random_runs(1, 250):
        *_, fast, exact = run
        assert sorted(fast.latencies) == sorted(exact.latencies)
        assert sorted(fast.queue_waits) == sorted(exact.queue_waits)
        assert sorted(fast.batch_sizes) == sorted(exact.batch_sizes)
        assert (fast.dropped, fast.timeouts) == (exact.dropped, exact.timeouts)
        _meets_slo_agrees(run, ages=(0.00107, 0.0217))


@pytest.mark.parametrize("engine", [simulate, simulate_exact])
def test_exec_scale_multiplies_each_batch_in_turn(engine: object) -> None:
    arrivals = [0.0, 1.0, 2.0, 3.0]
    res = engine(arrivals, LaneSettings(1, 0.0), [0.0, 2 * MS], exec_scale=[1.0, 3.0])  # type: ignore[operator]
    assert res.exec_times == pytest.approx([2 * MS, 6 * MS, 2 * MS, 6 * MS])
    assert res.latencies == pytest.approx([2 * MS, 6 * MS, 2 * MS, 6 * MS])


def test_engines_agree_with_a_dispatch_delay() -> None:
    for run in _random_runs(2, 150, "dispatch_delay", [0.0003, 0.0011, 0.004]):
        *_, fast, exact = run
        assert sorted(fast.latencies) == pytest.approx(sorted(exact.latencies))
        assert sorted(fast.batch_sizes) == sorted(exact.batch_sizes)
        assert (fast.dropped, fast.timeouts) == (exact.dropped, exact.timeouts)
        _meets_slo_agrees(run, ages=(0.0217,))


@pytest.mark.parametrize("engine", [simulate, simulate_exact])
def test_dispatch_delay_delays_each_cut_and_lets_late_rows_join(engine: object) -> None:
    # B=4, window 1 ms: the head's window expires at 1 ms, the cut comes 2 ms later (3 ms), by
    # when a row that arrived at 2.5 ms has joined; the executor then runs 2 ms.
    res = engine([0.0, 0.0025], LaneSettings(4, 1 * MS), [0.0] + [2 * MS] * 4, dispatch_delay=2 * MS)  # type: ignore[operator]
    assert res.batch_sizes == [2]
    assert sorted(res.queue_waits) == pytest.approx([0.5 * MS, 3 * MS])
    assert sorted(res.latencies) == pytest.approx([2.5 * MS, 5 * MS])
    # Back to back: a saturated executor pays the delay at every batch (capacity falls).
    busy = engine([0.0] * 4, LaneSettings(1, 0.0), [0.0, 1 * MS], dispatch_delay=1 * MS)  # type: ignore[operator]
    assert sorted(busy.latencies) == pytest.approx([2 * MS, 4 * MS, 6 * MS, 8 * MS])


# ----------------------------------------------------------------------------- the HTTP front end


def test_front_end_queues_a_burst_before_the_batcher() -> None:
    # Four requests at once through a loop of 1 ms each: they reach the batcher at 0, 1, 2, 3 ms.
    assert front_end([0.0, 0.0, 0.0, 0.0], 1 * MS) == pytest.approx([0.0, 1 * MS, 2 * MS, 3 * MS])
    # Spaced wider than the cost: untouched (the idle cost is already in request_overhead).
    spaced = [0.0, 0.002, 0.0045, 0.01]
    assert front_end(spaced, 1 * MS) == spaced


@pytest.mark.parametrize("engine", [simulate, simulate_exact])
def test_front_end_wait_counts_in_latency_not_in_queue_age(engine: object) -> None:
    # B=4 with a 10 ms window: the 4th row reaches the batcher at 3 ms (the loop's backlog) and
    # fills the batch then; the model runs 2 ms. Latency counts from the arrival at the pod
    # (5 ms for every row); queue age from the handler (3, 2, 1, 0 ms), as the runtime's metric.
    res = engine([0.0] * 4, LaneSettings(4, 10 * MS), [0.0] + [2 * MS] * 4, front_end_cost=1 * MS)  # type: ignore[operator]
    assert res.batch_sizes == [4]
    assert res.latencies == pytest.approx([5 * MS] * 4)
    assert sorted(res.queue_waits) == pytest.approx([0.0, 1 * MS, 2 * MS, 3 * MS])
    # Without a backlog nothing changes.
    spaced = [k * 0.01 for k in range(20)]
    table = [0.0] + [2 * MS] * 4
    plain = engine(spaced, LaneSettings(4, 1 * MS), table)  # type: ignore[operator]
    fronted = engine(spaced, LaneSettings(4, 1 * MS), table, front_end_cost=1 * MS)  # type: ignore[operator]
    assert fronted.latencies == pytest.approx(plain.latencies)


def test_front_end_caps_throughput_at_one_over_its_cost() -> None:
    # 2000 requests at once; a model that would take 64 rows in 1 ms. A loop of 0.5 ms each
    # delivers 2000 requests/s, so the last one is answered about 1 s after it arrived.
    res = simulate([0.0] * 2000, LaneSettings(64, 0.0), [0.0] + [1 * MS] * 64, front_end_cost=0.5 * MS)
    assert max(res.latencies) == pytest.approx(1.0, rel=0.01)
    assert simulate([0.0] * 2000, LaneSettings(64, 0.0), [0.0] + [1 * MS] * 64).latency_quantile(1.0) < 0.05


def test_engines_and_meets_slo_agree_with_a_front_end() -> None:
    for run in _random_runs(3, 150, "front_end_cost", [0.0002, 0.0009, 0.003]):
        arrivals, settings, table, replicas, options, fast, exact = run
        cost = options["front_end_cost"]
        assert sorted(fast.latencies) == pytest.approx(sorted(exact.latencies))
        assert sorted(fast.queue_waits) == pytest.approx(sorted(exact.queue_waits))
        assert sorted(fast.batch_sizes) == sorted(exact.batch_sizes)
        assert (fast.dropped, fast.timeouts) == (exact.dropped, exact.timeouts)
        _meets_slo_agrees(run, ages=(0.00107, 0.0217))
        if replicas == 1:
            records = simulate_requests(arrivals, settings, table, front_end_cost=cost)
            exact_records = simulate_requests(arrivals, settings, table, front_end_cost=cost, engine="exact")
            assert [r.arrival for r in records if r.outcome == "ok"] == [
                r.arrival for r in sorted(exact_records, key=lambda r: r.arrival) if r.outcome == "ok"
            ]
            assert sorted(r.latency for r in records if r.latency is not None) == pytest.approx(
                sorted(r.latency for r in exact_records if r.latency is not None)
            )
