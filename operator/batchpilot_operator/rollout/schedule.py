"""When a rollout needs what: the replicas of each track for a step weight, when the next
analysis is due, which tracks' pods the controller should read. Pure, read by the controller
before it calls :func:`~batchpilot_operator.rollout.plan` and by the plan itself."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from batchpilot_operator.rollout.inputs import Observed
from batchpilot_operator.spec import PolicySpec
from batchpilot_operator.status import RolloutState, Status
from batchpilot_operator.traffic import scales_stable, split_for_routing


@dataclass(frozen=True)
class ReplicaSplit:
    stable: int
    canary: int
    effective_weight: int
    """The canary's share of pods (and of traffic), percent."""


def split_replicas(total: int, weight: int) -> ReplicaSplit:
    """Replicas of each track for a canary weight (percent) over ``total`` replicas."""
    if total < 1:
        raise ValueError(f"total replicas must be >= 1, got {total}")
    if not 0 <= weight <= 100:
        raise ValueError(f"weight must be 0..100, got {weight}")
    if weight == 0:
        return ReplicaSplit(stable=total, canary=0, effective_weight=0)
    canary = min(total, max(1, int(total * weight / 100 + 0.5)))
    stable = total - canary
    if weight < 100:
        stable = max(1, stable)
    return ReplicaSplit(stable=stable, canary=canary, effective_weight=percent(canary, stable + canary))


def split_for(spec: PolicySpec, weight: int) -> ReplicaSplit:
    """Replicas per track for a step weight: the pod ratio, or under trafficRouting the
    weight set on the route exactly (``traffic.split_for_routing``; with ``dynamicStableScale``
    the stable's count is for the weight the route is seen to send, ``rollout.finish``)."""
    if spec.rollout.traffic_routing is None:
        return split_replicas(spec.replicas, weight)
    stable, canary = split_for_routing(spec.replicas, weight, scales_stable(spec))
    return ReplicaSplit(stable=stable, canary=canary, effective_weight=weight)


def percent(part: int, whole: int) -> int:
    return 0 if whole <= 0 else int(100 * part / whole + 0.5)


def next_analysis_at(spec: PolicySpec, rollout: RolloutState) -> datetime | None:
    """When the next analysis of the canary is due (None: not while waiting for pods)."""
    if rollout.step_started_at is None:
        return None
    base = rollout.step_started_at
    if rollout.last_analysis_at is not None and rollout.last_analysis_at > base:
        base = rollout.last_analysis_at
    return base + timedelta(seconds=spec.rollout.analysis_interval)


def analysis_due(spec: PolicySpec, status: Status, now: datetime) -> bool:
    """True when the handler should query Prometheus before calling :func:`plan`.

    Analyse ``status.rollout.revision`` (canary) against ``status.stableRevision`` over the
    last ``spec.rollout.analysisInterval`` (see :func:`analysis_target`).
    """
    rollout = status.rollout
    if rollout is None or status.paused:
        return False
    due = next_analysis_at(spec, rollout)
    return due is not None and now >= due


def canary_deadline_passed(spec: PolicySpec, status: Status, now: datetime) -> bool:
    """True when the canary's pods of the current step are past ``progressDeadline`` unready
    (judged on the status: the step clock has not started)."""
    r = status.rollout
    if r is None or status.paused or r.step_started_at is not None:
        return False
    return (now - r.step_entered_at).total_seconds() >= spec.rollout.progress_deadline


def pods_needed(spec: PolicySpec, status: Status, observed: Observed, now: datetime) -> tuple[str, ...]:
    """Tracks whose pods the controller should read (an API LIST, only in trouble) so that
    :attr:`PlanInputs.pod_trouble` can say why they are not ready: the canary once past its
    progress deadline, the stable while it has fewer ready pods than its Deployment asks."""
    tracks: list[str] = []
    st = observed.stable
    if st is not None and st.revision == status.stable_revision is not None and st.ready_replicas < st.replicas:
        tracks.append("stable")
    if canary_deadline_passed(spec, status, now):
        tracks.append("canary")
    return tuple(tracks)


def analysis_target(status: Status) -> tuple[str, str | None] | None:
    """(canary revision, stable revision) to analyse, or None when no canary is in flight."""
    if status.rollout is None:
        return None
    return status.rollout.revision, status.stable_revision
