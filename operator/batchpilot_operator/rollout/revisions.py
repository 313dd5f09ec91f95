"""Which revision is stable and which canaries: the first revision, an adopted one after a
lost status, a new revision starting a canary, and a canary superseded or dropped."""

from __future__ import annotations

from batchpilot_operator.rollout.schedule import split_for
from batchpilot_operator.rollout.state import PlanState, progress_text, ready_text
from batchpilot_operator.status import RolloutState


def adopt_or_initialise(p: PlanState) -> None:
    st = p.st
    obs = p.inputs.observed.stable
    if obs is None or obs.revision is None:
        return
    if st.phase is None and obs.revision != p.desired and obs.ready_replicas > 0:
        st.stable_revision = obs.revision
        p.ledger("Adopted", obs.revision, reason="status empty; stable Deployment already serves it")
        p.event("Normal", "Adopted", f"adopted running revision {obs.revision} as stable")
    elif obs.revision == p.desired and obs.ready_replicas >= p.spec.replicas:
        st.stable_revision = p.desired
        p.history(p.desired, "Promoted", "initial revision", ready_text(obs))
        p.ledger("Initial", p.desired, reason="first revision is stable", evidence=ready_text(obs))
        p.event("Normal", "Initialized", f"revision {p.desired} is stable ({ready_text(obs)} ready)")


def reconcile_revision(p: PlanState) -> None:
    st = p.st
    r = st.rollout
    if p.desired == st.stable_revision:
        if r is not None:
            supersede(p, r, f"spec reverted to the stable revision {p.desired}")
    elif st.is_failed(p.desired):
        if r is not None:
            supersede(p, r, f"desired revision {p.desired} failed before and is not retried")
    else:
        if r is not None and r.revision != p.desired:
            supersede(p, r, f"superseded by revision {p.desired}")
        if st.rollout is None:
            start_canary(p)


def supersede(p: PlanState, r: RolloutState, reason: str) -> None:
    p.history(r.revision, "Superseded", reason, progress_text(r, p.spec))
    p.ledger("Superseded", r.revision, reason=reason, evidence=progress_text(r, p.spec))
    p.event("Normal", "Superseded", f"canary {r.revision} dropped: {reason}")
    p.rollouts.append("Superseded")
    p.st.rollout = None


def start_canary(p: PlanState) -> None:
    step = p.spec.rollout.steps[0]
    p.st.rollout = RolloutState(
        revision=p.desired,
        step_index=0,
        step_weight=step.weight,
        started_at=p.now,
        step_entered_at=p.now,
    )
    split = split_for(p.spec, step.weight)
    msg = (
        f"canary {p.desired} started at step 1/{len(p.spec.rollout.steps)}: weight {step.weight}% "
        f"(effective {split.effective_weight}%: {split.canary} canary + {split.stable} stable)"
    )
    p.ledger("CanaryStarted", p.desired, reason=f"stable is {p.st.stable_revision}", evidence=msg)
    p.event("Normal", "CanaryStarted", msg)
