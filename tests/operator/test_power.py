"""What the gate can see (``power``): the smallest p99 regression a rollout detects, checked
against the verdict itself (``analysis.judge``) on the counts that regression would give. Pure."""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Any

import pytest

from batchpilot_operator.analysis import P99_BUDGET, SLICES, TALLY_ANALYSES, MetricCheck, Outcome, judge
from batchpilot_operator.analysis.tally import ComparedWindow, compared_evidence, compared_key, compared_windows
from batchpilot_operator.fairness import gating_analyses
from batchpilot_operator.power import (
    LIMIT,
    RATE_PRECISION,
    Tally,
    detectable_error_rate,
    detectable_regression,
    detects,
    lane_detectable_error_rate,
    lane_detectable_regression,
    relative_detectable_regression,
    tally_scale,
)
from batchpilot_operator.spec import PolicySpec
from batchpilot_operator.stats import burst_variance, count_above
from batchpilot_runtime.metrics import LATENCY_BUCKETS
from bptest import INTERACTIVE_LANE

SLO = 0.12


def histogram(latencies: list[float]) -> tuple[tuple[float, float], ...]:
    """The runtime's cumulative buckets of ``latencies``, as Prometheus returns them."""
    bounds = [*LATENCY_BUCKETS, math.inf]
    return tuple((b, float(sum(x <= b for x in latencies))) for b in bounds)


def lognormal(median: float, sigma: float, n: int = 4000, seed: int = 7) -> tuple[tuple[float, float], ...]:
    rng = random.Random(seed)
    return histogram([median * math.exp(rng.gauss(0, sigma)) for _ in range(n)])


def metric_check(
    track: str, metric: str, bad: float, samples: float, limit: float, value: float, threshold: float, **extra: Any
) -> MetricCheck:
    """A window's check of the interactive lane: failed when its share of bad events is over ``limit``."""
    return MetricCheck(
        track=track,  # type: ignore[arg-type]
        revision=track,
        lane="interactive",
        metric=metric,  # type: ignore[arg-type]
        query="q",
        samples_query="n",
        value=value,
        samples=samples,
        threshold=threshold,
        outcome=Outcome.FAILED if bad / samples > limit else Outcome.SUCCESSFUL,
        bad=bad,
        **extra,
    )


def check(track: str, bad: float, samples: float) -> MetricCheck:
    over = bad / samples > P99_BUDGET
    return metric_check(track, "p99Latency", bad, samples, P99_BUDGET, SLO * 2 if over else SLO / 2, SLO)


def verdict_at(buckets: tuple[tuple[float, float], ...], factor: float, n_canary: float, n_stable: float) -> Outcome:
    """The real verdict on a canary whose latencies are the stable's times ``factor``."""
    total = buckets[-1][1]
    canary = check("canary", round(count_above(buckets, SLO / factor) / total * n_canary), n_canary)
    stable = check("stable", round(count_above(buckets, SLO) / total * n_stable), n_stable)
    return judge(canary, stable, 0.95).outcome


@pytest.mark.parametrize(
    ("median", "sigma", "n_canary", "n_stable"),
    [
        (0.03, 0.5, 1200, 3600),  # the stable well inside its SLO (p99 ~96 ms of 120)
        (0.05, 0.4, 400, 1200),  # nearer, less traffic
        (0.04, 0.6, 400, 400),  # the stable breaching a little itself (a shared breach needs 2x)
        (0.02, 0.3, 4000, 4000),  # far inside: only a large regression breaches at all
    ],
)
def test_the_detectable_regression_is_where_the_verdict_starts_to_fail(
    median: float, sigma: float, n_canary: float, n_stable: float
) -> None:
    buckets = lognormal(median, sigma)
    x = detectable_regression(
        buckets, SLO, Tally(canary_requests=n_canary, stable_requests=n_stable, confidence=0.95, budget=P99_BUDGET)
    )
    assert 0 < x < LIMIT
    assert verdict_at(buckets, 1 + x, n_canary, n_stable) is Outcome.FAILED
    assert verdict_at(buckets, 1 + x + 0.3, n_canary, n_stable) is Outcome.FAILED
    assert verdict_at(buckets, max(1.0, 1 + x - 0.05), n_canary, n_stable) is not Outcome.FAILED


