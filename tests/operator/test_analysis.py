"""PromQL builders and verdict logic of the canary analysis (pure; a dict stands in for Prometheus)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from statistics import NormalDist
from typing import Any

import pytest

from batchpilot_operator.analysis import (
    METRICS,
    NO_STABLE_P99,
    OBJECTIVES,
    SLICES,
    STABLE_TOO_THIN,
    TALLY_SLICES,
    AnalysisResult,
    LaneVerdict,
    Measurement,
    MetricsBackend,
    Outcome,
    build_queries,
    check_metric,
    combine,
    counter_queries,
    judge,
    judged_metrics,
    lane_thresholds,
    objective,
    plan_queries,
    promql_window,
    run_analysis,
    selector,
    sequential_needed,
    slice_counts,
    verdicts,
)
from batchpilot_operator.analysis.objectives import Counted
from batchpilot_operator.fairness import gating_analyses
from batchpilot_operator.power import lane_detectable_regression
from batchpilot_operator.rollout import Observed, PlanInputs
from batchpilot_operator.rollout.evidence import record_analysis
from batchpilot_operator.rollout.state import PlanState
from batchpilot_operator.spec import PolicySpec
from batchpilot_operator.status import RolloutState, Status
from bptest import conclusive, make_spec

NOW = datetime(2026, 11, 30, 2, 0, tzinfo=UTC)
SEL = 'namespace="ml",policy="chat",track="canary",revision="abc123",lane="interactive"'


def test_queries_are_exactly_the_documented_promql() -> None:
    q = build_queries(policy="chat", namespace="ml", track="canary", revision="abc123", lane="interactive", window=30)
    assert q.window == "30s"
    lat, qa = q.metric("p99Latency"), q.metric("queueAge")
    assert lat.value == (
        f"histogram_quantile(0.99, sum by (le) (rate(batchpilot_request_latency_seconds_bucket{{{SEL}}}[30s])))"
    )
    assert lat.samples == f"sum(increase(batchpilot_request_latency_seconds_count{{{SEL}}}[30s]))"
    assert qa.value == (
        f"histogram_quantile(0.99, sum by (le) (rate(batchpilot_queue_age_seconds_bucket{{{SEL}}}[30s])))"
    )
    assert qa.samples == f"sum(increase(batchpilot_queue_age_seconds_count{{{SEL}}}[30s]))"
    err = q.metric("errorRate")
    errors = f'{SEL},outcome=~"rejected_full|timed_out|failed|unavailable"'
    served = f'{SEL},outcome!="invalid"'
    assert err.value == (
        f"(sum(rate(batchpilot_requests_total{{{errors}}}[30s])) or vector(0))"
        f" / sum(rate(batchpilot_requests_total{{{served}}}[30s]))"
    )
    assert err.samples == f"sum(increase(batchpilot_requests_total{{{served}}}[30s]))"
    # The bad events: the buckets by le (the count over a threshold is read from them), errors.
    assert lat.bad == f"sum by (le) (increase(batchpilot_request_latency_seconds_bucket{{{SEL}}}[30s]))"
    assert qa.bad == f"sum by (le) (increase(batchpilot_queue_age_seconds_bucket{{{SEL}}}[30s]))"
    assert err.bad == f"sum(increase(batchpilot_requests_total{{{errors}}}[30s])) or vector(0)"
    # Client-breaking changes (issue 12): the share of all requests answered 4xx, by code too.
    rej = q.metric("clientErrors")
    rejected = f'{SEL},outcome="invalid"'
    assert rej.value == (
        f"(sum(rate(batchpilot_requests_total{{{rejected}}}[30s])) or vector(0))"
        f" / sum(rate(batchpilot_requests_total{{{SEL}}}[30s]))"
    )
    assert rej.samples == f"sum(increase(batchpilot_requests_total{{{SEL}}}[30s]))"
    assert rej.bad == f"sum(increase(batchpilot_requests_total{{{rejected}}}[30s])) or vector(0)"
    assert rej.codes == f"sum by (code) (increase(batchpilot_requests_total{{{rejected}}}[30s]))"
    assert q.all() == [
        *(lat.value, lat.samples, lat.bad, qa.value, qa.samples, qa.bad, err.value, err.samples, err.bad),
        *(rej.value, rej.samples, rej.bad, rej.codes),
    ]
    with pytest.raises(KeyError):
        q.metric("nope")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(30, "30s"), (30.0, "30s"), (90, "90s"), (1.5, "1500ms"), (0.25, "250ms"), (3600, "3600s")],
)
def test_promql_window(seconds: float, text: str) -> None:
    assert promql_window(seconds) == text


def test_promql_window_rejects_zero() -> None:
    with pytest.raises(ValueError):
        promql_window(0)


def test_selector_escapes_label_values() -> None:
    s = selector(namespace='a"b', policy="p\\q", track="canary", revision="r", lane="l")
    assert s == '{namespace="a\\"b",policy="p\\\\q",track="canary",revision="r",lane="l"}'


def test_plan_queries_covers_both_tracks_and_all_lanes() -> None:
    lqs = plan_queries(make_spec(lanes=2), policy="chat", namespace="ml", canary_revision="c", stable_revision="s")
    assert [(q.track, q.revision, q.lane) for q in lqs] == [
        ("canary", "c", "interactive"),
        ("stable", "s", "interactive"),
        ("canary", "c", "background"),
        ("stable", "s", "background"),
    ]
    assert {q.window for q in lqs} == {"30s"}
    only_canary = plan_queries(
        make_spec(lanes=2), policy="chat", namespace="ml", canary_revision="c", stable_revision=None
    )
    assert [q.track for q in only_canary] == ["canary", "canary"]


def _measure(
    value: float | None,
    samples: float | None,
    bad: float | None = None,
    *,
    value_error: str | None = None,
    samples_error: str | None = None,
) -> tuple[Any, dict[str, Measurement]]:
    q = build_queries(policy="chat", namespace="ml", track="canary", revision="abc123", lane="interactive", window=30)
    lat = q.metric("p99Latency")
    n = samples or 0.0
    k = bad if bad is not None else (n if value is not None and value > 0.2 else 0.0)
    return q, {
        lat.value: Measurement(lat.value, value=value, error=value_error),
        lat.samples: Measurement(lat.samples, value=samples, error=samples_error),
        lat.bad: Measurement(lat.bad, buckets=((0.1, n - k), (0.3, n - k), (math.inf, n)) if samples else ()),
    }


@pytest.mark.parametrize(
    ("value", "samples", "bad", "errors", "outcome"),
    [
        (0.15, 100, 0, {}, Outcome.SUCCESSFUL),
        (0.2, 100, 1, {}, Outcome.SUCCESSFUL),  # 1% over the SLO is within a p99 objective
        (0.2001, 100, 2, {}, Outcome.FAILED),  # on its own: over budget (the comparison is judge's)
        (5.0, 50, 50, {}, Outcome.FAILED),  # exactly minSamples is enough
        (5.0, 49.9, 49.9, {}, Outcome.INCONCLUSIVE),  # thin traffic never fails
        (5.0, 0, 0, {}, Outcome.INCONCLUSIVE),
        (None, None, None, {}, Outcome.INCONCLUSIVE),  # no series at all
        (float("nan"), float("nan"), None, {}, Outcome.INCONCLUSIVE),
        (None, 500, 0, {}, Outcome.INCONCLUSIVE),  # samples but no quantile: no data
        (float("inf"), 500, 500, {}, Outcome.FAILED),  # quantile in the +Inf bucket is a breach
        (0.1, 100, 0, {"value_error": "timeout"}, Outcome.ERROR),
        (0.1, 100, 0, {"samples_error": "HTTP 503"}, Outcome.ERROR),
    ],
)
def test_check_metric_table(
    value: float | None, samples: float | None, bad: float | None, errors: dict[str, str], outcome: Outcome
) -> None:
    q, ms = _measure(value, samples, bad, **errors)
    c = check_metric(queries=q, metric="p99Latency", measurements=ms, threshold=0.2, min_samples=50)
    assert c.outcome is outcome
    assert c.query == q.metric("p99Latency").value and c.threshold == 0.2
    if outcome is Outcome.ERROR:
        assert c.error is not None and "query error" in c.describe()


def test_check_metric_counts_bad_events_from_the_buckets_like_histogram_quantile() -> None:
    # 1000 requests: 985 at or under 0.1s, 1000 at or under 0.3s. An SLO of 0.2s sits halfway
    # through the (0.1, 0.3] bucket: 7.5 of its 15 count as over -> 0.75% -> within a p99.
    q = build_queries(policy="chat", namespace="ml", track="canary", revision="abc123", lane="interactive", window=30)
    lat = q.metric("p99Latency")
    ms = {
        lat.value: Measurement(lat.value, value=0.17),
        lat.samples: Measurement(lat.samples, value=1000.0),
        lat.bad: Measurement(lat.bad, buckets=((0.1, 985.0), (0.3, 1000.0), (math.inf, 1000.0))),
    }
    c = check_metric(queries=q, metric="p99Latency", measurements=ms, threshold=0.2, min_samples=50)
    assert c.bad == pytest.approx(7.5) and c.outcome is Outcome.SUCCESSFUL
    c = check_metric(queries=q, metric="p99Latency", measurements=ms, threshold=0.11, min_samples=50)
    assert c.bad == pytest.approx(14.25) and c.outcome is Outcome.FAILED  # 1.4% over 0.11s


def test_missing_measurement_is_an_error() -> None:
    q, _ = _measure(0.1, 100)
    c = check_metric(queries=q, metric="queueAge", measurements={}, threshold=0.05, min_samples=50)
    assert c.outcome is Outcome.ERROR and c.error == "not measured"


@pytest.mark.parametrize(
    ("outcomes", "combined"),
    [
        ([], Outcome.INCONCLUSIVE),
        ([Outcome.SUCCESSFUL, Outcome.SUCCESSFUL], Outcome.SUCCESSFUL),
        ([Outcome.SUCCESSFUL, Outcome.INCONCLUSIVE], Outcome.INCONCLUSIVE),
        ([Outcome.INCONCLUSIVE, Outcome.ERROR], Outcome.ERROR),
        ([Outcome.ERROR, Outcome.FAILED, Outcome.SUCCESSFUL], Outcome.FAILED),
    ],
)
def test_combine_precedence(outcomes: list[Outcome], combined: Outcome) -> None:
    assert combine(outcomes) is combined


Row = tuple[float | None, float | None, float | None]
"""(value people read, requests, bad events among them)."""


class DictBackend:
    """A fake MetricsBackend: (value, samples, bad events) by (track, lane, metric) over the
    30s window. The raw counters (read at the sub-window boundaries) grow evenly in time, so
    each of the 5 sub-windows holds a fifth of the counts (no bursts).

    Histogram ``bad`` queries get two buckets whose only finite bound (1us) lies below every
    threshold, so exactly ``bad`` observations count as over it.
    """

    def __init__(self, table: Mapping[tuple[str, str, str], Row], fail: bool = False):
        self.table = table
        self.fail = fail
        self.calls: list[list[str]] = []
        self.at: list[float | None] = []

    def measure(self, queries: Sequence[str], at: float | None = None) -> Mapping[str, Measurement]:
        self.calls.append(list(queries))
        self.at.append(at)
        out: dict[str, Measurement] = {}
        for query in queries:
            if self.fail:
                out[query] = Measurement(query, error="prometheus unreachable")
                continue
            track = "stable" if 'track="stable"' in query else "canary"
            lane = "background" if 'lane="background"' in query else "interactive"
            metric = "queueAge" if "queue_age" in query else "errorRate" if "requests_total" in query else "p99Latency"
            if "requests_total" in query and "outcome!=" not in query and "outcome=~" not in query:
                metric = "clientErrors"  # every request, or the rejected ones (outcome="invalid")
            if metric == "clientErrors" and (track, lane, metric) not in self.table:
                # no 4xx unless a row says so: as many requests as were served, none rejected
                served = self.table.get((track, lane, "errorRate"), (None, None, None))[1]
                row: Row = (0.0, served, 0.0) if served is not None else (None, None, None)
            else:
                row = self.table.get((track, lane, metric), (None, None, None))
            value, samples, bad = row
            raw = "increase(" not in query and "rate(" not in query
            if raw and samples is not None:  # a cumulative counter, started 1000s before NOW
                scale = ((at or NOW.timestamp()) - NOW.timestamp() + 1000) / 30
                samples, bad = samples * scale, (bad or 0.0) * scale
            if query.startswith("sum by (le)"):
                n, k = samples or 0.0, bad or 0.0
                out[query] = Measurement(query, buckets=((1e-6, n - k), (math.inf, n)) if samples else ())
            elif query.startswith("sum by (code)"):
                out[query] = Measurement(query, groups=(("400", bad),) if bad else None)
            elif ("outcome=~" in query or 'outcome="invalid"' in query) and query.startswith("sum("):
                out[query] = Measurement(query, value=bad)
            else:
                out[query] = Measurement(
                    query, value=samples if query.startswith(("sum(increase", "sum(batch")) else value
                )
        return out


def _table(**over: Row) -> dict[tuple[str, str, str], Row]:
    base: dict[tuple[str, str, str], Row] = {
        ("canary", "interactive", "p99Latency"): (0.12, 300.0, 1.0),
        ("canary", "interactive", "queueAge"): (0.004, 300.0, 0.0),
        ("canary", "interactive", "errorRate"): (0.0, 300.0, 0.0),
        ("canary", "background", "p99Latency"): (1.2, 80.0, 0.0),
        ("canary", "background", "queueAge"): (0.3, 80.0, 0.0),
        ("canary", "background", "errorRate"): (0.0, 80.0, 0.0),
        ("stable", "interactive", "p99Latency"): (0.1, 900.0, 2.0),
        ("stable", "interactive", "queueAge"): (0.003, 900.0, 0.0),
        ("stable", "interactive", "errorRate"): (0.0, 900.0, 0.0),
        ("stable", "background", "p99Latency"): (1.0, 240.0, 0.0),
        ("stable", "background", "queueAge"): (0.2, 240.0, 0.0),
        ("stable", "background", "errorRate"): (0.0, 240.0, 0.0),
    }
    for key, v in over.items():
        track, lane, metric = key.split("__")
        base[(track, lane, metric)] = v
    return base


def _analyse(
    backend: MetricsBackend, spec: PolicySpec | None = None, history: dict[str, list[list[float]]] | None = None
) -> AnalysisResult:
    return run_analysis(
        backend,
        spec or make_spec(lanes=2),
        policy="chat",
        namespace="ml",
        canary_revision="c1",
        stable_revision="s0",
        now=NOW,
        history=history,
    )


def test_run_analysis_all_lanes_successful_with_stable_evidence() -> None:
    backend = DictBackend(_table())
    result = _analyse(backend)
    # The window (2 lanes x 2 tracks x (3 objectives x 3 queries + the 4xx share's 4)), then the
    # raw counters (requests and bad events of each of the 4) at the 6 boundaries of the 5
    # sub-windows of 6s, oldest first.
    assert [len(c) for c in backend.calls] == [52] + [32] * (SLICES + 1)
    assert not any("increase(" in q or "rate(" in q for c in backend.calls[1:] for q in c)
    end = NOW.timestamp()
    assert backend.at == [end, end - 30, end - 24, end - 18, end - 12, end - 6, end]
    assert result.outcome is Outcome.SUCCESSFUL
    assert [lane.lane for lane in result.lanes] == ["interactive", "background"]
    bg = result.lanes[1]
    lat = bg.check("p99Latency")
    assert lat is not None and lat.threshold == 2.0 and lat.value == 1.2  # the lane's own SLO
    qa = bg.check("queueAge")
    assert qa is not None and qa.threshold == 0.5
    stable = bg.check("p99Latency", "stable")
    assert stable is not None and stable.value == 1.0 and stable.samples == 240.0
    assert result.window == "30s" and result.time == NOW
    assert "lane interactive p99 latency: 0.12s <= 0.2s (300 requests)" in result.evidence()


def test_one_lane_failing_fails_the_analysis_and_evidence_names_it() -> None:
    result = _analyse(DictBackend(_table(canary__background__queueAge=(0.9, 80.0, 20.0))))
    assert result.outcome is Outcome.FAILED
    assert [lane.outcome for lane in result.lanes] == [Outcome.SUCCESSFUL, Outcome.FAILED]
    evidence = result.evidence(only=[Outcome.FAILED])
    assert evidence.startswith(
        "lane background p99 queue age: canary 0.9s > 0.5s vs stable 0.2s; "
        "25% of 80 requests queued longer than maxQueueAge vs 0% of 240 on stable; "
        "worse than stable with >99.99% confidence, over its 1% budget with >99.99% confidence"
    ), evidence


def test_canary_shedding_load_fails_on_error_rate_while_fast() -> None:
    # A queue bound too small for the bursts: the requests it serves are fast, 12% get a 429.
    result = _analyse(DictBackend(_table(canary__interactive__errorRate=(0.12, 300.0, 36.0))))
    assert result.outcome is Outcome.FAILED
    failed = [c for lane in result.lanes for c in lane.canary if c.outcome is Outcome.FAILED]
    assert [(c.lane, c.metric, c.threshold) for c in failed] == [("interactive", "errorRate", 0.01)]
    assert "12% of 300 requests errors vs 0% of 900 on stable" in result.evidence(only=[Outcome.FAILED])
    # At the default budget exactly (1%) it passes; a lane SLO can allow more.
    assert _analyse(DictBackend(_table(canary__interactive__errorRate=(0.01, 300.0, 3.0)))).outcome is (
        Outcome.SUCCESSFUL
    )
    lenient = make_spec(lanes=2).model_copy(
        update={"slo": make_spec(lanes=2).slo.model_copy(update={"max_error_rate": 0.2})}
    )  # fmt: skip
    assert _analyse(DictBackend(_table(canary__interactive__errorRate=(0.12, 300.0, 36.0))), lenient).outcome is (
        Outcome.SUCCESSFUL
    )
    # Both tracks shedding alike (overload, not the change): not the canary's doing.
    both = _table(
        canary__interactive__errorRate=(0.12, 300.0, 36.0), stable__interactive__errorRate=(0.115, 900.0, 103.5)
    )
    shared = _analyse(DictBackend(both)).lanes[0].check("errorRate")
    assert shared is not None and shared.outcome is Outcome.INCONCLUSIVE
    assert "the stable track breaches too: not clearly the canary's doing" in shared.describe()


def test_thin_lane_is_inconclusive_even_when_breaching() -> None:
    result = _analyse(DictBackend(_table(canary__background__p99Latency=(9.0, 10.0, 10.0))))
    assert result.outcome is Outcome.INCONCLUSIVE
    assert result.lanes[0].outcome is Outcome.SUCCESSFUL
    assert "too few" in result.evidence(only=[Outcome.INCONCLUSIVE])


def test_a_canary_thin_in_every_window_is_judged_on_its_tally() -> None:
    # The shipped gateway example's 10% step at 30 req/s: ~85 canary requests per window, under
    # minSamples. Each window alone is too few; the tally of the windows before it is not, and
    # the verdict is on the tally: a canary slow in every request is rolled back, a clean one
    # passes, instead of "too few" until maxInconclusive stalls the rollout.
    spec = make_spec(lanes=1)  # minSamples 50
    thin = 30.0
    bad = _table(canary__interactive__queueAge=(0.09, thin, thin))
    good = _table(**{f"canary__interactive__{m}": (0.001, thin, 0.0) for m in ("p99Latency", "queueAge", "errorRate")})
    for table, outcome in ((bad, Outcome.FAILED), (good, Outcome.SUCCESSFUL)):
        history: dict[str, list[list[float]]] = {}
        thin_windows = 0
        for _ in range(6):
            result = _analyse(DictBackend(table), spec, history)
            check = result.lanes[0].check("queueAge")
            assert check is not None
            if not check.thin:
                break
            assert "too few" in check.describe()
            thin_windows += 1
            history = result.tally
        # the first window alone is too few (30 < 50); from the second, the tally (60) decides
        assert thin_windows == 1
        assert check.outcome is outcome, check.describe()
        assert check.tally == pytest.approx((2 * thin if outcome is Outcome.FAILED else 0.0, 2 * thin))
        if outcome is Outcome.SUCCESSFUL:  # the window's count and the tally's it was judged on
            assert "(30 requests, 60 with the earlier analyses)" in check.describe()
    # A tally still short of minSamples stays too few, however bad.
    once = _analyse(DictBackend(bad), spec).lanes[0].check("queueAge")
    assert once is not None and once.thin and "too few" in once.describe()


def test_stable_track_never_decides_alone() -> None:
    # the stable track far over its SLO, or with no data, does not fail a canary that meets it
    table = _table(stable__interactive__p99Latency=(5.0, 900.0, 900.0), stable__background__queueAge=(None, None, None))
    assert _analyse(DictBackend(table)).outcome is Outcome.SUCCESSFUL


def _judged(canary: Row, stable: Row | None, confidence: float = 0.95) -> Any:
    spec = make_spec(lanes=2, confidence=confidence)
    over = {"canary__interactive__p99Latency": canary}
    if stable is not None:
        over["stable__interactive__p99Latency"] = stable
    table = _table(**over)
    if stable is None:
        del table[("stable", "interactive", "p99Latency")]
    # The window's rule alone: the rollout's sequential evidence already conclusive.
    check = _analyse(DictBackend(table), spec, conclusive(spec)).lanes[0].check("p99Latency")
    assert check is not None
    return check


@pytest.mark.parametrize(
    ("canary", "stable", "outcome", "why"),
    [
        # identical distributions, both breaching in a burst: not the canary's doing
        ((0.3, 300.0, 30.0), (0.3, 900.0, 90.0), Outcome.INCONCLUSIVE, "stable track breaches too"),
        # a burst that landed a little harder on the canary's pod: 12% vs 9% is chance at this size
        ((0.35, 300.0, 36.0), (0.3, 900.0, 81.0), Outcome.INCONCLUSIVE, "stable track breaches too"),
        # the same burst, clearly worse on the canary: 25% vs 9%
        ((0.5, 300.0, 75.0), (0.3, 900.0, 81.0), Outcome.FAILED, None),
        # an overload both tracks feel (30% vs 20% of requests slow): the canary is worse with
        # confidence, but not twice as bad -- a pod that got more of the burst, not a bad change
        ((0.42, 340.0, 101.0), (0.43, 633.0, 125.0), Outcome.INCONCLUSIVE, "but not 2x as bad"),
        # a stable that meets the SLO and a canary far over it
        ((0.5, 300.0, 60.0), (0.1, 900.0, 3.0), Outcome.FAILED, None),
        # one huge outlier among 300 requests: 0.33% over, a p99 within the SLO
        ((0.12, 300.0, 1.0), (0.1, 900.0, 0.0), Outcome.SUCCESSFUL, None),
        # a steady 5% over the SLO in every sub-window against none on the stable: Failed
        # (two outliers in one sub-window are not: test_outliers_in_one_sub_window_are_one_cluster)
        ((0.25, 120.0, 6.0), (0.1, 900.0, 0.0), Outcome.FAILED, None),
        # 2 of 120 (1.7%) is worse than a clean stable, but 1.2 are expected at the 1% budget:
        # not a breach shown, so not Failed (each half of the rule at the confidence)
        ((0.25, 120.0, 2.0), (0.1, 900.0, 0.0), Outcome.INCONCLUSIVE, "not clearly over its 1% budget"),
        # no stable measurement (first window of a thin stable): the budget test alone decides
        ((0.5, 300.0, 60.0), None, Outcome.FAILED, None),
        ((0.25, 120.0, 2.0), None, Outcome.INCONCLUSIVE, "a breach this thin"),
        # a stable with too few samples that shows no breach of its own is no baseline: the
        # budget test alone decides (1 slow of 10 is 90% likely at 1%: not a breach shown)
        ((0.3, 300.0, 30.0), (0.1, 10.0, 0.0), Outcome.FAILED, None),
        ((0.3, 300.0, 30.0), (0.35, 10.0, 1.0), Outcome.FAILED, None),
        # ... but a thin stable that breaches with confidence shares the breach: the canary
        # (10% slow) is compared with it (20% of 10), not failed on its budget alone
        ((0.3, 300.0, 30.0), (0.35, 10.0, 2.0), Outcome.INCONCLUSIVE, "stable track breaches too"),
        # make demo's false rollback: a tenant slice 16% slow on the canary against 42% of the
        # stable's requests, too few of them in the window (the demo: 93 < minSamples 100)
        ((0.3, 282.0, 45.0), (0.4, 45.0, 19.0), Outcome.INCONCLUSIVE, "stable track breaches too"),
        # a thin stable's breach does not excuse a canary clearly worse than it
        ((0.9, 300.0, 240.0), (0.2, 40.0, 4.0), Outcome.FAILED, None),
        # a slightly worse canary that both breach: not clearly worse than a breaching stable
        ((0.22, 300.0, 6.0), (0.21, 900.0, 12.0), Outcome.INCONCLUSIVE, "stable track breaches too"),
        # empty buckets (no requests in the window on the canary)
        ((None, 0.0, 0.0), (0.1, 900.0, 0.0), Outcome.INCONCLUSIVE, None),
    ],
)
def test_verdict_table(canary: Row, stable: Row | None, outcome: Outcome, why: str | None) -> None:
    check = _judged(canary, stable)
    assert check.outcome is outcome, check.describe()
    if why is not None:
        assert why in check.describe()
    if outcome is Outcome.FAILED:
        # With a usable stable, being worse than it decides; without one, being over budget.
        if stable is not None and (stable[1] or 0) >= 50:
            assert check.confidence_worse is not None and check.confidence_worse >= 0.95
        else:
            assert check.confidence_over_budget is not None and check.confidence_over_budget >= 0.95


@pytest.mark.parametrize(
    ("canary", "stable", "passes", "why"),
    [
        # The shipped gateway example's 10th A/A (bench/results/gateway_example-pinned-connections.json): 1.25% of
        # the canary's requests over the SLO against 0.86% of the stable's, neither clearly worse
        # nor clearly over budget, the stable not clearly under its 1% either: the system sits
        # at its SLO, not the canary. It held the step 10 times and stalled; now it passes.
        ((0.06, 878.0, 11.0), (0.05, 2676.0, 23.0), True, "sits at its 1% budget too (0.859%, not clearly under it)"),
        # a canary as little over beside a stable clearly under its budget (0.59% of 2708): held
        ((0.06, 878.0, 9.0), (0.05, 2708.0, 16.0), False, "not clearly worse than the stable track"),
        # a stable too thin to be clearly under 1% even with no breach (0 of 250): its point
        # share decides, and 0% is no breach to share: held
        ((0.3, 200.0, 3.0), (0.1, 250.0, 0.0), False, "not clearly worse than the stable track"),
    ],
)
def test_a_stable_at_its_budget_shares_the_breach(canary: Row, stable: Row, passes: bool, why: str) -> None:
    check = _judged(canary, stable)
    assert check.outcome is Outcome.INCONCLUSIVE, check.describe()
    assert why in check.describe()
    assert check.shared_breach is passes


def test_confidence_is_the_policys_knob() -> None:
    # 12 of 300 over the SLO (4%) against 12 of 900 on the stable (1.3%): worse with ~99.6%
    # confidence. Failed at the default 95% and at 99%, Inconclusive at 99.9%.
    canary, stable = (0.3, 300.0, 12.0), (0.2, 900.0, 12.0)
    assert _judged(canary, stable).outcome is Outcome.FAILED
    assert _judged(canary, stable, confidence=0.99).outcome is Outcome.FAILED
    strict = _judged(canary, stable, confidence=0.999)
    assert strict.outcome is Outcome.INCONCLUSIVE and "needs 99.9% confidence" in strict.describe()
    assert strict.confidence_worse is not None and 0.99 < strict.confidence_worse < 0.999


def test_unreachable_backend_is_error() -> None:
    result = _analyse(DictBackend(_table(), fail=True))
    assert result.outcome is Outcome.ERROR
    assert all(c.outcome is Outcome.ERROR for lane in result.lanes for c in lane.canary)


def test_verdicts_skips_lanes_without_queries() -> None:
    spec = make_spec(lanes=2)
    lqs = [q for q in plan_queries(spec, policy="p", namespace="n", canary_revision="c", stable_revision=None)]
    assert [v.lane for v in verdicts(spec, lqs[:1], {})] == ["interactive"]


def test_the_tally_carries_earlier_analyses_and_decides() -> None:
    # A canary 2% over the SLO in every window against a stable at 1%: one window of 300
    # requests cannot show that it is worse with 95% confidence; with the tally of three
    # earlier windows (in status.rollout.evidence) it can.
    spec = make_spec(lanes=1)
    table = _table(
        canary__interactive__p99Latency=(0.25, 300.0, 6.0), stable__interactive__p99Latency=(0.15, 900.0, 9.0)
    )
    first = _analyse(DictBackend(table), spec)
    check = first.lanes[0].check("p99Latency")
    assert check is not None and check.outcome is Outcome.INCONCLUSIVE, check.describe()
    key = "interactive/p99Latency/canary"
    assert [pytest.approx([1.2, 60.0])] * SLICES == first.tally[key]
    # As if three such windows came before (and the rollout's evidence were already past its
    # bound: the sequential gate has its own tests).
    history = {k: v * 3 for k, v in first.tally.items() if not k.endswith("/sequential")} | conclusive(spec)
    later = run_analysis(
        DictBackend(table),
        spec,
        policy="chat",
        namespace="ml",
        canary_revision="c1",
        stable_revision="s0",
        now=NOW,
        history=history,
    )
    check = later.lanes[0].check("p99Latency")
    assert check is not None and check.outcome is Outcome.FAILED, check.describe()
    assert check.tally == pytest.approx((24.0, 1200.0))
    assert "2% of 1200 requests slower than the SLO" in check.describe()
    assert "(this and earlier analyses)" in check.describe()
    assert len(later.tally[key]) == 4 * SLICES
    # The tally is bounded: the oldest sub-windows fall out.
    long = {k: v * 20 for k, v in first.tally.items() if not k.endswith("/sequential")}
    bounded = run_analysis(
        DictBackend(table), spec, policy="chat", namespace="ml", canary_revision="c1", stable_revision="s0", now=NOW,
        history=long,
    )  # fmt: skip
    assert len(bounded.tally[key]) == TALLY_SLICES
    # A window whose queries all fail keeps the evidence gathered so far (and adds none).
    failed = run_analysis(
        DictBackend(table, fail=True), spec, policy="chat", namespace="ml", canary_revision="c1", stable_revision="s0",
        now=NOW, history=later.tally,
    )  # fmt: skip
    assert failed.outcome is Outcome.ERROR
    assert failed.tally == later.tally


def _counters(at: list[tuple[float, float]]) -> tuple[Any, list[dict[str, Measurement]]]:
    """One error-rate counter pair read at boundaries: (requests, errors) cumulative."""
    (cq,) = [c for c in counter_queries([build_queries(policy="chat", namespace="ml", track="canary",
             revision="abc123", lane="interactive", window=30)], policy="chat", namespace="ml")
             if c.metric == "errorRate"]  # fmt: skip
    return cq, [{cq.requests: Measurement(cq.requests, value=n), cq.bad: Measurement(cq.bad, value=k)} for n, k in at]


def test_slice_counts_are_counter_differences_and_refuse_what_they_cannot_trust() -> None:
    spec = make_spec()
    key = ("canary", "interactive", "errorRate")
    cq, reads = _counters([(100, 1), (160, 1), (220, 7), (280, 7), (340, 8), (400, 8)])
    assert slice_counts(spec, [cq], reads)[key] == ((0, 60), (6, 60), (0, 60), (1, 60), (0, 60))
    # a counter that went down (a pod restarted inside the window): not usable
    cq, reads = _counters([(100, 1), (160, 1), (20, 0), (80, 0), (140, 1), (200, 1)])
    assert key not in slice_counts(spec, [cq], reads)
    # requests in only two sub-windows (a window of few scrapes): no spread to measure
    cq, reads = _counters([(100, 1), (100, 1), (160, 2), (160, 2), (160, 2), (220, 2)])
    assert key not in slice_counts(spec, [cq], reads)
    # sub-windows holding far fewer requests than the window's count: not usable
    cq, reads = _counters([(100, 1), (110, 1), (120, 1), (130, 1), (140, 1), (150, 1)])
    assert key in slice_counts(spec, [cq], reads)
    assert key not in slice_counts(spec, [cq], reads, {key: 300.0})
    # no series yet at the first boundary (the canary's pods just started): not usable
    reads[0] = {}
    assert key not in slice_counts(spec, [cq], reads)


def _p99_check(value: float, samples: float, bad: float) -> Any:
    """A window's p99 check (SLO 200 ms, minSamples 50) with ``bad`` of ``samples`` over it."""
    q, ms = _measure(value, samples, bad)
    return check_metric(queries=q, metric="p99Latency", measurements=ms, threshold=0.2, min_samples=50)


