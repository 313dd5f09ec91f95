"""Fair comparison under exact traffic weights (``spec.rollout.trafficRouting``), pure.

With the replica ratio every pod gets the same arrival rate. With a route's exact weight it
does not: at 10% of a 2-replica policy the canary's one pod gets 10% of the traffic while each
stable pod gets 45%. A dynamic batcher fed 4.5x less fills smaller batches; its latency and
queue age are not the ones it would show at full load, usually better (less queueing), so a
Successful verdict on it is optimistic. Two things keep the comparison fair:

1. the canary is sized to its weight (``traffic.split_for_routing``: ``round(N * w / (100 - w))``
   pods, at least 1, at most N, beside the stable's N), which is as close to the stable's
   per-pod rate as whole pods allow (at 50% of 2 replicas, 2 canary pods: 25% each, as each
   stable pod; 1 canary pod there would get twice a stable pod's load, a pessimistic
   comparison that rolled good changes back in the end-to-end test); and
2. this check: every analysis also measures the **per-pod arrival rate** of both tracks (all
   requests over the analysis window per pod that served any); when the canary's is below
   ``trafficRouting.minCanaryLoadRatio`` (default 0.5) of the stable's, its Successful checks
   become Inconclusive ("underfed"): the step does not pass on them, and nothing is held
   against the canary either. A Failed check stands (a canary that breaches its SLO even
   underfed is worse at full load). ``minCanaryLoadRatio: 0`` turns the check off.

So with few replicas a small step cannot promote on thin evidence: the rollout stays on it
(and after ``maxInconclusive`` analyses stalls as ``InconclusiveLimit``) until the weight feeds
the canary comparably. ``trafficRouting.header`` traffic counts as canary traffic here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from datetime import datetime

from batchpilot_operator.analysis import (
    REQUESTS_METRIC,
    AnalysisResult,
    LaneVerdict,
    MetricsBackend,
    Outcome,
    combine,
    promql_window,
)
from batchpilot_operator.spec import PolicySpec, TrafficRouting

Emit = Callable[[str, str, str], None]


def _sel(namespace: str, policy: str, track: str, revision: str) -> str:
    return f'{{namespace="{namespace}",policy="{policy}",track="{track}",revision="{revision}",outcome!="invalid"}}'


def per_pod_rate_query(*, namespace: str, policy: str, track: str, revision: str, window: float) -> str:
    """Requests/s per pod of one track over ``window`` (pods that served any request)."""
    sel = _sel(namespace, policy, track, revision)
    w = promql_window(window)
    return f"sum(rate({REQUESTS_METRIC}{sel}[{w}])) / count(sum by (pod) (rate({REQUESTS_METRIC}{sel}[{w}])) > 0)"


def underfed(canary_rate: float | None, stable_rate: float | None, min_ratio: float) -> bool:
    """True when the canary's per-pod rate is known to be below ``min_ratio`` of the stable's."""
    if min_ratio <= 0 or stable_rate is None or stable_rate <= 0:
        return False
    return (canary_rate or 0.0) < min_ratio * stable_rate


def downgrade(result: AnalysisResult) -> AnalysisResult:
    """Successful canary checks become Inconclusive (neither pass nor hold the step)."""
    lanes: list[LaneVerdict] = []
    for lane in result.lanes:
        canary = tuple(
            dataclasses.replace(c, outcome=Outcome.INCONCLUSIVE, note=None, shared_breach=False)
            if c.outcome is Outcome.SUCCESSFUL or (c.outcome is Outcome.INCONCLUSIVE and c.shared_breach)
            else c
            for c in lane.canary
        )
        lanes.append(dataclasses.replace(lane, canary=canary, outcome=combine([c.outcome for c in canary])))
    return dataclasses.replace(result, lanes=tuple(lanes))


def judge_load(
    backend: MetricsBackend,
    result: AnalysisResult,
    routing: TrafficRouting,
    *,
    policy: str,
    namespace: str,
    spec: PolicySpec,
    now: datetime,
    emit: Emit,
) -> AnalysisResult:
    """Apply the load check to one analysis (one extra query pair per analysis)."""
    if routing.min_canary_load_ratio <= 0 or result.stable_revision is None:
        return result
    window = spec.rollout.analysis_interval
    queries = {
        track: per_pod_rate_query(namespace=namespace, policy=policy, track=track, revision=rev, window=window)
        for track, rev in (("canary", result.canary_revision), ("stable", result.stable_revision))
    }
    measured = backend.measure(list(queries.values()), at=now.timestamp())
    rates = {
        track: measured[q].value if q in measured and measured[q].error is None else None
        for track, q in queries.items()
    }
    if not underfed(rates["canary"], rates["stable"], routing.min_canary_load_ratio):
        return result
    note = (
        f"canary underfed: {rates['canary'] or 0.0:.2f} req/s per pod against the stable's {rates['stable'] or 0.0:.2f}"
        f" (below minCanaryLoadRatio {routing.min_canary_load_ratio:g}); its batching is not comparable, so"
        " this analysis cannot pass the step"
    )
    emit("Normal", "CanaryUnderfed", note)
    return downgrade(result)
