"""Fair comparison under exact traffic weights (``spec.rollout.trafficRouting``), pure.

With the replica ratio every pod gets the same arrival rate. With a route's exact weight it
does not: at 10% of a 2-replica policy the canary's one pod gets 10% of the traffic while each
stable pod gets 45%. A dynamic batcher fed 4.5x less fills smaller batches; its latency and
queue age are not the ones it would show at full load, usually better (less queueing), so a
Successful verdict on it is optimistic. Three things keep the comparison fair:

1. the canary is sized to its weight (``traffic.split_for_routing``: ``round(N * w / (100 - w))``
   pods, at least 1, at most N, beside the stable's N), which is as close to the stable's
   per-pod rate as whole pods allow (at 50% of 2 replicas, 2 canary pods: 25% each, as each
   stable pod; 1 canary pod there would get twice a stable pod's load, a pessimistic
   comparison that rolled good changes back in the end-to-end test);
2. every analysis also measures the **per-pod arrival rate** of both tracks (all requests over
   the analysis window per pod that served any); the canary is *underfed* when its rate is
   below ``trafficRouting.minCanaryLoadRatio`` (default 0.5) of the stable's;
3. an underfed analysis is judged by what comes after it (:func:`judge_load`):

   * a later step of the plan feeds the canary comparably (:func:`planned_load_ratio`, the
     split's per-pod shares): the step is a **smoke test**. The verdict at the canary's own
     load stands (Successful passes the step; a Failed check, a canary that breaches even
     underfed, counts), the Event ``CanaryUnderfed`` names the step whose like-for-like
     comparison will gate the promotion. Small first steps limit the blast radius; they do not
     have to carry the comparison a small canary cannot make.
   * no later step does: the Successful checks become Inconclusive (this analysis cannot pass
     the step; nothing is held against the canary either; a Failed check stands), and the
     reason, with the weight that would feed the canary, goes to ``status.rollout.underfed``:
     after ``maxInconclusive`` such analyses the rollout stalls as ``CanaryUnderfed`` saying what
     to change, never as an unexplained wait.

4. the tally does not carry across unlike loads: the canary's evidence (``status.rollout.evidence``,
   its last analyses' bad events) is pooled over analyses of steps that feed it alike
   (:func:`fed_alike`); entering a step whose planned per-pod ratio differs by more than
   :data:`ALIKE_LOAD_SPREAD` from the step left starts a fresh tally, so the step that
   compares like with like is judged on its own evidence, not on a smoke test's at two thirds
   (or 1.33x) of a stable pod's load. Simulated (``bench/canary_eval.py``, the code trace, 100
   rollouts a cell, steps 10/25/50 of 20 s): no change with 2 replicas or for A/A and the
   demo's bad change; a queue shedding 2% against a 1% budget caught in 41% of rollouts with 4
   replicas against 33% with the tally carried over (within the noise of 100 rollouts).

``minCanaryLoadRatio: 0`` turns the check off. ``trafficRouting.header`` traffic counts as canary
traffic here (it can feed a canary its weight does not).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from datetime import datetime

from batchpilot_operator import traffic
from batchpilot_operator.analysis import (
    REQUESTS_METRIC,
    TALLY_ANALYSES,
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


def planned_load_ratio(replicas: int, weight: int, dynamic_stable: bool = False) -> float:
    """A canary pod's planned share of the traffic over a stable pod's at ``weight``, with the
    pods :func:`traffic.split_for_routing` gives each track (header traffic aside)."""
    if weight <= 0:
        return 0.0
    if weight >= 100:
        return 1.0
    stable, canary = traffic.split_for_routing(replicas, weight, dynamic_stable)
    return (weight / canary) / ((100 - weight) / stable)


def step_load_ratio(spec: PolicySpec, weight: int) -> float:
    """:func:`planned_load_ratio` of ``spec``'s replicas and routing at ``weight``."""
    return planned_load_ratio(spec.replicas, weight, traffic.scales_stable(spec))


ALIKE_LOAD_SPREAD = 1.25
"""Two steps feed the canary alike when their planned per-pod load ratios are within this
factor of each other (:func:`fed_alike`)."""


def fed_alike(spec: PolicySpec, weight: int, other: int) -> bool:
    """Whether steps at ``weight`` and ``other`` feed a canary pod alike relative to a stable
    pod (their :func:`planned_load_ratio` within :data:`ALIKE_LOAD_SPREAD`). Always without a
    route: every pod then gets the same share."""
    if spec.rollout.traffic_routing is None:
        return True
    a = step_load_ratio(spec, weight)
    b = step_load_ratio(spec, other)
    return min(a, b) > 0 and max(a, b) / min(a, b) <= ALIKE_LOAD_SPREAD