def test_outliers_in_one_sub_window_are_one_cluster() -> None:
    # Six requests of 120 over the SLO, none of 900 on the stable. Taken as independent
    # requests Fisher's test says the canary is worse (and over its 1% budget) with >99.9%
    # confidence; all six fell in one sub-window, and across sub-windows that is one event,
    # not proof.
    canary_slices = ((6.0, 24.0), (0.0, 24.0), (0.0, 24.0), (0.0, 24.0), (0.0, 24.0))
    stable_slices = ((0.0, 180.0),) * 5
    canary, stable = _p99_check(0.25, 120.0, 6.0), _p99_check(0.1, 900.0, 0.0)
    judged = judge(canary, stable, 0.95, canary_slices, stable_slices)
    assert judged.outcome is Outcome.INCONCLUSIVE, judged.describe()
    assert judged.confidence_worse is not None and judged.confidence_worse < 0.9
    assert "not clearly worse than the stable track" in judged.describe()
    # The same six outliers spread over the sub-windows would be a steady breach.
    spread = ((1.2, 24.0),) * 5
    assert judge(canary, stable, 0.95, spread, stable_slices).outcome is Outcome.FAILED


def test_a_canary_far_worse_than_a_breaching_stable_holds_the_step_until_it_is_clear() -> None:
    # On/off traffic, a model 20% slower (bench/canary_eval.py --explain, seed 10): 29% of the
    # canary's requests over the SLO against 1.6% of the stable's, every one of them in the ON
    # burst of one sub-window. One burst pins nothing on the canary (not clearly worse), but it
    # is no burst both tracks saw alike either: the step is held, not passed, as a shared breach was.
    canary_slices = ((619.0, 900.0), (0.0, 310.0), (0.0, 310.0), (0.0, 310.0), (0.0, 309.0))
    stable_slices = ((33.0, 860.0), (0.0, 301.0), (0.0, 301.0), (0.0, 300.0), (0.0, 300.0))
    canary, stable = _p99_check(0.9, 2139.0, 619.0), _p99_check(0.25, 2062.0, 33.0)
    judged = judge(canary, stable, 0.95, canary_slices, stable_slices)
    assert judged.outcome is Outcome.INCONCLUSIVE, judged.describe()
    assert judged.confidence_worse is not None and judged.confidence_worse < 0.95
    assert not judged.shared_breach and "over 2x as bad, not clearly yet" in judged.describe()
    verdict = LaneVerdict(lane="interactive", outcome=judged.outcome, canary=(judged,))
    assert not verdict.passes_step and verdict.holds_step
    # The same burst at under twice the stable's share is one both tracks saw: it passes.
    near = ((50.0, 900.0), (0.0, 310.0), (0.0, 310.0), (0.0, 310.0), (0.0, 309.0))
    shared = judge(_p99_check(0.25, 2139.0, 50.0), stable, 0.95, near, stable_slices)
    assert shared.outcome is Outcome.INCONCLUSIVE and shared.shared_breach, shared.describe()