def test_more_traffic_sees_smaller_regressions_and_a_far_stable_needs_larger_ones() -> None:
    near = lognormal(0.04, 0.5)

    def x(buckets: tuple[tuple[float, float], ...], n: float) -> float:
        return detectable_regression(
            buckets, SLO, Tally(canary_requests=n, stable_requests=3 * n, confidence=0.95, budget=P99_BUDGET)
        )

    thin, thick = x(near, 200), x(near, 5000)
    assert thick < thin
    assert x(lognormal(0.01, 0.5), 1000) > x(near, 1000)
    # no traffic on either side, or a stable so far inside that even 10x does not breach
    assert math.isinf(x(lognormal(0.0005, 0.2), 1000))
    assert not detects(
        near, SLO, 3.0, Tally(canary_requests=0, stable_requests=100, confidence=0.95, budget=P99_BUDGET)
    )


def test_a_canary_already_breaching_at_no_regression_reads_zero() -> None:
    # the stable at ~8% over the SLO with a tiny stable sample: the rule needs 2x its share,
    # so 0 is only returned when the bare stable distribution would already fail
    buckets = lognormal(0.08, 0.3)
    x = detectable_regression(
        buckets, SLO, Tally(canary_requests=2000, stable_requests=2000, confidence=0.95, budget=0.01)
    )
    assert x > 0
    assert verdict_at(buckets, 1.0, 2000, 2000) is not Outcome.FAILED


def _rollout_spec(replicas: int, steps: list[tuple[int, str]], interval: str, routed: bool) -> PolicySpec:
    rollout: dict[str, object] = {
        "steps": [{"weight": w, "pause": p} for w, p in steps],
        "analysisInterval": interval,
    }
    if routed:
        rollout["trafficRouting"] = {"gatewayAPI": {"httpRoute": "r"}}
    return PolicySpec.model_validate(
        {
            "model": {"name": "m", "image": "img:1", "source": "builtin:mlp"},
            "replicas": replicas,
            "lanes": [dict(INTERACTIVE_LANE, requestTimeout="1s")],
            "slo": {"p99Latency": "120ms", "maxQueueAge": "60ms"},
            "rollout": rollout,
        }
    )


def test_the_gate_sees_what_its_last_like_for_like_steps_gather() -> None:
    # The demo's clocks (steps of 20 s, an analysis every 15 s): a clean step passes on the one
    # analysis its pause holds. With the replica ratio every step feeds the canary alike (1 + 1
    # analyses); on a route with 2 replicas only the 50% step compares like with like (10% and
    # 25% feed a canary pod 0.22 and 0.67 of a stable pod's rate): 1. The shipped example's
    # 5-minute pauses fill a tally within its last step.
    demo = [(25, "20s"), (50, "20s")]
    shipped = [(10, "5m"), (25, "5m"), (50, "5m")]
    assert gating_analyses(_rollout_spec(4, demo, "15s", routed=False)) == 2
    assert gating_analyses(_rollout_spec(2, [(10, "20s"), (25, "20s"), (50, "20s")], "15s", routed=True)) == 1
    assert gating_analyses(_rollout_spec(2, shipped, "30s", routed=True)) == TALLY_ANALYSES
    assert gating_analyses(_rollout_spec(4, [(50, "0s")], "15s", routed=True)) == 1
    assert gating_analyses(_rollout_spec(4, [(25, "30s"), (50, "45s")], "15s", routed=False)) == TALLY_ANALYSES
    # and fewer analyses see only larger regressions: the status says what this rollout can see
    near = lognormal(0.04, 0.5)
    stable = check("stable", count_above(near, SLO) / near[-1][1] * 300, 300)
    stable = dataclasses.replace(stable, buckets=near)
    canary = check("canary", 0, 300)
    one, full = (lane_detectable_regression(canary, stable, 0.95, n) for n in (1, TALLY_ANALYSES))
    assert one is not None and full is not None and one > full


