"""The PromQL of an analysis: per objective (:data:`.objectives.OBJECTIVES`), lane, tenant
slice and track, over the analysis window (:class:`LaneQueries`) and as raw counters read at
the sub-window boundaries (:class:`CounterQueries`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from batchpilot_operator.analysis.objectives import (
    OBJECTIVES,
    QUANTILE,
    REQUESTS_METRIC,
    Counted,
    MetricName,
    Objective,
    Track,
    judged_metrics,
    objective,
)
from batchpilot_operator.spec import PolicySpec


def promql_window(seconds: float) -> str:
    """A PromQL range for a window in seconds: whole seconds as ``30s``, else milliseconds."""
    if seconds <= 0:
        raise ValueError(f"analysis window must be positive, got {seconds}")
    if float(seconds).is_integer():
        return f"{int(seconds)}s"
    return f"{max(1, round(seconds * 1000))}ms"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


def selector(
    *,
    namespace: str,
    policy: str,
    track: str,
    revision: str,
    lane: str,
    extra: str = "",
    tenant: str | None = None,
    environment: str | None = None,
) -> str:
    """The label matchers of one (policy, track, revision, lane), plus ``extra`` matchers verbatim;
    with ``environment`` the target label of that name, with ``tenant`` one tenant slice."""
    labels = {"namespace": namespace, "policy": policy, "track": track, "revision": revision, "lane": lane}
    if environment is not None:
        labels["environment"] = environment
    if tenant is not None:
        labels["tenant"] = tenant
    matchers = [f'{k}="{_escape(v)}"' for k, v in labels.items()]
    if extra:
        matchers.append(extra)
    return "{" + ",".join(matchers) + "}"


@dataclass(frozen=True)
class MetricQueries:
    """The queries of one metric of one (track, revision, lane).

    ``value`` is what people read (the p99, the error rate); ``samples`` counts the requests;
    ``bad`` gives the bad events: the histogram's buckets by ``le`` (the count over the
    threshold is read from them), or the count of error outcomes.
    """

    metric: MetricName
    value: str
    samples: str
    bad: str
    codes: str | None = None
    """clientErrors: the rejected requests by status ``code`` (for the evidence)."""


def lane_key(lane: str, tenant: str | None) -> str:
    """A lane's name, or one tenant slice of it: ``interactive``, ``interactive[b]``."""
    return lane if tenant is None else f"{lane}[{tenant}]"


@dataclass(frozen=True)
class LaneQueries:
    track: Track
    revision: str
    lane: str
    window: str
    metrics: tuple[MetricQueries, ...]
    tenant: str | None = None
    """One tenant slice of the lane (None: the lane's total, every tenant)."""
    environment: str | None = None

    @property
    def key(self) -> str:
        return lane_key(self.lane, self.tenant)

    def all(self) -> list[str]:
        return [q for m in self.metrics for q in (m.value, m.samples, m.bad, m.codes) if q is not None]

    def metric(self, name: MetricName) -> MetricQueries:
        for m in self.metrics:
            if m.metric == name:
                return m
        raise KeyError(name)


def build_queries(
    *,
    policy: str,
    namespace: str,
    track: Track,
    revision: str,
    lane: str,
    window: float,
    tenant: str | None = None,
    environment: str | None = None,
    judged: Sequence[MetricName] | None = None,
) -> LaneQueries:
    """The queries of one lane (or one tenant slice of it) of one track/revision over ``window``
    seconds, of the ``judged`` objectives (default: all but the opt-in relative one,
    :func:`.objectives.judged_metrics`)."""
    labels = _labels(namespace, policy, track, revision, lane, tenant, environment)
    w = promql_window(window)
    metrics = [
        _window_queries(o, labels, w)
        for o in OBJECTIVES
        if (o.name in judged if judged is not None else not o.relative)
    ]
    return LaneQueries(
        track=track,
        revision=revision,
        lane=lane,
        window=w,
        metrics=tuple(metrics),
        tenant=tenant,
        environment=environment,
    )