@pytest.mark.parametrize("increase", [None, 0.25])
def test_every_objective_record_reaches_the_queries_the_checks_and_the_status_text(increase: float | None) -> None:
    """A gate is one record of OBJECTIVES: its queries over the window and its raw counters are
    built, its threshold and budget come from the lane's SLO, and every lane's verdict carries a
    check of it that reads in words with the record's label. The relative objective only where
    the policy sets ``maxP99Increase``."""
    spec = make_spec(lanes=2, **({} if increase is None else {"maxP99Increase": increase}))
    lqs = plan_queries(spec, policy="chat", namespace="ml", canary_revision="c", stable_revision="s")
    assert list(METRICS) == [o.name for o in OBJECTIVES] and len(set(METRICS)) == len(METRICS)
    names = [o.name for o in OBJECTIVES if increase is not None or not o.relative]
    assert list(judged_metrics(spec)) == names and ("p99Increase" in names) == (increase is not None)
    for lq in lqs:
        assert [m.metric for m in lq.metrics] == names
        for m in lq.metrics:
            assert {m.value, m.samples, m.bad} <= set(lq.all())
            src = objective(m.metric).source
            assert (m.codes is not None) == (isinstance(src, Counted) and src.by_code)
    counters = counter_queries(lqs, policy="chat", namespace="ml")
    assert sorted(cq.key for cq in counters) == sorted((lq.track, lq.key, n) for lq in lqs for n in names)
    for lane in spec.lanes:
        slo = spec.lane_slo(lane.name)
        assert lane_thresholds(spec, lane.name) == {o.name: o.threshold(slo) for o in OBJECTIVES}
    assert lane_thresholds(spec, "interactive")["p99Latency"] != lane_thresholds(spec, "background")["p99Latency"]
    lanes = verdicts(spec, lqs, {})
    assert [v.lane for v in lanes] == [lane.name for lane in spec.lanes]
    for v in lanes:
        assert [c.metric for c in v.canary] == names
        for c in v.canary:
            assert c.outcome is Outcome.ERROR  # nothing was measured: an error, never a pass
            assert objective(c.metric).label in c.describe()


