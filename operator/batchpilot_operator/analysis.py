"""Canary analysis: PromQL builders and the verdict logic. Pure (the backend is injected).

Metrics (the runtime contract): histograms ``batchpilot_request_latency_seconds`` and
``batchpilot_queue_age_seconds`` and the counter ``batchpilot_requests_total{outcome}``, with
labels ``lane`` and ``revision``; Prometheus adds the target labels ``namespace``, ``policy``
and ``track`` (the PodMonitor relabels them from pod labels; the test harness sets them as
static target labels).

Per lane, track and revision, over a window W equal to the analysis interval::

    p99:     histogram_quantile(0.99, sum by (le) (rate(<hist>_bucket{sel}[W])))
    samples: sum(increase(<hist>_count{sel}[W]))

    error rate: (sum(rate(batchpilot_requests_total{sel,outcome=~"<errors>"}[W])) or vector(0))
                  / sum(rate(batchpilot_requests_total{sel,outcome!="invalid"}[W]))
    samples:    sum(increase(batchpilot_requests_total{sel,outcome!="invalid"}[W]))

The error outcomes are the server's failures to serve a well-formed request: ``rejected_full``
(429, queue full), ``timed_out`` (504), ``failed`` (500, the model raised) and ``unavailable``
(503). ``invalid`` (4xx, the client's fault) counts neither way. Latency and queue age only
see the requests that were served, so a change that sheds load (a queue bound too small for
the bursts, a model that fails) would look fast; the error rate is what catches it.

Verdict of one lane (canary track only):

* any metric with fewer samples than ``minSamples`` (or no data / NaN) -> ``Inconclusive``:
  thin traffic never fails a canary by itself;
* a metric with enough samples whose value exceeds its threshold (lane SLO ``p99Latency`` for
  latency, ``maxQueueAge`` for queue age, ``maxErrorRate`` for the error rate) -> ``Failed``;
* a query that errored (Prometheus unreachable, bad response) -> ``Error``;
* otherwise ``Successful``.

Precedence, for a lane and for the whole analysis: Failed > Error > Inconclusive >
Successful. A breach measured with enough samples is evidence even if another query failed;
an Error outranks Inconclusive because "we could not look" must follow
``onMetricsUnavailable`` rather than quietly extend the step.

The stable track is measured over the same window and recorded next to the canary's values
(ledger ``stableValue``/``stableSamples``) as evidence for on-call. The SLO decides, with one
exception: a canary breach is not the canary's fault when the stable track, over the same
window and with enough samples, breaches the same objective at least as badly (canary value
within :data:`STABLE_TOLERANCE` of the stable's). That is a traffic burst or a sick node hitting
both tracks; rolling back would not help, so the check is ``Inconclusive`` ("stable breaches
too"): the step is extended and, after ``maxInconclusive`` in a row, the rollout holds as
Stalled. This is the false rollback Flagger and Argo Rollouts users hit on bursty traffic (the
demo's trace has bursts of 15x its mean rate). The stable alone never fails a canary, and a
plain relative check (canary p99 vs stable p99 while both meet the SLO) is not used: it flaps
on the short, thin windows a canary step has. The stable's queries erroring never changes the
verdict.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Literal, Protocol

from batchpilot_operator.spec import PolicySpec

LATENCY_METRIC = "batchpilot_request_latency_seconds"
QUEUE_AGE_METRIC = "batchpilot_queue_age_seconds"
REQUESTS_METRIC = "batchpilot_requests_total"
ERROR_OUTCOMES = ("rejected_full", "timed_out", "failed", "unavailable")
"""Outcomes of ``batchpilot_requests_total`` that count as errors (see the module docstring)."""
QUANTILE = 0.99
STABLE_TOLERANCE = 0.10
"""A breaching canary within this fraction of an equally breaching stable is not blamed."""

MetricName = Literal["p99Latency", "queueAge", "errorRate"]
Track = Literal["stable", "canary"]
METRICS: tuple[MetricName, ...] = ("p99Latency", "queueAge", "errorRate")
_HISTOGRAM: dict[MetricName, str] = {"p99Latency": LATENCY_METRIC, "queueAge": QUEUE_AGE_METRIC}


def format_value(metric: MetricName, value: float) -> str:
    """A metric's value for people: seconds for latencies, a percentage for the error rate."""
    if metric == "errorRate":
        return f"{value * 100:.3g}%"
    return f"{value:.4g}s"