def plan_queries(
    spec: PolicySpec,
    *,
    policy: str,
    namespace: str,
    canary_revision: str,
    stable_revision: str | None,
    environment: str | None = None,
) -> list[LaneQueries]:
    """Every query one analysis runs: each lane of the canary, and of the stable track, in
    total and per tenant slice (:attr:`PolicySpec.tenant_slices`); ``environment``: only the
    targets Prometheus labels with it (the policy's ``batchpilot.dev/environment``)."""
    judged = judged_metrics(spec)
    tracks: list[tuple[Track, str]] = [("canary", canary_revision)]
    if stable_revision is not None:
        tracks.append(("stable", stable_revision))
    tenants: list[str | None] = [None, *spec.tenant_slices]
    return [
        build_queries(
            policy=policy,
            namespace=namespace,
            track=track,
            revision=revision,
            lane=lane.name,
            window=spec.rollout.analysis_interval,
            tenant=tenant,
            environment=environment,
            judged=judged,
        )
        for lane in spec.lanes
        for tenant in tenants
        for track, revision in tracks
    ]


SliceKey = tuple[str, str, MetricName]
"""(track, lane key, metric): the lane key is the lane, or ``lane[tenant]`` (:func:`lane_key`)."""


@dataclass(frozen=True)
class CounterQueries:
    """The raw cumulative counters of one metric of one (track, lane): the requests and the
    bad events (buckets by ``le``, or the error count). Read at the boundaries of the
    sub-windows, their differences are each sub-window's counts."""

    track: Track
    lane: str
    metric: MetricName
    requests: str
    bad: str
    tenant: str | None = None

    @property
    def key(self) -> SliceKey:
        return (self.track, lane_key(self.lane, self.tenant), self.metric)


def counter_queries(lane_queries: Sequence[LaneQueries], *, policy: str, namespace: str) -> list[CounterQueries]:
    out: list[CounterQueries] = []
    for lq in lane_queries:
        labels = _labels(namespace, policy, lq.track, lq.revision, lq.lane, lq.tenant, lq.environment)
        out.extend(_counter_queries(objective(m.metric), lq, labels) for m in lq.metrics)
    return out


def _labels(
    namespace: str, policy: str, track: str, revision: str, lane: str, tenant: str | None, environment: str | None
) -> dict[str, Any]:
    """The arguments of :func:`selector` for one (policy, track, revision, lane[, tenant])."""
    return {
        "namespace": namespace,
        "policy": policy,
        "track": track,
        "revision": revision,
        "lane": lane,
        "tenant": tenant,
        "environment": environment,
    }


def _window_queries(o: Objective, labels: dict[str, Any], w: str) -> MetricQueries:
    """One objective's queries over the window ``w``."""
    sel = selector(**labels)
    src = o.source
    if not isinstance(src, Counted):
        hist = src.metric
        return MetricQueries(
            metric=o.name,
            value=f"histogram_quantile({QUANTILE}, sum by (le) (rate({hist}_bucket{sel}[{w}])))",
            samples=f"sum(increase({hist}_count{sel}[{w}]))",
            bad=f"sum by (le) (increase({hist}_bucket{sel}[{w}]))",
        )
    bad = selector(**labels, extra=src.bad)
    of = selector(**labels, extra=src.of)
    return MetricQueries(
        metric=o.name,
        # `or vector(0)`: no bad series at all (an exporter that creates outcome series
        # lazily) is a zero rate, not "no data"; no series of the requests still is no data.
        value=f"(sum(rate({REQUESTS_METRIC}{bad}[{w}])) or vector(0)) / sum(rate({REQUESTS_METRIC}{of}[{w}]))",
        samples=f"sum(increase({REQUESTS_METRIC}{of}[{w}]))",
        bad=f"sum(increase({REQUESTS_METRIC}{bad}[{w}])) or vector(0)",
        codes=f"sum by (code) (increase({REQUESTS_METRIC}{bad}[{w}]))" if src.by_code else None,
    )


def _counter_queries(o: Objective, lq: LaneQueries, labels: dict[str, Any]) -> CounterQueries:
    """One objective's raw cumulative counters (their differences are the sub-windows' counts)."""
    sel = selector(**labels)
    src = o.source
    if not isinstance(src, Counted):
        hist = src.metric
        requests, bad = f"sum({hist}_count{sel})", f"sum by (le) ({hist}_bucket{sel})"
    else:
        requests = f"sum({REQUESTS_METRIC}{selector(**labels, extra=src.of)})"
        bad = f"sum({REQUESTS_METRIC}{selector(**labels, extra=src.bad)}) or vector(0)"
    return CounterQueries(lq.track, lq.lane, o.name, requests, bad, lq.tenant)