def test_a_window_that_would_fail_waits_for_the_rollouts_evidence() -> None:
    # 2.3% of 300 requests slow against 0.2% of 900 on the stable: the window's rule fails it,
    # but one window's evidence is short of what a rollback needs for the whole rollout's
    # bound (sequential_needed); the evidence carried in the tally adds up, and a few
    # windows like it fail it.
    spec = make_spec(lanes=1)
    table = _table(canary__interactive__p99Latency=(0.25, 300.0, 7.0))
    history: dict[str, list[list[float]]] = {}
    seen: list[float] = []
    for _ in range(8):
        result = _analyse(DictBackend(table), spec, history)
        check = result.lanes[0].check("p99Latency")
        assert check is not None and check.e_worse is not None
        seen.append(check.e_worse)
        if check.outcome is Outcome.FAILED:
            break
        assert check.outcome is Outcome.INCONCLUSIVE
        assert "the rollout's evidence that it is worse than the stable is" in check.describe()
        assert result.lanes[0].holds_step and not result.lanes[0].passes_step
        history = result.tally
    assert check.outcome is Outcome.FAILED, check.describe()
    assert 1 < len(seen) <= 4
    assert seen == sorted(seen) and seen[-1] >= check.evidence_needed  # type: ignore[operator]
    # The healthy windows of a canary count against it as well: after clean windows the
    # same breach needs more windows to fail.
    clean = _analyse(DictBackend(_table(canary__interactive__p99Latency=(0.1, 300.0, 0.0))), spec)
    history = clean.tally
    for _ in range(3):
        history = _analyse(DictBackend(_table(canary__interactive__p99Latency=(0.1, 300.0, 0.0))), spec, history).tally
    late = _analyse(DictBackend(table), spec, history).lanes[0].check("p99Latency")
    assert late is not None and late.e_worse is not None and late.e_worse < seen[0]


