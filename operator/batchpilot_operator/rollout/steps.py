"""A canary's way through its steps: the step clock (pods ready, warm-up, pods lost, the
progress deadline), each analysis consumed (failures, Inconclusive streaks, metrics errors,
the lanes that passed the step), and the advance to the next step or to promotion."""

from __future__ import annotations

from datetime import timedelta

from batchpilot_operator.analysis import AnalysisResult, Outcome, step_evidence
from batchpilot_operator.fairness import fed_alike
from batchpilot_operator.rollout.evidence import last_evidence, record_analysis
from batchpilot_operator.rollout.inputs import TrackObserved
from batchpilot_operator.rollout.schedule import next_analysis_at, split_for
from batchpilot_operator.rollout.state import PlanState, ts
from batchpilot_operator.status import RolloutState


def progress(p: PlanState) -> None:
    """The canary in flight: its step clock, the analysis due, a metrics deadline, the next step."""
    r = p.st.rollout
    assert r is not None
    steps = p.spec.rollout.steps
    r.step_index = min(r.step_index, len(steps) - 1)
    r.step_weight = steps[r.step_index].weight
    split = split_for(p.spec, r.step_weight)
    if r.step_started_at is not None and not p.st.paused:
        obs = p.inputs.observed.canary
        # Pods lost mid-step (a node gone, a crash; not a resize the spec asked for): the
        # step waits for them again, its clock restarted and under progressDeadline.
        if obs is not None and obs.revision == r.revision and obs.ready_replicas < min(obs.replicas, split.canary):
            ready = obs.ready_replicas
            r.step_started_at = None
            r.step_entered_at = p.now
            p.event(
                "Warning",
                "CanaryPodsLost",
                f"canary {r.revision} has {ready}/{split.canary} ready pods at step {r.step_index + 1}: the "
                f"step waits for them (rolled back at progressDeadline, "
                f"{p.spec.rollout.progress_deadline:g}s)",
            )
    if r.step_started_at is None:
        obs = p.inputs.observed.canary
        if obs is None or obs.revision != r.revision or obs.ready_replicas < split.canary:
            check_progress_deadline(p, r, obs, split.canary)
            return
        # The clock starts spec.rollout.warmup after the pods are all ready: the first
        # analysis window of the step opens then, so just-started pods are not judged.
        r.step_started_at = p.now + timedelta(seconds=p.spec.rollout.warmup)
        if p.st.paused:
            r.paused_at = p.now
    if p.st.paused:
        return
    analysis = p.inputs.analysis
    if analysis is not None and analysis.canary_revision == r.revision:
        due = next_analysis_at(p.spec, r)
        if due is not None and p.now >= due:
            consume(p, r, analysis)
    if p.st.rollout is None:
        return
    mu = p.spec.rollout.on_metrics_unavailable
    if (
        r.metrics_error_since is not None
        and mu.action == "Rollback"
        and p.seconds_since(r.metrics_error_since) >= mu.deadline
    ):
        p.rollback(
            reason="MetricsUnavailable",
            evidence=(
                f"metrics unavailable since {ts(r.metrics_error_since)} "
                f"(deadline {mu.deadline:g}s, onMetricsUnavailable=Rollback)"
            ),
        )
        return
    maybe_advance(p, r)


def check_progress_deadline(p: PlanState, r: RolloutState, obs: TrackObserved | None, wanted: int) -> None:
    """Roll back a canary whose pods are still not ready ``progressDeadline`` into the step."""
    deadline = p.spec.rollout.progress_deadline
    if p.st.paused or p.seconds_since(r.step_entered_at) < deadline:
        return
    ready = obs.ready_replicas if obs is not None and obs.revision == r.revision else 0
    why = p.inputs.pod_trouble.get("canary") or "no pod reported a reason"
    p.rollback(
        reason="CanaryNotReady",
        evidence=(
            f"{ready}/{wanted} canary pods ready {deadline:g}s (progressDeadline) after step "
            f"{r.step_index + 1} began at {ts(r.step_entered_at)}: {why}"
        ),
    )


def consume(p: PlanState, r: RolloutState, a: AnalysisResult) -> None:
    r.last_analysis_at = p.now
    outcome = a.outcome
    p.analyses.append(outcome.value)
    record_analysis(p, a)
    if a.tally:
        r.evidence = a.tally
    if outcome is Outcome.ERROR:
        if r.metrics_error_since is None:
            r.metrics_error_since = p.now
        return
    if r.metrics_error_since is not None:
        held = p.seconds_since(r.metrics_error_since)
        p.ledger("MetricsRestored", r.revision, reason=f"analysis {outcome.value}", evidence=f"after {held:g}s")
        p.event("Normal", "MetricsRestored", f"metrics available again after {held:g}s; rollout resumes")
        r.metrics_error_since = None
    # A lane passes the step with an analysis that holds nothing against the canary
    # (Successful, or a breach both tracks show alike); a failure, or a breach the data
    # cannot pin on the canary yet, takes the pass back, so a canary is never advanced on
    # one lucky window while its tally says it breaches. Thin traffic changes nothing.
    for lane in a.lanes:
        if lane.passes_step:
            if lane.lane not in r.passed_lanes:
                r.passed_lanes.append(lane.lane)
        elif lane.holds_step and lane.lane in r.passed_lanes:
            r.passed_lanes.remove(lane.lane)
    if outcome is Outcome.FAILED:
        r.failures += 1
        r.inconclusive_streak = 0
        limit = p.spec.rollout.failure_limit
        evidence = a.evidence(only=[Outcome.FAILED])
        p.event("Warning", "AnalysisFailed", f"canary {r.revision} failed {r.failures}/{limit}: {evidence}")
        if r.failures >= limit:
            p.rollback(reason="AnalysisFailed", evidence=evidence)
    elif outcome is Outcome.INCONCLUSIVE:
        # A breach both tracks share passes the step: the comparison was made, so it is not
        # a window without a verdict. It leaves the streak as it was (neither counts nor
        # resets), so a canary whose other windows hold the step still stalls in the end.
        if not (a.lanes and all(lane.passes_step for lane in a.lanes)):
            r.inconclusive_streak += 1
    else:
        r.inconclusive_streak = 0
    r.underfed = a.underfed


def maybe_advance(p: PlanState, r: RolloutState) -> None:
    steps = p.spec.rollout.steps
    if r.step_started_at is None or r.metrics_error_since is not None:
        return
    if p.seconds_since(r.step_started_at) < steps[r.step_index].pause:
        return
    if any(lane.name not in r.passed_lanes for lane in p.spec.lanes):
        return
    evidence = last_evidence(p)
    if r.step_index + 1 < len(steps):
        left = r.step_weight
        r.step_index += 1
        r.step_weight = steps[r.step_index].weight
        # The sequential evidence starts afresh at each step (checks.sequential_needed), and a
        # tally at another per-pod load is not like for like (fairness.py).
        r.evidence = step_evidence(r.evidence, keep_tally=fed_alike(p.spec, left, r.step_weight))
        r.step_entered_at = p.now
        r.step_started_at = None
        r.passed_lanes = []
        r.inconclusive_streak = 0
        split = split_for(p.spec, r.step_weight)
        msg = (
            f"canary {r.revision} to step {r.step_index + 1}/{len(steps)}: weight {r.step_weight}% "
            f"(effective {split.effective_weight}%)"
        )
        p.ledger("StepAdvanced", r.revision, reason=msg, evidence=evidence)
        p.event("Normal", "StepAdvanced", msg)
    else:
        p.promote(reason="AllStepsPassed", evidence=evidence)
