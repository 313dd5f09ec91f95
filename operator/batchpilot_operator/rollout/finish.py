"""The end of every plan: the replicas of each track (a promotion finishing, a routed canary
draining), the route's weights, the phase, message and kstatus conditions, the revisions to
keep, and when to plan again."""

from __future__ import annotations

from datetime import datetime, timedelta

from batchpilot_operator.rollout.evidence import inconclusive_advice
from batchpilot_operator.rollout.inputs import POLL_SECONDS, ROUTE_DRAIN_SECONDS, Decision
from batchpilot_operator.rollout.schedule import next_analysis_at, percent, split_for
from batchpilot_operator.rollout.state import PlanState, ts
from batchpilot_operator.status import ConditionStatus, ConditionType, Phase
from batchpilot_operator.traffic import (
    RouteInputs,
    RouteTarget,
    desired_route,
    dynamic_stable_replicas,
    scales_stable,
    stable_capacity,
)


def finish(p: PlanState) -> Decision:
    st = p.st
    spec = p.spec
    observed = p.inputs.observed
    r = st.rollout
    stable_rev = st.stable_revision or p.desired
    os = observed.stable
    stable_ready = os.ready_replicas if os is not None and os.revision == stable_rev else 0
    finishing = False
    draining = False
    routed = spec.rollout.traffic_routing is not None
    # the canary still takes traffic on the route: by weight, or by our header rule
    route_canary = (
        max(observed.route.canary_weight, 1 if observed.route.header_rule else 0) if observed.route is not None else 0
    )
    canary_rev: str | None = None
    dynamic = scales_stable(spec)
    if r is not None:
        split = split_for(spec, r.step_weight)
        stable_replicas, canary_replicas, canary_rev = split.stable, split.canary, r.revision
        if dynamic:
            # The stable gives up pods only for the weight the route is seen to send the canary:
            # a step's weight moves once its canary pods are ready, and the stable follows.
            seen = observed.route.canary_weight if observed.route is not None else 0
            stable_replicas = dynamic_stable_replicas(spec.replicas, min(r.step_weight, seen))
        st.current_step_index = r.step_index
        st.step_count = len(spec.rollout.steps)
        st.step_weight = r.step_weight
    else:
        stable_replicas, canary_replicas = spec.replicas, 0
        oc = observed.canary
        if (
            st.stable_revision is not None
            and oc is not None
            and oc.revision == st.stable_revision
            and oc.replicas > 0
            and (stable_ready < spec.replicas or (routed and route_canary > 0))
        ):
            finishing = True
            canary_rev, canary_replicas = oc.revision, oc.replicas
        elif routed and oc is not None and oc.replicas > 0 and (route_canary > 0 or not route_drained(p)):
            # Rolled back, aborted, dropped or promoted: the canary keeps its pods until the
            # route is seen at weight 0 (written by this decision), and then until the data
            # plane has had ROUTE_DRAIN_SECONDS to follow, so no request finds it gone.
            draining = True
            canary_rev, canary_replicas = oc.revision, oc.replicas
        st.current_step_index = None
        st.step_count = None
        st.step_weight = None
    if not draining or route_canary > 0:
        st.canary_drained_at = None
    st.canary_revision = canary_rev
    st.stable_replicas = stable_replicas
    st.canary_replicas = canary_replicas
    st.canary_weight = percent(canary_replicas, stable_replicas + canary_replicas)
    route: RouteTarget | None = None
    if routed:
        oc = observed.canary
        route = desired_route(
            RouteInputs(
                rollout_revision=r.revision if r is not None else None,
                step_weight=r.step_weight if r is not None else 0,
                step_index=r.step_index if r is not None else 0,
                step_ready=r is not None and r.step_started_at is not None,
                canary_ready_revision=oc.revision if oc is not None and oc.ready_replicas > 0 else None,
                canary_revision=oc.revision if oc is not None and oc.replicas > 0 else None,
                promoting=finishing and stable_ready < spec.replicas,
                observed=observed.route,
                previous_step_weight=(
                    spec.rollout.steps[r.step_index - 1].weight if r is not None and r.step_index > 0 else 0
                ),
                stable_capacity=stable_capacity(spec.replicas, stable_ready) if dynamic else 100,
            )
        )
        st.canary_weight = route.canary_weight

    stall = stall_reason(p)
    phase, message = phase_and_message(p, stable_ready, finishing, stall)
    st.phase = phase
    st.message = message
    set_conditions(p, phase, message, stable_ready, stall)
    set_degraded(p, stable_rev, stable_replicas, finishing)

    keep: list[str] = []
    for rev in (stable_rev, canary_rev):
        if rev is not None and rev not in keep:
            keep.append(rev)
    olds = 0
    for h in reversed(st.history):
        if olds >= spec.rollout.history_limit:
            break
        if h.outcome == "Promoted" and h.revision not in keep:
            keep.append(h.revision)
            olds += 1

    return Decision(
        status=st,
        stable_revision=stable_rev,
        stable_replicas=stable_replicas,
        canary_revision=canary_rev,
        canary_replicas=canary_replicas,
        keep_revisions=tuple(keep),
        events=tuple(p.events),
        rollout_outcomes=tuple(p.rollouts),
        rollback_reasons=tuple(p.rollback_reasons),
        analysis_outcomes=tuple(p.analyses),
        requeue_after=requeue(p, phase, finishing or draining, stable_ready),
        route=route,
    )