class Outcome(StrEnum):
    SUCCESSFUL = "Successful"
    FAILED = "Failed"
    INCONCLUSIVE = "Inconclusive"
    ERROR = "Error"


_PRECEDENCE = {Outcome.FAILED: 3, Outcome.ERROR: 2, Outcome.INCONCLUSIVE: 1, Outcome.SUCCESSFUL: 0}


def combine(outcomes: Sequence[Outcome]) -> Outcome:
    """The outcome of several checks: Failed > Error > Inconclusive > Successful."""
    if not outcomes:
        return Outcome.INCONCLUSIVE
    return max(outcomes, key=lambda o: _PRECEDENCE[o])


# --------------------------------------------------------------------------- queries


def promql_window(seconds: float) -> str:
    """A PromQL range for a window in seconds: whole seconds as ``30s``, else milliseconds."""
    if seconds <= 0:
        raise ValueError(f"analysis window must be positive, got {seconds}")
    if float(seconds).is_integer():
        return f"{int(seconds)}s"
    return f"{max(1, round(seconds * 1000))}ms"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


def selector(*, namespace: str, policy: str, track: str, revision: str, lane: str, extra: str = "") -> str:
    """The label matchers of one (policy, track, revision, lane), plus ``extra`` matchers verbatim."""
    labels = {"namespace": namespace, "policy": policy, "track": track, "revision": revision, "lane": lane}
    matchers = [f'{k}="{_escape(v)}"' for k, v in labels.items()]
    if extra:
        matchers.append(extra)
    return "{" + ",".join(matchers) + "}"


@dataclass(frozen=True)
class MetricQueries:
    """The two queries of one metric of one (track, revision, lane)."""

    metric: MetricName
    value: str
    samples: str


@dataclass(frozen=True)
class LaneQueries:
    track: Track
    revision: str
    lane: str
    window: str
    metrics: tuple[MetricQueries, ...]

    def all(self) -> list[str]:
        return [q for m in self.metrics for q in (m.value, m.samples)]

    def metric(self, name: MetricName) -> MetricQueries:
        for m in self.metrics:
            if m.metric == name:
                return m
        raise KeyError(name)


def build_queries(*, policy: str, namespace: str, track: Track, revision: str, lane: str, window: float) -> LaneQueries:
    """All queries of one lane of one track/revision over ``window`` seconds."""
    labels = {"namespace": namespace, "policy": policy, "track": track, "revision": revision, "lane": lane}
    sel = selector(**labels)
    w = promql_window(window)
    metrics = [
        MetricQueries(
            metric=name,
            value=(f"histogram_quantile({QUANTILE}, sum by (le) (rate({hist}_bucket{sel}[{w}])))"),
            samples=f"sum(increase({hist}_count{sel}[{w}]))",
        )
        for name, hist in _HISTOGRAM.items()
    ]
    errors = selector(**labels, extra=f'outcome=~"{"|".join(ERROR_OUTCOMES)}"')
    served = selector(**labels, extra='outcome!="invalid"')
    metrics.append(
        MetricQueries(
            metric="errorRate",
            # `or vector(0)`: no error series at all (an exporter that creates outcome series
            # lazily) is a zero rate, not "no data"; no served series still is no data.
            value=(
                f"(sum(rate({REQUESTS_METRIC}{errors}[{w}])) or vector(0)) / sum(rate({REQUESTS_METRIC}{served}[{w}]))"
            ),
            samples=f"sum(increase({REQUESTS_METRIC}{served}[{w}]))",
        )
    )
    return LaneQueries(track=track, revision=revision, lane=lane, window=w, metrics=tuple(metrics))


# --------------------------------------------------------------------------- backend