def test_a_quiet_window_is_judged_on_the_tally_the_busier_ones_filled() -> None:
    # The canary's tally holds 1200 requests from busier windows; this window brought 30. The
    # verdict is on the 1200 (and what comes): the statement reads them, not 4 x 30, and equals
    # that of a window at the tally's average rate. A tally holding less than the windows to come
    # at this rate changes nothing.
    near = lognormal(0.04, 0.5)
    stable = dataclasses.replace(check("stable", count_above(near, SLO) / near[-1][1] * 30, 30), buckets=near)
    quiet = dataclasses.replace(check("canary", 0, 30), tally=(0.0, 1200.0))
    alone = check("canary", 0, 30)
    average = dataclasses.replace(check("stable", count_above(near, SLO) / near[-1][1] * 300, 300), buckets=near)
    assert tally_scale(quiet, TALLY_ANALYSES) == pytest.approx(40.0)
    assert tally_scale(alone, TALLY_ANALYSES) == TALLY_ANALYSES
    assert tally_scale(dataclasses.replace(alone, tally=(0.0, 60.0)), TALLY_ANALYSES) == TALLY_ANALYSES
    judged = lane_detectable_regression(quiet, stable, 0.95)
    thin = lane_detectable_regression(alone, stable, 0.95)
    busy = lane_detectable_regression(check("canary", 0, 300), average, 0.95)
    assert judged is not None and thin is not None and busy is not None
    assert judged < thin
    assert judged == pytest.approx(busy, abs=0.02)


def error_check(track: str, bad: float, samples: float, budget: float) -> MetricCheck:
    return metric_check(track, "errorRate", bad, samples, budget, bad / samples, budget, budget=budget)


def error_verdict(rate: float, stable_share: float, n_canary: int, n_stable: int, budget: float) -> Outcome:
    """The real verdict on a canary erring at ``rate`` (counts rounded as the pods would give)."""
    canary = error_check("canary", round(rate * n_canary), n_canary, budget)
    stable = error_check("stable", round(stable_share * n_stable), n_stable, budget)
    return judge(canary, stable, 0.95).outcome


@pytest.mark.parametrize(
    ("stable_share", "n_canary", "n_stable", "budget"),
    [
        (0.0, 1200, 3600, 0.01),  # a clean stable, the demo's traffic over a tally
        (0.002, 400, 1200, 0.01),  # thinner, a stable erring a little within its budget
        (0.015, 2000, 2000, 0.01),  # the stable over its budget itself: 2x its share is needed
        (0.0, 5000, 5000, 0.05),  # a looser budget
    ],
)
def test_the_detectable_error_rate_is_where_the_verdict_starts_to_fail(
    stable_share: float, n_canary: int, n_stable: int, budget: float
) -> None:
    e = detectable_error_rate(
        stable_share, Tally(canary_requests=n_canary, stable_requests=n_stable, confidence=0.95, budget=budget)
    )
    assert budget < e < 1
    if stable_share > budget:
        assert e >= 2 * stable_share
    # the verdict on whole counts: fails at E (and above), not a step of counts below it
    step = max(RATE_PRECISION, 2 / n_canary)
    assert error_verdict(e + 1 / n_canary, stable_share, n_canary, n_stable, budget) is Outcome.FAILED
    assert error_verdict(e + 0.02, stable_share, n_canary, n_stable, budget) is Outcome.FAILED
    assert error_verdict(e - step, stable_share, n_canary, n_stable, budget) is not Outcome.FAILED