# ---- the opt-in relative objective (rollout.maxP99Increase) ---------------------------------

_LATENCY_LES = (0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, math.inf)
"""Bucket bounds of the runtime's kind (dense where the tests' p99s lie)."""


def _latencies(n: int, factor: float = 1.0) -> list[float]:
    """``n`` latencies spread like a lognormal (median 30 ms, p99 about 68 ms) times ``factor``:
    the quantiles themselves, so a window holds exactly its distribution."""
    return [factor * 0.03 * math.exp(0.35 * NormalDist().inv_cdf((i + 0.5) / n)) for i in range(n)]


def _cumulative(latencies: Sequence[float]) -> tuple[tuple[float, float], ...]:
    return tuple((le, float(sum(1 for x in latencies if x <= le))) for le in _LATENCY_LES)


def _histogram_p99(buckets: Sequence[tuple[float, float]]) -> float:
    """Prometheus' histogram_quantile(0.99): linear inside the bucket the rank falls in, as
    count_above counts (so exactly 1% of a track's requests lie over its own p99)."""
    rank, lower, below = 0.99 * buckets[-1][1], 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    raise AssertionError("the +Inf bucket holds every request")


class LatencyBackend(DictBackend):
    """DictBackend whose request-latency histograms hold each track's ``latencies`` per window
    (the raw counters grow evenly, as DictBackend's), and their p99 as Prometheus reads it
    from the buckets: a canary can be slower than the stable inside the SLO."""

    def __init__(self, table: Mapping[tuple[str, str, str], Row], latencies: Mapping[str, Sequence[float]]):
        super().__init__(table)
        self.latencies = latencies

    def measure(self, queries: Sequence[str], at: float | None = None) -> Mapping[str, Measurement]:
        out = dict(super().measure(queries, at))
        for query in queries:
            if "request_latency_seconds_bucket" not in query:
                continue
            lats = self.latencies["stable" if 'track="stable"' in query else "canary"]
            raw = "increase(" not in query and "rate(" not in query
            scale = ((at or NOW.timestamp()) - NOW.timestamp() + 1000) / 30 if raw else 1.0
            if query.startswith("histogram_quantile"):
                out[query] = Measurement(query, value=_histogram_p99(_cumulative(lats)))
            else:
                out[query] = Measurement(query, buckets=tuple((le, c * scale) for le, c in _cumulative(lats)))
        return out