@dataclass(frozen=True)
class Measurement:
    """The scalar result of one instant query.

    ``value`` is None when the query returned no series or NaN (no traffic): that is no
    data, not an error. ``error`` is set when the query itself failed.
    """

    query: str
    value: float | None = None
    error: str | None = None


class MetricsBackend(Protocol):
    """What the analysis needs from a metrics store: run instant queries, never raise for
    store faults (unreachable, timeout, bad response): those come back as ``error``."""

    def measure(self, queries: Sequence[str]) -> Mapping[str, Measurement]: ...


# --------------------------------------------------------------------------- verdicts


@dataclass(frozen=True)
class MetricCheck:
    """One metric of one lane of one track: the evidence and its outcome."""

    track: Track
    revision: str
    lane: str
    metric: MetricName
    query: str
    samples_query: str
    value: float | None
    samples: float | None
    threshold: float
    outcome: Outcome
    error: str | None = None
    note: str | None = None
    """Why the outcome is not the plain SLO comparison (e.g. the stable breaches too)."""

    def describe(self) -> str:
        if self.outcome is Outcome.ERROR:
            return f"lane {self.lane} {self.metric}: query error ({self.error})"
        threshold = format_value(self.metric, self.threshold)
        value = "no data" if self.value is None else format_value(self.metric, self.value)
        if self.note:
            return f"lane {self.lane} {self.metric}: {value} > {threshold} but {self.note}"
        samples = "0" if self.samples is None else f"{self.samples:.0f}"
        op = ">" if self.outcome is Outcome.FAILED else "<="
        if self.outcome is Outcome.INCONCLUSIVE:
            return f"lane {self.lane} {self.metric}: {value} from {samples} samples (too few)"
        return f"lane {self.lane} {self.metric}: {value} {op} {threshold} ({samples} samples)"


@dataclass(frozen=True)
class LaneVerdict:
    lane: str
    outcome: Outcome
    canary: tuple[MetricCheck, ...]
    stable: tuple[MetricCheck, ...] = ()

    def check(self, metric: MetricName, track: Track = "canary") -> MetricCheck | None:
        for c in self.canary if track == "canary" else self.stable:
            if c.metric == metric:
                return c
        return None


@dataclass(frozen=True)
class AnalysisResult:
    """One analysis of the canary over the last interval, all lanes."""

    time: datetime
    window: str
    canary_revision: str
    stable_revision: str | None
    lanes: tuple[LaneVerdict, ...] = field(default_factory=tuple)

    @property
    def outcome(self) -> Outcome:
        return combine([lane.outcome for lane in self.lanes])

    def evidence(self, only: Sequence[Outcome] | None = None) -> str:
        """A short text with the canary's values (optionally only checks with given outcomes)."""
        parts = [c.describe() for lane in self.lanes for c in lane.canary if only is None or c.outcome in only]
        return "; ".join(parts) if parts else "no measurements"


def _finite(value: float | None) -> float | None:
    if value is None or not math.isfinite(value):
        return None
    return value


def _not_nan(value: float | None) -> float | None:
    """NaN is "no data"; +Inf stays (a quantile in the +Inf bucket is a breach, not a gap)."""
    if value is None or math.isnan(value):
        return None
    return value


def check_metric(
    *,
    queries: LaneQueries,
    metric: MetricName,
    measurements: Mapping[str, Measurement],
    threshold: float,
    min_samples: int,
) -> MetricCheck:
    """Verdict of one metric from its raw measurements (see the module docstring)."""
    mq = queries.metric(metric)
    value_m = measurements.get(mq.value, Measurement(mq.value, error="not measured"))
    samples_m = measurements.get(mq.samples, Measurement(mq.samples, error="not measured"))
    value = _not_nan(value_m.value)
    samples = _finite(samples_m.value)
    error = value_m.error or samples_m.error
    if error is not None:
        outcome = Outcome.ERROR
    elif samples is None or samples < min_samples or value is None:
        outcome = Outcome.INCONCLUSIVE
    elif value > threshold:
        outcome = Outcome.FAILED
    else:
        outcome = Outcome.SUCCESSFUL
    return MetricCheck(
        track=queries.track,
        revision=queries.revision,
        lane=queries.lane,
        metric=metric,
        query=mq.value,
        samples_query=mq.samples,
        value=value,
        samples=samples,
        threshold=threshold,
        outcome=outcome,
        error=error,
    )