def phase_and_message(
    p: PlanState, stable_ready: int, finishing: bool, stall: tuple[str, str] | None
) -> tuple[Phase, str]:
    st = p.st
    spec = p.spec
    r = st.rollout
    n = spec.replicas
    if st.stable_revision is None:
        return Phase.PENDING, f"rolling out the first revision {p.desired}: {stable_ready}/{n} ready"
    if r is not None:
        steps = len(spec.rollout.steps)
        where = (
            f"canary {r.revision} at step {r.step_index + 1}/{steps}, weight {r.step_weight}% "
            f"(effective {st.canary_weight}%)"
        )
        if st.paused:
            return Phase.PAUSED, f"{where}: paused ({st.handled_commands.get('pause', 'true')})"
        if stall is not None:
            detail = stall[1]
        elif r.step_started_at is None:
            oc = p.inputs.observed.canary
            ready = oc.ready_replicas if oc is not None and oc.revision == r.revision else 0
            detail = f"waiting for canary pods ({ready}/{st.canary_replicas} ready)"
        else:
            pending = [lane.name for lane in spec.lanes if lane.name not in r.passed_lanes]
            ends = r.step_started_at + timedelta(seconds=spec.rollout.steps[r.step_index].pause)
            waits = []
            if r.step_started_at > p.now:
                waits.append(f"canary pods ready, warming up until {ts(r.step_started_at)} (spec.rollout.warmup)")
            if ends > p.now:
                # an absolute time: the message (and so .status) does not change on every call
                waits.append(f"step pause ends at {ts(ends)}")
            if pending:
                waits.append(f"awaiting a Successful analysis of lane(s) {', '.join(pending)}")
            detail = "; ".join(waits) or "step complete"
            if r.failures:
                detail += f"; failures {r.failures}/{spec.rollout.failure_limit}"
        return Phase.PROGRESSING, f"{where}: {detail}"
    if finishing:
        message = (
            f"revision {st.stable_revision} promoted; stable scaling up ({stable_ready}/{n} ready), "
            "then the canary Deployment goes away"
        )
        # The stable rolls beside the canary's pods, one more than both at its surge: on a
        # GPU pool sized to the steps its new pod may wait for a GPU that never frees.
        why = p.inputs.pod_trouble.get("stable")
        return Phase.PROGRESSING, f"{message}; waiting on {why}" if why else message
    if st.is_failed(p.desired) and p.desired != st.stable_revision:
        failed = next(f for f in st.failed_revisions if f.revision == p.desired)
        return Phase.ROLLED_BACK, (
            f"revision {p.desired} rolled back ({failed.reason}): {failed.evidence}; stable "
            f"{st.stable_revision} serves; not retried until the spec changes or a retry command"
        )
    if stable_ready == 0:
        return Phase.DEGRADED, f"stable revision {st.stable_revision} has no ready pods (0/{n})"
    return Phase.HEALTHY, f"revision {st.stable_revision} is stable ({stable_ready}/{n} ready)"


def set_conditions(p: PlanState, phase: Phase, message: str, stable_ready: int, stall: tuple[str, str] | None) -> None:
    ready = phase is Phase.HEALTHY and stable_ready >= p.spec.replicas
    reconciling = phase in (Phase.PENDING, Phase.PROGRESSING, Phase.PAUSED) or (phase is Phase.HEALTHY and not ready)
    if ready:
        set_condition(p, "Ready", "True", "Healthy", message)
    else:
        reason = "StableScaling" if phase is Phase.HEALTHY else phase.value
        set_condition(p, "Ready", "False", reason, message)
    set_condition(p, "Reconciling", "True" if reconciling else "False", phase.value, message)
    previous = p.inputs.status.condition("Stalled")
    if stall is None:
        set_condition(p, "Stalled", "False", "NotStalled", "")
        return
    reason, text = stall
    set_condition(p, "Stalled", "True", reason, text)
    if previous is None or previous.status != "True" or previous.reason != reason:
        revision = p.st.rollout.revision if p.st.rollout else p.desired
        if reason != "RolledBack":  # the rollback itself already left an event and a ledger entry
            p.ledger("Stalled", revision, reason=reason, evidence=text)
            p.event("Warning", "Stalled", f"{reason}: {text}")