def _relative_table(canary: int, stable: int) -> dict[tuple[str, str, str], Row]:
    """One lane, every request served, none queued long; the latency rows' counts are the
    histograms' (LatencyBackend answers their buckets and p99)."""
    table = _table()
    for track, n in (("canary", canary), ("stable", stable)):
        table[(track, "interactive", "p99Latency")] = (None, float(n), 0.0)
        table[(track, "interactive", "queueAge")] = (0.004, float(n), 0.0)
        table[(track, "interactive", "errorRate")] = (0.0, float(n), 0.0)
    return table


def _rollout_of(
    spec: PolicySpec, backend: MetricsBackend, windows: int
) -> tuple[list[AnalysisResult], dict[str, list[list[float]]]]:
    """Up to ``windows`` analyses of one step, each on the tally the last one left, until one fails."""
    history: dict[str, list[list[float]]] = {}
    results: list[AnalysisResult] = []
    for _ in range(windows):
        results.append(_analyse(backend, spec, history))
        history = results[-1].tally
        if results[-1].outcome is Outcome.FAILED:
            break
    return results, history


@pytest.mark.parametrize(("factor", "windows"), [(1.5, 2), (1.4, 5)])
def test_a_regression_inside_the_slo_is_caught_only_against_the_stables_p99(factor: float, windows: int) -> None:
    # The canary's latencies are the stable's times 1.5 (or 1.4): its p99 (about 100 ms) is far
    # inside the 200 ms SLO, so the SLO's objective cannot see it; with maxP99Increase 0.25 the
    # requests slower than 1.25x the stable's p99 are 3.2% (2.2%) of the canary's against 0.16%
    # of the stable's: the rollout's evidence that it is over that budget rolls it back within
    # two windows (five, the tally adding up).
    table = _relative_table(300, 900)
    slower = LatencyBackend(table, {"canary": _latencies(300, factor), "stable": _latencies(900)})
    blind, _ = _rollout_of(make_spec(), slower, 8)
    assert [r.outcome for r in blind] == [Outcome.SUCCESSFUL] * 8
    assert all(r.lanes[0].check("p99Increase") is None for r in blind)  # not judged unless asked for

    spec = make_spec(maxP99Increase=0.25)
    results, _ = _rollout_of(spec, slower, 8)
    last = results[-1].lanes[0]
    rel, slo = last.check("p99Increase"), last.check("p99Latency")
    assert rel is not None and slo is not None
    assert rel.outcome is Outcome.FAILED, rel.describe()
    assert slo.outcome is Outcome.SUCCESSFUL  # inside the SLO all along
    assert len(results) <= windows
    stable_p99 = _histogram_p99(_cumulative(_latencies(900)))
    assert rel.threshold == pytest.approx(1.25 * stable_p99)
    stable = last.check("p99Increase", "stable")
    assert stable is not None and stable.threshold == rel.threshold  # one threshold, both tracks
    assert rel.tally is not None and rel.tally[0] / rel.tally[1] > 0.015
    assert rel.stable_tally is not None and rel.stable_tally[0] / rel.stable_tally[1] < 0.01
    assert "p99 against the stable" in rel.describe() and "over its 1% budget" in rel.describe()
    assert rel.evidence == rel.e_over_budget  # the gate reads the evidence over the budget