def excuse_shared_breach(check: MetricCheck, stable: Sequence[MetricCheck]) -> MetricCheck:
    """A Failed canary check becomes Inconclusive when the stable breaches as badly (see above)."""
    if check.outcome is not Outcome.FAILED or check.value is None:
        return check
    twin = next((s for s in stable if s.metric == check.metric), None)
    if twin is None or twin.outcome is not Outcome.FAILED or twin.value is None:
        return check
    if check.value > twin.value * (1 + STABLE_TOLERANCE):
        return check
    return dataclasses.replace(
        check,
        outcome=Outcome.INCONCLUSIVE,
        note=(
            f"the stable track breaches too ({format_value(twin.metric, twin.value)}, {twin.samples or 0:.0f} samples): "
            "not the canary's doing"
        ),
    )


def lane_thresholds(spec: PolicySpec, lane: str) -> dict[MetricName, float]:
    slo = spec.lane_slo(lane)
    return {"p99Latency": slo.p99_latency, "queueAge": slo.max_queue_age, "errorRate": slo.max_error_rate}


def plan_queries(
    spec: PolicySpec,
    *,
    policy: str,
    namespace: str,
    canary_revision: str,
    stable_revision: str | None,
) -> list[LaneQueries]:
    """Every query one analysis runs: each lane of the canary, and of the stable track."""
    tracks: list[tuple[Track, str]] = [("canary", canary_revision)]
    if stable_revision is not None:
        tracks.append(("stable", stable_revision))
    return [
        build_queries(
            policy=policy,
            namespace=namespace,
            track=track,
            revision=revision,
            lane=lane.name,
            window=spec.rollout.analysis_interval,
        )
        for lane in spec.lanes
        for track, revision in tracks
    ]


def verdicts(
    spec: PolicySpec,
    lane_queries: Sequence[LaneQueries],
    measurements: Mapping[str, Measurement],
) -> tuple[LaneVerdict, ...]:
    """Turn raw measurements into per-lane verdicts (canary decides, stable is evidence)."""
    min_samples = spec.rollout.min_samples
    by_lane: dict[str, dict[str, list[MetricCheck]]] = {}
    for lq in lane_queries:
        thresholds = lane_thresholds(spec, lq.lane)
        checks = by_lane.setdefault(lq.lane, {"canary": [], "stable": []})
        for metric in METRICS:
            checks[lq.track].append(
                check_metric(
                    queries=lq,
                    metric=metric,
                    measurements=measurements,
                    threshold=thresholds[metric],
                    min_samples=min_samples,
                )
            )
    result = []
    for lane in spec.lanes:
        lane_checks = by_lane.get(lane.name)
        if lane_checks is None:
            continue
        stable = tuple(lane_checks["stable"])
        canary = tuple(excuse_shared_breach(c, stable) for c in lane_checks["canary"])
        result.append(
            LaneVerdict(
                lane=lane.name,
                outcome=combine([c.outcome for c in canary]),
                canary=canary,
                stable=stable,
            )
        )
    return tuple(result)


def run_analysis(
    backend: MetricsBackend,
    spec: PolicySpec,
    *,
    policy: str,
    namespace: str,
    canary_revision: str,
    stable_revision: str | None,
    now: datetime,
) -> AnalysisResult:
    """Query the backend once for every lane of both tracks and judge the canary."""
    lane_queries = plan_queries(
        spec,
        policy=policy,
        namespace=namespace,
        canary_revision=canary_revision,
        stable_revision=stable_revision,
    )
    measurements = backend.measure([q for lq in lane_queries for q in lq.all()])
    return AnalysisResult(
        time=now,
        window=promql_window(spec.rollout.analysis_interval),
        canary_revision=canary_revision,
        stable_revision=stable_revision,
        lanes=verdicts(spec, lane_queries, measurements),
    )