def test_more_traffic_sees_smaller_error_rates_and_none_is_seen_without_traffic() -> None:
    def e(n: float) -> float:
        return detectable_error_rate(0.0, Tally(canary_requests=n, stable_requests=3 * n, confidence=0.95, budget=0.01))

    assert e(20_000) < e(2_000) < e(200)
    # a 2% shed against a 1% budget: out of reach for a thin tally, within it at more traffic
    assert e(200) > 0.02 > e(20_000)
    assert math.isinf(e(1))  # 1 request against 3: even a failed one is not clearly worse (Fisher: 25%)
    canary = error_check("canary", 0, 300, 0.01)
    assert lane_detectable_error_rate(canary, None, 0.95) is None
    stable = error_check("stable", 0, 900, 0.01)
    assert lane_detectable_error_rate(canary, stable, 0.95, 4, power=0.5) == e(1200)
    # what the status states is caught in 95% of rollouts, not half: a larger rate
    assert lane_detectable_error_rate(canary, stable, 0.95, 4) > e(1200)


# ---- what the status states is caught in 95% of rollouts, bursts included
def bursty_slices(
    rng: random.Random, share: float, burstiness: float, per_sub: int, subs: int
) -> list[tuple[float, float]]:
    """(bad, requests) per sub-window: each request of a sub-window goes bad with probability
    ``share * L``, ``L`` drawn per sub-window with mean 1 and variance ``burstiness`` (gamma)."""
    out = []
    for _ in range(subs):
        mult = rng.gammavariate(1 / burstiness, burstiness) if burstiness > 0 else 1.0
        p = min(1.0, share * mult)
        out.append((float(sum(rng.random() < p for _ in range(per_sub))), float(per_sub)))
    return out


@pytest.mark.parametrize("burstiness", [0.0, 1.0, 4.0])
def test_burst_variance_recovers_the_bursts_of_the_traffic(burstiness: float) -> None:
    found = burst_variance(bursty_slices(random.Random(1), 0.01, burstiness, 300, 1500))
    assert found is not None
    assert found == pytest.approx(burstiness, abs=0.1, rel=0.25)


def caught(share: float, burstiness: float, per_sub: int, draws: int = 300) -> float:
    """The share of ``draws`` tallies (4 analyses of 5 sub-windows) of a canary erring at
    ``share`` with this burstiness, against a clean stable of 3x its traffic, that the real
    verdict (both tests, sub-windows included) fails."""
    rng = random.Random(7)
    subs = TALLY_ANALYSES * SLICES
    failed = 0
    for _ in range(draws):
        cs = bursty_slices(rng, share, burstiness, per_sub, subs)
        ss = [(0.0, 3.0 * per_sub)] * subs
        n = sum(r for _, r in cs)
        canary = error_check("canary", sum(k for k, _ in cs), n, 0.01)
        failed += judge(canary, error_check("stable", 0, 3 * n, 0.01), 0.95, cs, ss).outcome is Outcome.FAILED
    return failed / draws


@pytest.mark.parametrize(("burstiness", "per_sub"), [(0.0, 100), (2.0, 100), (2.0, 30)])
def test_the_stated_error_rate_is_caught_in_95_percent_of_rollouts(burstiness: float, per_sub: int) -> None:
    subs = TALLY_ANALYSES * SLICES
    canary = error_check("canary", 0, per_sub * subs / TALLY_ANALYSES, 0.01)
    stable = error_check("stable", 0, 3 * per_sub * subs / TALLY_ANALYSES, 0.01)
    said = lane_detectable_error_rate(canary, stable, 0.95, TALLY_ANALYSES, burstiness=burstiness)
    assert said is not None and said < 1
    assert caught(said, burstiness, per_sub) >= 0.9
    # the expected counts' threshold (the statement before) is caught about half the time, and
    # a statement blind to the bursts far less than it promises
    at_expected = lane_detectable_error_rate(canary, stable, 0.95, TALLY_ANALYSES, power=0.5, burstiness=burstiness)
    assert at_expected is not None and caught(at_expected, burstiness, per_sub) <= 0.6
    if burstiness > 0:
        blind = lane_detectable_error_rate(canary, stable, 0.95, TALLY_ANALYSES, burstiness=0.0)
        assert blind is not None and blind < said and caught(blind, burstiness, per_sub) <= 0.6