@pytest.mark.parametrize("factor", [1.0, 1.1, 0.67])
def test_a_canary_within_the_allowed_increase_passes_against_the_stables_p99(factor: float) -> None:
    # A/A, 10% slower (inside the 25% allowed), and 1.5x faster: no window holds the step.
    backend = LatencyBackend(_relative_table(300, 900), {"canary": _latencies(300, factor), "stable": _latencies(900)})
    results, _ = _rollout_of(make_spec(maxP99Increase=0.25), backend, 8)
    assert len(results) == 8
    for r in results:
        rel = r.lanes[0].check("p99Increase")
        assert rel is not None and rel.outcome is Outcome.SUCCESSFUL, rel.describe()
        assert r.lanes[0].passes_step


def test_a_quiet_stable_window_neither_passes_nor_holds_the_step_on_the_relative_objective() -> None:
    # A stable track of 40 requests (under minSamples 50): its p99 is one of its slowest few, no
    # baseline. The window compares nothing, so it can neither pass the step (a canary 3x slower
    # was promoted so, on a quiet window after busier ones had Failed it) nor take a pass back
    # (nothing is held against the canary); the status says why.
    backend = LatencyBackend(_relative_table(300, 40), {"canary": _latencies(300, 3.0), "stable": _latencies(40)})
    result = _analyse(backend, make_spec(maxP99Increase=0.25))
    lane = result.lanes[0]
    rel = lane.check("p99Increase")
    assert rel is not None and rel.outcome is Outcome.INCONCLUSIVE and rel.thin
    assert rel.unjudged == STABLE_TOO_THIN and STABLE_TOO_THIN in rel.describe()
    slo = lane.check("p99Latency")
    assert slo is not None and slo.outcome is Outcome.SUCCESSFUL  # the SLO still judged: 3x is inside 200 ms
    assert not lane.passes_step and not lane.holds_step
    # The same quiet stable without maxP99Increase: the window passes the step on its SLOs.
    plain = _analyse(backend, make_spec()).lanes[0]
    assert plain.passes_step
    # No stable track at all (a first rollout): nothing to wait for; judged on the SLOs alone.
    alone = run_analysis(
        backend, make_spec(maxP99Increase=0.25), policy="chat", namespace="ml", canary_revision="c1",
        stable_revision=None, now=NOW,
    )  # fmt: skip
    rel = alone.lanes[0].check("p99Increase")
    assert rel is not None and rel.outcome is Outcome.SUCCESSFUL and rel.note == NO_STABLE_P99
    assert NO_STABLE_P99 in rel.describe()