def unlike_load(spec: PolicySpec, step_index: int) -> str | None:
    """Why the relative objective (``rollout.maxP99Increase``) does not compare the canary's p99
    with the stable's at step ``step_index`` (None: it does). A batching server's p99 depends
    on its own load, so the comparison is made only at steps whose planned per-pod load
    (:func:`planned_load_ratio`) is within :data:`ALIKE_LOAD_SPREAD` of a stable pod's: always
    without a route; on the shipped 10/25/50 steps, the 50% step alone. Compared at every step,
    a canary pod fed 1.33x a stable pod's load (25% of 4 replicas) rolled back 1, held 3 and
    left 4 unfinished of 100 simulated A/A rollouts on the code trace; compared at the 50% step
    alone, all 100 were promoted (``bench/canary_eval.py``, code/4r/gateway). The SLOs are
    judged at every step."""
    steps = spec.rollout.steps
    if spec.rollout.max_p99_increase is None or spec.rollout.traffic_routing is None or step_index >= len(steps):
        return None

    def alike(weight: int) -> bool:  # fed as at 100%, where both tracks serve it all (ratio 1)
        return fed_alike(spec, weight, 100)

    weight = steps[step_index].weight
    if alike(weight):
        return None
    ratio = step_load_ratio(spec, weight)
    why = (
        f"not compared with the stable's p99 at step {step_index + 1} ({weight}%): a canary pod is fed {ratio:.2f}x"
        " a stable pod's load, and a batching server's p99 depends on its load"
    )
    later = next((i for i in range(step_index + 1, len(steps)) if alike(steps[i].weight)), None)
    if later is not None:
        return f"{why}; step {later + 1} ({steps[later].weight}%) compares like with like"
    return f"{why}; no step feeds it like the stable, so maxP99Increase is judged at none (the SLOs still are)"


def gating_analyses(spec: PolicySpec) -> int:
    """How many analyses the tally that promotes a canary can hold: those of the final run of
    steps fed alike (the last step and the steps just before it that feed the canary as it
    does; :func:`fed_alike`), each step ``floor(pause / analysisInterval)`` of them and at
    least one (a clean step passes on the analyses its pause holds: its first analysis comes
    an interval after its pods are ready, and it advances when the pause ends), at most
    :data:`analysis.TALLY_ANALYSES`. What the gate can see (``power``) is judged on this
    many analyses: a short like-for-like last step sees less than a full tally would."""
    steps = spec.rollout.steps
    interval = spec.rollout.analysis_interval
    last = steps[-1].weight
    count = 0
    for step in reversed(steps):
        if not fed_alike(spec, step.weight, last):
            break
        count += max(1, math.floor(step.pause / interval + 1e-9))
    return max(1, min(TALLY_ANALYSES, count))


def fed_weight(replicas: int, min_ratio: float, dynamic_stable: bool = False) -> int:
    """The smallest weight whose planned split feeds a canary pod ``min_ratio`` of a stable
    pod's rate (100 always does: both tracks serve all of it)."""
    return next((w for w in range(1, 100) if planned_load_ratio(replicas, w, dynamic_stable) >= min_ratio), 100)


def comparable_step_after(spec: PolicySpec, step_index: int, min_ratio: float) -> int | None:
    """The first step after ``step_index`` whose weight feeds the canary comparably, if any."""
    steps = spec.rollout.steps
    return next(
        (i for i in range(step_index + 1, len(steps)) if step_load_ratio(spec, steps[i].weight) >= min_ratio),
        None,
    )


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
    step_index: int,
    now: datetime,
    emit: Emit,
) -> AnalysisResult:
    """Apply the load check to one analysis of step ``step_index`` (one extra query pair per
    analysis): an underfed canary's step is a smoke test when a later step feeds it, and
    otherwise cannot pass, with the reason in ``result.underfed`` (module doc)."""
    min_ratio = routing.min_canary_load_ratio
    if min_ratio <= 0 or result.stable_revision is None:
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
    if not underfed(rates["canary"], rates["stable"], min_ratio):
        return result
    steps = spec.rollout.steps
    fed = (
        f"canary underfed at step {step_index + 1} ({steps[step_index].weight}%)"
        if step_index < len(steps)
        else "canary underfed"
    )
    fed += (
        f": {rates['canary'] or 0.0:.2f} req/s per pod against the stable's {rates['stable'] or 0.0:.2f}"
        f" (below minCanaryLoadRatio {min_ratio:g}); its batching is not comparable"
    )
    later = comparable_step_after(spec, step_index, min_ratio)
    if later is not None:
        emit(
            "Normal",
            "CanaryUnderfed",
            f"{fed}: this step is a smoke test judged at the canary's own load; the like-for-like comparison"
            f" that gates the promotion is step {later + 1} ({steps[later].weight}%)",
        )
        return result
    need = fed_weight(spec.replicas, min_ratio, traffic.scales_stable(spec))
    note = (
        f"{fed}, and no later step feeds it: this analysis cannot pass the step. To go on, give this step a"
        f" weight of at least {need}% (with {spec.replicas} replicas), add replicas, send the canary header"
        f" traffic, or lower minCanaryLoadRatio knowingly"
    )
    emit("Normal", "CanaryUnderfed", note)
    return dataclasses.replace(downgrade(result), underfed=note)