def set_degraded(p: PlanState, stable_rev: str, stable_replicas: int, finishing: bool) -> None:
    """The Degraded condition: the stable track runs fewer ready pods than it should.

    Judged on the stable Deployment as observed, once it runs the stable revision at the
    replicas it should and its controller has caught up with that (a scale, as
    ``dynamicStableScale`` makes at every step, or a promotion still rolling is not a loss). The
    pods' reasons (node lost, unschedulable) come from :attr:`PlanInputs.pod_trouble`;
    a Warning event marks the transition when a reason is known.
    """
    st = p.st
    obs = p.inputs.observed.stable
    short = (
        st.stable_revision is not None
        and not finishing
        and obs is not None
        and obs.revision == stable_rev
        and obs.replicas == stable_replicas
        and obs.settled
        and obs.ready_replicas < stable_replicas
    )
    if not short:
        if st.condition("Degraded") is not None:
            set_condition(p, "Degraded", "False", "StableAtCapacity", "")
        return
    assert obs is not None
    why = p.inputs.pod_trouble.get("stable")
    reason = "StableUnavailable" if obs.ready_replicas == 0 else "StableUnderCapacity"
    message = f"stable revision {stable_rev} has {obs.ready_replicas}/{stable_replicas} ready pods"
    if why:
        message += f": {why}"
    previous = p.inputs.status.condition("Degraded")
    set_condition(p, "Degraded", "True", reason, message)
    if why and (previous is None or previous.status != "True" or previous.reason != reason):
        p.event("Warning", "Degraded", message)


def set_condition(p: PlanState, type_: ConditionType, status: ConditionStatus, reason: str, message: str) -> None:
    p.st.set_condition(type_, status, reason, message, p.inputs.generation, p.now)


def stall_reason(p: PlanState) -> tuple[str, str] | None:
    st = p.st
    r = st.rollout
    if r is None:
        if st.stable_revision is not None and st.is_failed(p.desired):
            return (
                "RolledBack",
                f"desired revision {p.desired} was rolled back; waiting for a new revision",
            )
        return None
    if st.paused:
        return None
    if r.metrics_error_since is not None:
        mu = p.spec.rollout.on_metrics_unavailable
        since = ts(r.metrics_error_since)
        if mu.action == "Rollback":
            at = ts(r.metrics_error_since + timedelta(seconds=mu.deadline))
            return (
                "MetricsUnavailable",
                f"metrics unavailable since {since}; rolling back at {at} unless back",
            )
        return "MetricsUnavailable", f"metrics unavailable since {since}; holding the rollout (Hold)"
    if r.inconclusive_streak >= p.spec.rollout.max_inconclusive:
        if r.underfed is not None:
            return (
                "CanaryUnderfed",
                f"{r.inconclusive_streak} Inconclusive analyses in a row; {r.underfed}; holding, not rolling back",
            )
        return (
            "InconclusiveLimit",
            f"{r.inconclusive_streak} Inconclusive analyses in a row: {inconclusive_advice(p)}",
        )
    return None


def route_drained(p: PlanState) -> bool:
    """Whether the route has sent the leaving canary nothing for ROUTE_DRAIN_SECONDS (the
    clock starts at the first reconcile that reads it so)."""
    if p.st.canary_drained_at is None:
        p.st.canary_drained_at = p.now
    return p.seconds_since(p.st.canary_drained_at) >= ROUTE_DRAIN_SECONDS


def requeue(p: PlanState, phase: Phase, finishing: bool, stable_ready: int) -> float | None:
    r = p.st.rollout
    if phase in (Phase.PENDING, Phase.DEGRADED) or finishing:
        return POLL_SECONDS
    if phase is Phase.HEALTHY and stable_ready < p.spec.replicas:
        return POLL_SECONDS
    if r is None or p.st.paused:
        return None
    if r.step_started_at is None:
        return POLL_SECONDS
    candidates: list[datetime] = []
    due = next_analysis_at(p.spec, r)
    if due is not None:
        candidates.append(due)
    candidates.append(r.step_started_at + timedelta(seconds=p.spec.rollout.steps[r.step_index].pause))
    mu = p.spec.rollout.on_metrics_unavailable
    if r.metrics_error_since is not None and mu.action == "Rollback":
        candidates.append(r.metrics_error_since + timedelta(seconds=mu.deadline))
    future = [c for c in candidates if c > p.now]
    if not future:
        return POLL_SECONDS
    return max(1.0, (min(future) - p.now).total_seconds())