def test_the_relative_statement_is_of_the_steps_comparing_windows_and_a_quiet_window_restates_it() -> None:
    # What the gate can see with maxP99Increase is what its comparing windows see, each at its
    # own threshold (kept beside the tally): a quiet window (no stable p99) compares nothing and
    # holds nothing, so the status restates those windows' statement with the time of the last,
    # instead of the SLO's alone (which said no 1.5x regression was in reach on about a fifth
    # of the demo's promoting analyses).
    spec = make_spec(maxP99Increase=0.25)
    busy = LatencyBackend(_relative_table(300, 900), {"canary": _latencies(300), "stable": _latencies(900)})
    quiet = LatencyBackend(_relative_table(300, 40), {"canary": _latencies(300), "stable": _latencies(40)})
    entered = datetime(2026, 11, 30, 1, 59, tzinfo=UTC)
    status = Status(rollout=RolloutState(revision="c1", step_weight=50, started_at=entered, step_entered_at=entered))

    def record(status: Status, backend: LatencyBackend, now: datetime) -> Status:
        assert status.rollout is not None
        p = PlanState(PlanInputs(spec=spec, generation=1, status=status, observed=Observed(), now=now))
        a = _analyse(backend, spec, status.rollout.evidence)
        record_analysis(p, a)
        assert p.st.rollout is not None
        p.st.rollout.evidence = a.tally  # as the planner keeps it (rollout.steps)
        return p.st

    first = record(status, busy, NOW)
    assert first.last_analysis is not None and first.rollout is not None
    compared = first.last_analysis.lanes[0]
    assert compared.detects_as_of == NOW and compared.detectable_p99_regression is not None
    # One comparing window: the statement is that window's, over the tally the rollout can gather.
    lane = _analyse(busy, spec).lanes[0]
    rel, stable = lane.check("p99Increase"), lane.check("p99Increase", "stable")
    assert rel is not None
    one = lane_detectable_regression(rel, stable, 0.95, gating_analyses(spec), needed=sequential_needed(spec, False))
    assert compared.detectable_p99_regression == one
    later = NOW + timedelta(seconds=30)
    second = record(first, quiet, later)
    assert second.last_analysis is not None
    restated = second.last_analysis.lanes[0]
    assert restated.detectable_p99_regression == compared.detectable_p99_regression
    assert restated.detects_as_of == NOW
    assert restated.detects is not None and "as of the analysis at 02:00:00" in restated.detects
    # A new step that does not feed the canary alike starts its evidence afresh: the quiet
    # window's own statement (the SLO's alone, far out of reach) is what it gets.
    moved = first.model_copy(update={"rollout": first.rollout.model_copy(update={"evidence": {}})})
    own = record(moved, quiet, later).last_analysis
    assert own is not None and own.lanes[0].detects_as_of is None
    assert own.lanes[0].detectable_p99_regression != compared.detectable_p99_regression


def test_the_relative_objective_asks_prometheus_nothing_more_and_counts_in_the_rollouts_bound() -> None:
    # Its series are the SLO objective's: the same queries, asked once. It is one more
    # objective for the rollout's false-rollback bound to be shared among.
    spec, relative = make_spec(lanes=2), make_spec(lanes=2, maxP99Increase=0.5)
    plain, rel = DictBackend(_table()), DictBackend(_table())
    _analyse(plain, spec)
    _analyse(rel, relative)
    assert [len(c) for c in rel.calls] == [len(c) for c in plain.calls]
    assert all(len(set(c)) == len(c) for c in rel.calls)
    assert sequential_needed(relative, False) == pytest.approx(sequential_needed(spec, False) * 5 / 4)


def test_against_the_stables_p99_the_gate_states_a_smaller_regression_never_below_the_allowance() -> None:
    # 300 canary and 900 stable requests a window, the stable's p99 a third of its SLO: the
    # SLO's objective sees only a regression of about 3x; against the stable's p99 the gate sees
    # 1.5x, and never less than the 25% the policy allows (what it states is what it catches:
    # the test above rolls back 1.4x and 1.5x).
    spec = make_spec(maxP99Increase=0.25)
    backend = LatencyBackend(_relative_table(300, 900), {"canary": _latencies(300), "stable": _latencies(900)})
    lane = _analyse(backend, spec).lanes[0]
    needed = sequential_needed(spec, False)
    found = []
    for metric in ("p99Latency", "p99Increase"):
        canary, stable = lane.check(metric), lane.check(metric, "stable")
        assert canary is not None and stable is not None
        found.append(lane_detectable_regression(canary, stable, 0.95, needed=needed))
    slo, rel = found
    assert slo is not None and rel is not None
    assert 0.25 < rel <= 0.5 < 1.5 < slo


def test_at_a_step_fed_unlike_the_stable_the_relative_objective_passes_saying_why() -> None:
    # The planner says the step feeds the canary unlike the stable (fairness.unlike_load): a
    # canary 1.5x slower is not compared with the stable's p99 there; it passes, with the reason
    # in its evidence, and the SLOs are judged as ever.
    backend = LatencyBackend(_relative_table(300, 900), {"canary": _latencies(300, 1.5), "stable": _latencies(900)})
    why = "not compared with the stable's p99 at step 2 (25%)"
    spec = make_spec(maxP99Increase=0.25)
    result = run_analysis(
        backend, spec, policy="chat", namespace="ml", canary_revision="c1", stable_revision="s0", now=NOW,
        unlike_load=why,
    )  # fmt: skip
    rel, slo = result.lanes[0].check("p99Increase"), result.lanes[0].check("p99Latency")
    assert rel is not None and rel.outcome is Outcome.SUCCESSFUL and rel.note == why and why in rel.describe()
    assert slo is not None and slo.outcome is Outcome.SUCCESSFUL
    assert math.isfinite(rel.threshold)  # what the like-for-like step will compare against, for the status
    compared, _ = _rollout_of(spec, backend, 4)  # where the step feeds it alike: rolled back
    assert compared[-1].lanes[0].check("p99Increase").outcome is Outcome.FAILED  # type: ignore[union-attr]
