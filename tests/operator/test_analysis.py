"""PromQL builders and verdict logic of the canary analysis (pure; a dict stands in for Prometheus)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import pytest

from batchpilot_operator.analysis import (
    AnalysisResult,
    Measurement,
    MetricsBackend,
    Outcome,
    build_queries,
    check_metric,
    combine,
    plan_queries,
    promql_window,
    run_analysis,
    selector,
    verdicts,
)
from batchpilot_operator.spec import PolicySpec
from bptest import make_spec

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
    assert q.all() == [lat.value, lat.samples, qa.value, qa.samples, err.value, err.samples]
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
    *,
    value_error: str | None = None,
    samples_error: str | None = None,
) -> tuple[Any, dict[str, Measurement]]:
    q = build_queries(policy="chat", namespace="ml", track="canary", revision="abc123", lane="interactive", window=30)
    lat = q.metric("p99Latency")
    return q, {
        lat.value: Measurement(lat.value, value=value, error=value_error),
        lat.samples: Measurement(lat.samples, value=samples, error=samples_error),
    }


@pytest.mark.parametrize(
    ("value", "samples", "errors", "outcome"),
    [
        (0.15, 100, {}, Outcome.SUCCESSFUL),
        (0.2, 100, {}, Outcome.SUCCESSFUL),  # at the SLO is within it
        (0.2001, 100, {}, Outcome.FAILED),
        (5.0, 50, {}, Outcome.FAILED),  # exactly minSamples is enough
        (5.0, 49.9, {}, Outcome.INCONCLUSIVE),  # thin traffic never fails
        (5.0, 0, {}, Outcome.INCONCLUSIVE),
        (None, None, {}, Outcome.INCONCLUSIVE),  # no series at all
        (float("nan"), float("nan"), {}, Outcome.INCONCLUSIVE),
        (None, 500, {}, Outcome.INCONCLUSIVE),  # samples but no quantile: no data
        (float("inf"), 500, {}, Outcome.FAILED),  # quantile in the +Inf bucket is a breach
        (0.1, 100, {"value_error": "timeout"}, Outcome.ERROR),
        (0.1, 100, {"samples_error": "HTTP 503"}, Outcome.ERROR),
    ],
)
def test_check_metric_table(
    value: float | None, samples: float | None, errors: dict[str, str], outcome: Outcome
) -> None:
    q, ms = _measure(value, samples, **errors)
    c = check_metric(queries=q, metric="p99Latency", measurements=ms, threshold=0.2, min_samples=50)
    assert c.outcome is outcome
    assert c.query == q.metric("p99Latency").value and c.threshold == 0.2
    if outcome is Outcome.ERROR:
        assert c.error is not None and "query error" in c.describe()


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


class DictBackend:
    """A fake MetricsBackend: values by (track, lane, metric) and which kind of query."""

    def __init__(self, table: Mapping[tuple[str, str, str], tuple[float | None, float | None]], fail: bool = False):
        self.table = table
        self.fail = fail
        self.calls: list[list[str]] = []

    def measure(self, queries: Sequence[str]) -> Mapping[str, Measurement]:
        self.calls.append(list(queries))
        out: dict[str, Measurement] = {}
        for query in queries:
            if self.fail:
                out[query] = Measurement(query, error="prometheus unreachable")
                continue
            track = "stable" if 'track="stable"' in query else "canary"
            lane = "background" if 'lane="background"' in query else "interactive"
            metric = "queueAge" if "queue_age" in query else "errorRate" if "requests_total" in query else "p99Latency"
            value, samples = self.table.get((track, lane, metric), (None, None))
            out[query] = Measurement(query, value=samples if query.startswith("sum(increase") else value)
        return out


def _table(
    **over: tuple[float | None, float | None],
) -> dict[tuple[str, str, str], tuple[float | None, float | None]]:
    base: dict[tuple[str, str, str], tuple[float | None, float | None]] = {
        ("canary", "interactive", "p99Latency"): (0.12, 300.0),
        ("canary", "interactive", "queueAge"): (0.004, 300.0),
        ("canary", "interactive", "errorRate"): (0.0, 300.0),
        ("canary", "background", "p99Latency"): (1.2, 80.0),
        ("canary", "background", "queueAge"): (0.3, 80.0),
        ("canary", "background", "errorRate"): (0.005, 80.0),
        ("stable", "interactive", "p99Latency"): (0.1, 900.0),
        ("stable", "interactive", "queueAge"): (0.003, 900.0),
        ("stable", "interactive", "errorRate"): (0.0, 900.0),
        ("stable", "background", "p99Latency"): (1.0, 240.0),
        ("stable", "background", "queueAge"): (0.2, 240.0),
        ("stable", "background", "errorRate"): (0.0, 240.0),
    }
    for key, v in over.items():
        track, lane, metric = key.split("__")
        base[(track, lane, metric)] = v
    return base


def _analyse(backend: MetricsBackend, spec: PolicySpec | None = None) -> AnalysisResult:
    return run_analysis(
        backend,
        spec or make_spec(lanes=2),
        policy="chat",
        namespace="ml",
        canary_revision="c1",
        stable_revision="s0",
        now=NOW,
    )


def test_run_analysis_all_lanes_successful_with_stable_evidence() -> None:
    backend = DictBackend(_table())
    result = _analyse(backend)
    assert len(backend.calls) == 1 and len(backend.calls[0]) == 24  # 2 lanes x 2 tracks x 3 metrics x 2
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
    assert "lane interactive p99Latency: 0.12s <= 0.2s (300 samples)" in result.evidence()


def test_one_lane_failing_fails_the_analysis_and_evidence_names_it() -> None:
    result = _analyse(DictBackend(_table(canary__background__queueAge=(0.9, 80.0))))
    assert result.outcome is Outcome.FAILED
    assert [lane.outcome for lane in result.lanes] == [Outcome.SUCCESSFUL, Outcome.FAILED]
    assert result.evidence(only=[Outcome.FAILED]) == "lane background queueAge: 0.9s > 0.5s (80 samples)"


def test_canary_shedding_load_fails_on_error_rate_while_fast() -> None:
    # A queue bound too small for the bursts: the requests it serves are fast, 12% get a 429.
    result = _analyse(DictBackend(_table(canary__interactive__errorRate=(0.12, 300.0))))
    assert result.outcome is Outcome.FAILED
    failed = [c for lane in result.lanes for c in lane.canary if c.outcome is Outcome.FAILED]
    assert [(c.lane, c.metric, c.threshold) for c in failed] == [("interactive", "errorRate", 0.01)]
    assert result.evidence(only=[Outcome.FAILED]) == "lane interactive errorRate: 12% > 1% (300 samples)"
    # At the default budget exactly (1%) it passes; a lane SLO can allow more.
    assert _analyse(DictBackend(_table(canary__interactive__errorRate=(0.01, 300.0)))).outcome is Outcome.SUCCESSFUL
    lenient = make_spec(lanes=2).model_copy(
        update={"slo": make_spec(lanes=2).slo.model_copy(update={"max_error_rate": 0.2})}
    )  # fmt: skip
    assert _analyse(DictBackend(_table(canary__interactive__errorRate=(0.12, 300.0))), lenient).outcome is (
        Outcome.SUCCESSFUL
    )
    # Both tracks shedding alike (overload, not the change): not the canary's doing.
    both = _table(canary__interactive__errorRate=(0.12, 300.0), stable__interactive__errorRate=(0.115, 900.0))
    shared = _analyse(DictBackend(both)).lanes[0].check("errorRate")
    assert shared is not None and shared.outcome is Outcome.INCONCLUSIVE
    assert "stable track breaches too (11.5%" in shared.describe()


def test_thin_lane_is_inconclusive_even_when_breaching() -> None:
    result = _analyse(DictBackend(_table(canary__background__p99Latency=(9.0, 10.0))))
    assert result.outcome is Outcome.INCONCLUSIVE
    assert result.lanes[0].outcome is Outcome.SUCCESSFUL
    assert "too few" in result.evidence(only=[Outcome.INCONCLUSIVE])


def test_stable_track_never_decides() -> None:
    # the stable track far over its SLO, or with no data, does not change the canary verdict
    table = _table(stable__interactive__p99Latency=(5.0, 900.0), stable__background__queueAge=(None, None))
    assert _analyse(DictBackend(table)).outcome is Outcome.SUCCESSFUL


def test_canary_breaching_like_the_stable_is_inconclusive_not_failed() -> None:
    # A burst hits both tracks: the canary (0.30s) is within 10% of a stable that breaches too
    # (0.29s) -> not the canary's doing. Measurably worse than the stable -> Failed as usual.
    shared = _table(canary__interactive__p99Latency=(0.30, 300.0), stable__interactive__p99Latency=(0.29, 900.0))
    result = _analyse(DictBackend(shared))
    assert result.outcome is Outcome.INCONCLUSIVE
    check = result.lanes[0].check("p99Latency")
    assert check is not None and check.outcome is Outcome.INCONCLUSIVE
    assert "stable track breaches too (0.29s" in check.describe()
    worse = _table(canary__interactive__p99Latency=(0.40, 300.0), stable__interactive__p99Latency=(0.29, 900.0))
    assert _analyse(DictBackend(worse)).outcome is Outcome.FAILED
    # A stable with too few samples excuses nothing.
    thin = _table(canary__interactive__p99Latency=(0.30, 300.0), stable__interactive__p99Latency=(0.35, 10.0))
    assert _analyse(DictBackend(thin)).outcome is Outcome.FAILED


def test_unreachable_backend_is_error() -> None:
    result = _analyse(DictBackend(_table(), fail=True))
    assert result.outcome is Outcome.ERROR
    assert all(c.outcome is Outcome.ERROR for lane in result.lanes for c in lane.canary)


def test_verdicts_skips_lanes_without_queries() -> None:
    spec = make_spec(lanes=2)
    lqs = [q for q in plan_queries(spec, policy="p", namespace="n", canary_revision="c", stable_revision=None)]
    assert [v.lane for v in verdicts(spec, lqs[:1], {})] == ["interactive"]