def _p99(buckets: tuple[tuple[float, float], ...]) -> float:
    """The histogram's p99 as the relative objective's threshold reads it (interpolated)."""
    lo, hi = 0.0, 10.0
    total = buckets[-1][1]
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if count_above(buckets, mid) > 0.01 * total else (lo, mid)
    return hi


def compared(buckets: tuple[tuple[float, float], ...], canary: float, at: float = 0.0) -> ComparedWindow:
    return ComparedWindow(at, 1.15 * _p99(buckets), canary, buckets)


def relative_tally(windows: list[ComparedWindow], analyses: int = TALLY_ANALYSES) -> Tally:
    scale = max(1.0, analyses / len(windows))
    return Tally(
        sum(w.canary_requests for w in windows) * scale,
        sum(w.stable_requests for w in windows) * scale,
        0.95,
        P99_BUDGET,
        0.95,
        subwindows=round(len(windows) * scale * SLICES),
        needed=160.0,
        on_budget=True,
    )


def test_the_relative_statement_of_one_window_is_that_windows_rule() -> None:
    # One comparing window: the statement over the windows is the single-window statement at
    # that window's threshold, on the same tally.
    buckets = lognormal(0.02, 0.35, n=200)
    w = compared(buckets, 200.0)
    tally = relative_tally([w])
    assert relative_detectable_regression([w], tally) == detectable_regression(buckets, w.threshold, tally)


def test_the_relative_statement_pools_windows_by_their_own_thresholds() -> None:
    # A window whose tail is long (few requests between 0.7x and 1.15x its p99: a 1.5x slowdown
    # puts few over its threshold) and one whose tail is short: over both, each counted against
    # its own threshold, the statement lies between the two windows' own; its threshold is each
    # window's, not one pooled p99 (the quiet window's requests would all sit under a busier
    # window's threshold).
    long_tail = lognormal(0.01, 0.9, n=200, seed=3)
    short_tail = lognormal(0.03, 0.2, n=200, seed=4)
    a, b = compared(long_tail, 200.0), compared(short_tail, 200.0)
    both = relative_tally([a, b])
    x_a = relative_detectable_regression([a], both)
    x_b = relative_detectable_regression([b], both)
    x = relative_detectable_regression([a, b], both)
    assert x_b < x < x_a, (x_b, x, x_a)
    # No window that compared: nothing to state from.
    assert math.isinf(relative_detectable_regression([], both))


def test_compared_windows_are_kept_beside_the_tally_as_json_rows() -> None:
    # The last TALLY_ANALYSES comparing windows of a lane, in rows JSON can hold (no infinity),
    # read back as they were; a window of other bucket bounds starts the list afresh.
    evidence: dict[str, list[list[float]]] = {}
    windows = [compared(lognormal(0.02, 0.35, n=100 + i, seed=i), 50.0 + i, at=1000.0 + 20 * i) for i in range(6)]
    for w in windows:
        evidence = {**evidence, **compared_evidence({"interactive": w}, evidence)}
    rows = evidence[compared_key("interactive")]
    assert all(math.isfinite(x) for row in rows for x in row)
    assert compared_windows(evidence, "interactive") == windows[-TALLY_ANALYSES:]
    assert compared_windows(evidence, "batch") == []
    other = ComparedWindow(2000.0, 0.05, 10.0, ((0.01, 1.0), (0.1, 9.0), (math.inf, 10.0)))
    evidence = {**evidence, **compared_evidence({"interactive": other}, evidence)}
    assert compared_windows(evidence, "interactive") == [other]
