"""The rollout decision, as a pure function: ``plan(PlanInputs) -> Decision``.

Pure: no kopf, no Kubernetes client, no Prometheus client, no clock (``now`` is an input).
The handler reads the policy, its children and (when :func:`analysis_due`) one analysis,
calls :func:`plan`, and only executes the :class:`Decision`: apply the children it names,
write ``decision.status.to_patch()`` to ``.status``, emit ``decision.events``, bump
``decision.rollout_outcomes``/``decision.analysis_outcomes`` and requeue after
``decision.requeue_after`` seconds.

Phases (``status.phase``, a closed enum; see :class:`~batchpilot_operator.status.Phase`)::

    Pending ──first revision ready──▶ Healthy ──new revision──▶ Progressing ⇄ Paused
                                         ▲                        │  │
                                         └──── promoted ──────────┘  └─ failureLimit / abort /
                                                                       metrics deadline ─▶ RolledBack
    Degraded: no canary and the stable track has no ready pod.

``Stalled`` is a condition, not a phase, with reason ``MetricsUnavailable`` (Error under
``Hold``, or under ``Rollback`` before the deadline), ``InconclusiveLimit`` (maxInconclusive
Inconclusive analyses in a row: the rollout holds, it never rolls back for thin traffic) or
``RolledBack``. A canary whose pods are not all ready ``spec.rollout.progressDeadline``
after its step began (unschedulable, crash loop) is rolled back with reason
``CanaryNotReady``, the pods' own reasons (:attr:`PlanInputs.pod_trouble`) as evidence:
it would otherwise hold its GPUs forever. ``Degraded`` is also a condition (besides the
phase): True while the stable track has fewer ready pods than it should run, with the pods'
reasons when the controller read them (node lost, unschedulable). Conditions follow kstatus: ``Ready``, ``Reconciling``, ``Stalled``, each
with ``observedGeneration``; ``status.observedGeneration`` is the generation planned for.

Decisions taken here (and why):

* Weights -> replicas (:func:`split_replicas`): one Service selects both tracks, so the
  canary's share of traffic is its share of ready pods. ``canary = max(1, round(N*w/100))``,
  ``stable = N - canary`` but at least 1 while ``w < 100``. With few replicas the effective
  share is coarser than asked (N=1: one stable + one canary pod, 50%); status reports both
  ``stepWeight`` (asked) and ``canaryWeight`` (effective). Every pod sees the same per-pod
  arrival rate, so the canary's batching is representative.
* With ``spec.rollout.trafficRouting`` the weight is set on a Gateway API HTTPRoute instead
  (``traffic``): the stable keeps all its replicas, the canary is sized to its weight
  (:func:`split_for`), ``Decision.route`` carries the weights to write, and a canary the route
  still sends traffic to (``Observed.route``) keeps its pods until the route shows none.
* The first revision of a policy rolls out directly as stable (nothing to compare with).
  If the status is empty but a stable Deployment already serves another revision (status
  lost), that revision is adopted as stable and the desired one canaries.
* A step's clock starts when the canary's pods of that step are ready (a GPU model load can
  take minutes; analysing a half-started canary only yields Inconclusive), plus
  ``spec.rollout.warmup`` (``stepStartedAt`` then lies ahead; Argo Rollouts' ``initialDelay``):
  the step's first analysis window opens only once its newest pods have served that long. A step ends when
  its pause has elapsed AND every lane has had at least one Successful analysis in the step
  AND metrics are available. Inconclusive extends the step. Failed analyses are counted for
  the canary's whole life (``rollout.failures``); ``failureLimit`` rolls back.
* Error follows ``onMetricsUnavailable``: ``Hold`` -> Stalled/MetricsUnavailable, counters
  and step untouched, resumes with the next non-Error analysis; ``Rollback`` -> the same
  until ``deadline`` has passed since the first Error of the streak
  (``rollout.metricsErrorSince``), then roll back.
* Promotion: the canary's revision becomes ``stableRevision``, the stable Deployment runs it
  at full replicas. While that stable Deployment is not yet fully ready, the old canary
  Deployment (same revision) keeps its replicas so capacity never dips; it goes away when
  the stable is ready (from ``observed``, so restart-safe).
* A new revision mid-canary supersedes the canary: the canary track switches to the new
  revision at step 0 with fresh counters, the stable track is untouched (history and ledger
  say ``Superseded``). A revert to the stable revision drops the canary (Healthy). A change
  of non-revision fields (replicas, SLO, rollout) continues the rollout with the new
  settings (a step index beyond the new step list is clamped to its last step).
* No rollback loops: a rolled-back (or aborted) revision is in ``failedRevisions`` and is not
  canaried again while it is desired; only a spec change to another revision or the
  ``retry`` command re-tries it.
* Manual commands are annotations (:data:`ANNOTATION_PREFIX`): ``pause`` is a state
  (present and not "false" = paused; pausing holds the step clock, the time paused is added
  to ``stepStartedAt`` on resume; no analysis runs while paused); ``promote``, ``abort`` and
  ``retry`` are one-shot requests whose value (e.g. ``alice@2026-11-30T01:45:00Z``) must
  differ from the last handled one (``status.handledCommands``). ``promote`` and ``abort``
  act on the canary in flight before a revision change of the same reconcile is applied.
  Each leaves an event and a ledger entry carrying the value (who/when).
* The status is a fixed point when nothing is due: messages name absolute times ("step
  pause ends at ...") rather than countdowns, conditions keep ``lastTransitionTime`` unless
  their status flips, and events/ledger entries are emitted on transitions only. The
  handler re-runs on its own status writes, so re-planning must settle (tested).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from batchpilot_operator.analysis import AnalysisResult, LaneVerdict, MetricCheck, Outcome, format_share, format_value
from batchpilot_operator.fairness import fed_alike, gating_analyses
from batchpilot_operator.power import LIMIT, lane_detectable_error_rate, lane_detectable_regression
from batchpilot_operator.spec import PolicySpec
from batchpilot_operator.status import (
    FAILED_REVISIONS_LIMIT,
    HISTORY_LIMIT,
    AnalysisSummary,
    Condition,
    ConditionStatus,
    ConditionType,
    FailedRevision,
    HistoryEntry,
    HistoryOutcome,
    LaneSummary,
    LedgerEntry,
    LedgerKind,
    Phase,
    RolloutState,
    Status,
    TenantSummary,
    trim_ledger,
)
from batchpilot_operator.traffic import RouteInputs, RouteObserved, RouteTarget, desired_route, split_for_routing
from batchpilot_operator.tune.calibration import RevisionCheck

ANNOTATION_PREFIX = "batchpilot.dev/"
PAUSE_ANNOTATION = ANNOTATION_PREFIX + "pause"
PROMOTE_ANNOTATION = ANNOTATION_PREFIX + "promote"
ABORT_ANNOTATION = ANNOTATION_PREFIX + "abort"
RETRY_ANNOTATION = ANNOTATION_PREFIX + "retry"
RESUME_ANNOTATION = ANNOTATION_PREFIX + "resume"
"""Who resumed (``user@time``): ``kubectl batchpilot resume`` sets it as it removes the pause."""

POLL_SECONDS = 5.0
"""Requeue while waiting for pods (first rollout, canary step, promotion finishing)."""
ROUTE_DRAIN_SECONDS = 10.0
"""A routed canary (``trafficRouting``) that is leaving keeps its pods this long after the
HTTPRoute is read sending it nothing: the gateway's data plane applies a route some time after
the apiserver holds it (Contour, then Envoy), and requests it already sent must finish. Argo
Rollouts waits likewise before scaling a canary down (``scaleDownDelaySeconds``)."""
CANARY_READY_DEADLINE = 600.0
"""The default of ``spec.rollout.progressDeadline`` (Argo Rollouts' progressDeadlineSeconds)."""

EventType = Literal["Normal", "Warning"]
CommandName = Literal["promote", "abort", "retry"]


# --------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class TrackObserved:
    """One track's Deployment as observed.

    ``revision``: the revision of its pod template; ``replicas``: its ``spec.replicas``;
    ``ready_replicas``: ready pods running that revision (for a Deployment whose
    ``status.observedGeneration`` is current, ``controller.new_ready_replicas``: ready pods less
    any old pod still there, at most ``updatedReplicas``).
    """

    revision: str | None
    replicas: int = 0
    ready_replicas: int = 0


@dataclass(frozen=True)
class Observed:
    stable: TrackObserved | None = None
    canary: TrackObserved | None = None
    route: RouteObserved | None = None
    """The HTTPRoute's weights as read (spec.rollout.trafficRouting only)."""


@dataclass(frozen=True)
class Commands:
    """Manual commands, read from the policy's annotations (never from spec)."""

    pause: str | None = None
    promote: str | None = None
    abort: str | None = None
    retry: str | None = None
    resume: str | None = None

    @classmethod
    def from_annotations(cls, annotations: Mapping[str, str] | None) -> Commands:
        ann = annotations or {}
        return cls(
            pause=ann.get(PAUSE_ANNOTATION),
            promote=ann.get(PROMOTE_ANNOTATION),
            abort=ann.get(ABORT_ANNOTATION),
            retry=ann.get(RETRY_ANNOTATION),
            resume=ann.get(RESUME_ANNOTATION),
        )

    @property
    def paused(self) -> bool:
        return self.pause is not None and self.pause.strip().lower() not in ("", "false")

    def get(self, name: CommandName) -> str | None:
        value: str | None = getattr(self, name)
        return value or None


@dataclass(frozen=True)
class PlanInputs:
    spec: PolicySpec
    generation: int
    status: Status
    observed: Observed
    now: datetime
    analysis: AnalysisResult | None = None
    commands: Commands = field(default_factory=Commands)
    pod_trouble: Mapping[str, str] = field(default_factory=dict)
    """Per track ("stable", "canary"): why its pods are not ready, in words (e.g.
    ``pod p-canary-x: Unschedulable: 0/2 nodes are available: ...``), as the controller read
    them from the pods when :func:`pods_needed` said so; absent when not read."""


# --------------------------------------------------------------------------- outputs


@dataclass(frozen=True)
class Event:
    type: EventType
    reason: str
    message: str


@dataclass(frozen=True)
class Decision:
    status: Status
    stable_revision: str
    stable_replicas: int
    canary_revision: str | None
    canary_replicas: int
    keep_revisions: tuple[str, ...]
    """Revisions whose ConfigMaps must exist; delete this policy's other revision ConfigMaps."""
    events: tuple[Event, ...] = ()
    rollout_outcomes: tuple[str, ...] = ()
    """One entry per finished rollout: Promoted, RolledBack, Aborted, Superseded."""
    rollback_reasons: tuple[str, ...] = ()
    """One entry per rollback: AnalysisFailed, MetricsUnavailable, CanaryNotReady, Aborted."""
    analysis_outcomes: tuple[str, ...] = ()
    """One entry per analysis consumed: Successful, Failed, Inconclusive, Error."""
    requeue_after: float | None = None
    """Seconds until plan() should run again without an outside change; None: no timer."""
    route: RouteTarget | None = None
    """With spec.rollout.trafficRouting: the HTTPRoute weights to write (before any canary
    scale-down of this decision; see ``traffic``)."""


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
    return ReplicaSplit(stable=stable, canary=canary, effective_weight=_percent(canary, stable + canary))


def split_for(spec: PolicySpec, weight: int) -> ReplicaSplit:
    """Replicas per track for a step weight: the pod ratio, or under trafficRouting the
    weight set on the route exactly (``traffic.split_for_routing``)."""
    if spec.rollout.traffic_routing is None:
        return split_replicas(spec.replicas, weight)
    stable, canary = split_for_routing(spec.replicas, weight)
    return ReplicaSplit(stable=stable, canary=canary, effective_weight=weight)


def _percent(part: int, whole: int) -> int:
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


# --------------------------------------------------------------------------- plan


def plan(inputs: PlanInputs) -> Decision:
    """Decide the next state of one BatchingPolicy. Deterministic in its inputs."""
    return _Planner(inputs).run()


class _Planner:
    def __init__(self, inputs: PlanInputs) -> None:
        self.inputs = inputs
        self.spec = inputs.spec
        self.now = inputs.now
        if self.now.tzinfo is None:
            raise ValueError("plan() needs a timezone-aware now")
        self.st = inputs.status.model_copy(deep=True)
        self.desired = self.spec.revision()
        self.events: list[Event] = []
        self.rollouts: list[str] = []
        self.rollback_reasons: list[str] = []
        self.analyses: list[str] = []

    # ------------------------------------------------------------------ helpers

    def event(self, type_: EventType, reason: str, message: str) -> None:
        self.events.append(Event(type=type_, reason=reason, message=message))

    def ledger(self, kind: LedgerKind, revision: str, reason: str | None = None, evidence: str | None = None) -> None:
        self._append_ledger(LedgerEntry(time=self.now, kind=kind, revision=revision, reason=reason, evidence=evidence))

    def _append_ledger(self, entry: LedgerEntry) -> None:
        self.st.ledger.append(entry)
        self.st.ledger = trim_ledger(self.st.ledger)

    def history(self, revision: str, outcome: HistoryOutcome, reason: str, evidence: str = "") -> None:
        self.st.history.append(
            HistoryEntry(revision=revision, outcome=outcome, time=self.now, reason=reason, evidence=evidence)
        )
        del self.st.history[:-HISTORY_LIMIT]

    def new_command(self, name: CommandName) -> str | None:
        value = self.inputs.commands.get(name)
        if value is None or self.st.handled_commands.get(name) == value:
            return None
        self.st.handled_commands[name] = value
        return value

    def seconds_since(self, t: datetime) -> float:
        return (self.now - t).total_seconds()

    # ------------------------------------------------------------------ main

    def run(self) -> Decision:
        st = self.st
        st.observed_generation = self.inputs.generation
        st.desired_revision = self.desired
        self.handle_pause()
        if st.stable_revision is None:
            self.adopt_or_initialise()
        if st.stable_revision is None:
            for name in ("promote", "abort", "retry"):
                self.ignore_command(name, "nothing is stable yet")
        else:
            self.handle_abort()
            self.handle_promote()
            self.handle_retry()
            self.reconcile_revision()
            if st.rollout is not None:
                self.progress(st.rollout)
        return self.finish()

    # ------------------------------------------------------------------ commands

    def ignore_command(self, name: CommandName, why: str) -> None:
        value = self.new_command(name)
        if value is not None:
            self.ledger("Command", self.desired, reason=f"{name} ignored: {why}", evidence=value)
            self.event("Normal", "CommandIgnored", f"{name} ({value}) ignored: {why}")

    def handle_pause(self) -> None:
        st = self.st
        want = self.inputs.commands.paused
        revision = st.rollout.revision if st.rollout else self.desired
        if want and not st.paused:
            value = self.inputs.commands.pause or "true"
            st.paused = True
            st.handled_commands["pause"] = value
            if st.rollout is not None and st.rollout.step_started_at is not None:
                st.rollout.paused_at = self.now
            self.ledger("Paused", revision, reason="pause", evidence=value)
            self.event("Normal", "Paused", f"rollout paused ({value})")
        elif not want and st.paused:
            st.paused = False
            r = st.rollout
            held = 0.0
            if r is not None and r.paused_at is not None:
                held = self.seconds_since(r.paused_at)
                if r.step_started_at is not None:
                    r.step_started_at += timedelta(seconds=held)
                r.paused_at = None
            by = resumed_by(self.inputs.commands.resume, st.handled_commands.get("pause", ""), r)
            st.handled_commands["pause"] = ""
            who = f"by {by}" if by else "pause annotation removed"
            self.ledger("Resumed", revision, reason="resume", evidence=f"{who}; step clock held {held:g}s")
            self.event("Normal", "Resumed", f"rollout resumed ({who}) after {held:g}s paused")

    def handle_abort(self) -> None:
        if self.st.rollout is None:
            self.ignore_command("abort", "no canary in flight")
            return
        value = self.new_command("abort")
        if value is None:
            return
        revision = self.st.rollout.revision
        self.ledger("Command", revision, reason="abort", evidence=value)
        self.rollback(reason="Aborted", evidence=f"aborted by {value}", aborted=True)

    def handle_promote(self) -> None:
        if self.st.rollout is None:
            self.ignore_command("promote", "no canary in flight (use retry for a rolled-back revision)")
            return
        value = self.new_command("promote")
        if value is None:
            return
        self.ledger("Command", self.st.rollout.revision, reason="promote", evidence=value)
        self.promote(reason="PromotedManually", evidence=f"promoted by {value}, skipping remaining steps")

    def handle_retry(self) -> None:
        if not self.st.is_failed(self.desired):
            self.ignore_command("retry", f"revision {self.desired} has not failed")
            return
        value = self.new_command("retry")
        if value is None:
            return
        self.st.failed_revisions = [f for f in self.st.failed_revisions if f.revision != self.desired]
        self.ledger("Command", self.desired, reason="retry", evidence=value)
        self.event("Normal", "Retry", f"revision {self.desired} cleared for another canary ({value})")

    # ------------------------------------------------------------------ revisions

    def adopt_or_initialise(self) -> None:
        st = self.st
        obs = self.inputs.observed.stable
        if obs is None or obs.revision is None:
            return
        if st.phase is None and obs.revision != self.desired and obs.ready_replicas > 0:
            st.stable_revision = obs.revision
            self.ledger("Adopted", obs.revision, reason="status empty; stable Deployment already serves it")
            self.event("Normal", "Adopted", f"adopted running revision {obs.revision} as stable")
        elif obs.revision == self.desired and obs.ready_replicas >= self.spec.replicas:
            st.stable_revision = self.desired
            self.history(self.desired, "Promoted", "initial revision", _ready(obs))
            self.ledger("Initial", self.desired, reason="first revision is stable", evidence=_ready(obs))
            self.event("Normal", "Initialized", f"revision {self.desired} is stable ({_ready(obs)} ready)")

    def reconcile_revision(self) -> None:
        st = self.st
        r = st.rollout
        if self.desired == st.stable_revision:
            if r is not None:
                self.supersede(r, f"spec reverted to the stable revision {self.desired}")
        elif st.is_failed(self.desired):
            if r is not None:
                self.supersede(r, f"desired revision {self.desired} failed before and is not retried")
        else:
            if r is not None and r.revision != self.desired:
                self.supersede(r, f"superseded by revision {self.desired}")
            if st.rollout is None:
                self.start_canary()

    def supersede(self, r: RolloutState, reason: str) -> None:
        self.history(r.revision, "Superseded", reason, _progress(r, self.spec))
        self.ledger("Superseded", r.revision, reason=reason, evidence=_progress(r, self.spec))
        self.event("Normal", "Superseded", f"canary {r.revision} dropped: {reason}")
        self.rollouts.append("Superseded")
        self.st.rollout = None

    def start_canary(self) -> None:
        step = self.spec.rollout.steps[0]
        self.st.rollout = RolloutState(
            revision=self.desired,
            step_index=0,
            step_weight=step.weight,
            started_at=self.now,
            step_entered_at=self.now,
        )
        split = split_for(self.spec, step.weight)
        msg = (
            f"canary {self.desired} started at step 1/{len(self.spec.rollout.steps)}: weight {step.weight}% "
            f"(effective {split.effective_weight}%: {split.canary} canary + {split.stable} stable)"
        )
        self.ledger("CanaryStarted", self.desired, reason=f"stable is {self.st.stable_revision}", evidence=msg)
        self.event("Normal", "CanaryStarted", msg)

    # ------------------------------------------------------------------ progress

    def progress(self, r: RolloutState) -> None:
        steps = self.spec.rollout.steps
        r.step_index = min(r.step_index, len(steps) - 1)
        r.step_weight = steps[r.step_index].weight
        split = split_for(self.spec, r.step_weight)
        if r.step_started_at is not None and not self.st.paused:
            obs = self.inputs.observed.canary
            # Pods lost mid-step (a node gone, a crash; not a resize the spec asked for): the
            # step waits for them again, its clock restarted and under progressDeadline.
            if obs is not None and obs.revision == r.revision and obs.ready_replicas < min(obs.replicas, split.canary):
                ready = obs.ready_replicas
                r.step_started_at = None
                r.step_entered_at = self.now
                self.event(
                    "Warning",
                    "CanaryPodsLost",
                    f"canary {r.revision} has {ready}/{split.canary} ready pods at step {r.step_index + 1}: the "
                    f"step waits for them (rolled back at progressDeadline, "
                    f"{self.spec.rollout.progress_deadline:g}s)",
                )
        if r.step_started_at is None:
            obs = self.inputs.observed.canary
            if obs is None or obs.revision != r.revision or obs.ready_replicas < split.canary:
                self.check_progress_deadline(r, obs, split.canary)
                return
            # The clock starts spec.rollout.warmup after the pods are all ready: the first
            # analysis window of the step opens then, so just-started pods are not judged.
            r.step_started_at = self.now + timedelta(seconds=self.spec.rollout.warmup)
            if self.st.paused:
                r.paused_at = self.now
        if self.st.paused:
            return
        analysis = self.inputs.analysis
        if analysis is not None and analysis.canary_revision == r.revision:
            due = next_analysis_at(self.spec, r)
            if due is not None and self.now >= due:
                self.consume(r, analysis)
        if self.st.rollout is None:
            return
        mu = self.spec.rollout.on_metrics_unavailable
        if (
            r.metrics_error_since is not None
            and mu.action == "Rollback"
            and self.seconds_since(r.metrics_error_since) >= mu.deadline
        ):
            self.rollback(
                reason="MetricsUnavailable",
                evidence=(
                    f"metrics unavailable since {_ts(r.metrics_error_since)} "
                    f"(deadline {mu.deadline:g}s, onMetricsUnavailable=Rollback)"
                ),
            )
            return
        self.maybe_advance(r)

    def check_progress_deadline(self, r: RolloutState, obs: TrackObserved | None, wanted: int) -> None:
        """Roll back a canary whose pods are still not ready ``progressDeadline`` into the step."""
        deadline = self.spec.rollout.progress_deadline
        if self.st.paused or self.seconds_since(r.step_entered_at) < deadline:
            return
        ready = obs.ready_replicas if obs is not None and obs.revision == r.revision else 0
        why = self.inputs.pod_trouble.get("canary") or "no pod reported a reason"
        self.rollback(
            reason="CanaryNotReady",
            evidence=(
                f"{ready}/{wanted} canary pods ready {deadline:g}s (progressDeadline) after step "
                f"{r.step_index + 1} began at {_ts(r.step_entered_at)}: {why}"
            ),
        )

    def consume(self, r: RolloutState, a: AnalysisResult) -> None:
        r.last_analysis_at = self.now
        outcome = a.outcome
        self.analyses.append(outcome.value)
        self.record_analysis(a)
        if a.tally:
            r.evidence = a.tally
        if outcome is Outcome.ERROR:
            if r.metrics_error_since is None:
                r.metrics_error_since = self.now
            return
        if r.metrics_error_since is not None:
            held = self.seconds_since(r.metrics_error_since)
            self.ledger("MetricsRestored", r.revision, reason=f"analysis {outcome.value}", evidence=f"after {held:g}s")
            self.event("Normal", "MetricsRestored", f"metrics available again after {held:g}s; rollout resumes")
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
            limit = self.spec.rollout.failure_limit
            evidence = a.evidence(only=[Outcome.FAILED])
            self.event("Warning", "AnalysisFailed", f"canary {r.revision} failed {r.failures}/{limit}: {evidence}")
            if r.failures >= limit:
                self.rollback(reason="AnalysisFailed", evidence=evidence)
        elif outcome is Outcome.INCONCLUSIVE:
            r.inconclusive_streak += 1
        else:
            r.inconclusive_streak = 0
        r.underfed = a.underfed

    def record_analysis(self, a: AnalysisResult) -> None:
        lanes: list[LaneSummary] = []
        for lane in a.lanes:
            # The lane's total, every objective; of a tenant slice only what holds against the
            # canary (Failed, Error, or a breach not yet pinned), so the ledger stays readable.
            judged: list[tuple[LaneVerdict, MetricCheck]] = [(lane, c) for c in lane.canary]
            judged += [
                (sl, c)
                for sl in lane.slices
                for c in sl.canary
                if c.outcome in (Outcome.FAILED, Outcome.ERROR) or (c.outcome is Outcome.INCONCLUSIVE and c.note)
            ]
            for owner, c in judged:
                s = owner.check(c.metric, "stable")
                self._append_ledger(
                    LedgerEntry(
                        time=self.now,
                        kind="Analysis",
                        revision=c.revision,
                        track=c.track,
                        lane=c.lane,
                        metric=c.metric,
                        query=c.query,
                        value=_json_float(c.value),
                        samples=c.samples,
                        threshold=c.threshold,
                        outcome=c.outcome.value,
                        evidence=c.describe(),
                        stable_value=_json_float(s.value) if s else None,
                        stable_samples=s.samples if s else None,
                        bad_fraction=c.bad_fraction,
                        stable_bad_fraction=s.bad_fraction if s else None,
                        confidence_worse=c.confidence_worse,
                        confidence_over_budget=c.confidence_over_budget,
                        tenant=c.tenant,
                        **(_model_entry(a, c.lane, c.metric) if owner is lane else {}),
                    )
                )
            lat = lane.check("p99Latency")
            qa = lane.check("queueAge")
            err = lane.check("errorRate")
            slat = lane.check("p99Latency", "stable")
            sqa = lane.check("queueAge", "stable")
            serr = lane.check("errorRate", "stable")
            rej, srej = lane.check("clientErrors"), lane.check("clientErrors", "stable")
            slo = self.spec.lane_slo(lane.lane)
            lanes.append(
                LaneSummary(
                    lane=lane.lane,
                    outcome=lane.outcome.value,
                    p99_latency=_val(lat),
                    p99_latency_slo=slo.p99_latency,
                    queue_age=_val(qa),
                    max_queue_age=slo.max_queue_age,
                    error_rate=_val(err),
                    max_error_rate=slo.max_error_rate,
                    samples=lat.samples if lat else None,
                    queue_samples=qa.samples if qa else None,
                    requests=err.samples if err else None,
                    stable_p99_latency=_val(slat),
                    stable_queue_age=_val(sqa),
                    stable_error_rate=_val(serr),
                    stable_samples=slat.samples if slat else None,
                    rejected=_val(rej),
                    stable_rejected=_val(srej),
                    tenants=[_tenant_summary(sl) for sl in lane.slices] or None,
                    **_detectable(lane, self.spec.rollout.confidence, gating_analyses(self.spec)),
                    **_model_summary(a, lane.lane),
                )
            )
        self.st.last_analysis = AnalysisSummary(
            time=self.now, revision=a.canary_revision, outcome=a.outcome.value, window=a.window, lanes=lanes
        )

    def maybe_advance(self, r: RolloutState) -> None:
        steps = self.spec.rollout.steps
        if r.step_started_at is None or r.metrics_error_since is not None:
            return
        if self.seconds_since(r.step_started_at) < steps[r.step_index].pause:
            return
        if any(lane.name not in r.passed_lanes for lane in self.spec.lanes):
            return
        evidence = self.last_evidence()
        if r.step_index + 1 < len(steps):
            left = r.step_weight
            r.step_index += 1
            r.step_weight = steps[r.step_index].weight
            if not fed_alike(self.spec, left, r.step_weight):
                r.evidence = {}  # a tally at another per-pod load is not like for like (fairness.py)
            r.step_entered_at = self.now
            r.step_started_at = None
            r.passed_lanes = []
            r.inconclusive_streak = 0
            split = split_for(self.spec, r.step_weight)
            msg = (
                f"canary {r.revision} to step {r.step_index + 1}/{len(steps)}: weight {r.step_weight}% "
                f"(effective {split.effective_weight}%)"
            )
            self.ledger("StepAdvanced", r.revision, reason=msg, evidence=evidence)
            self.event("Normal", "StepAdvanced", msg)
        else:
            self.promote(reason="AllStepsPassed", evidence=evidence)

    def last_evidence(self) -> str:
        la = self.st.last_analysis
        if la is None:
            return ""
        parts = [
            f"{lane.lane}: p99 {_fmt(lane.p99_latency)}/{lane.p99_latency_slo:g}s, "
            f"queue age {_fmt(lane.queue_age)}/{lane.max_queue_age:g}s, "
            f"errors {_pct(lane.error_rate)}/{_pct(lane.max_error_rate)}, {_count(lane.samples)} samples"
            for lane in la.lanes
        ]
        return f"last analysis {la.outcome}: " + "; ".join(parts)

    # ------------------------------------------------------------------ outcomes

    def promote(self, reason: str, evidence: str) -> None:
        st = self.st
        r = st.rollout
        assert r is not None
        old = st.stable_revision
        st.stable_revision = r.revision
        st.rollout = None
        self.history(r.revision, "Promoted", reason, evidence)
        self.ledger("Promoted", r.revision, reason=f"{reason}; previous stable {old}", evidence=evidence)
        self.event("Normal", "Promoted", f"revision {r.revision} promoted to stable ({reason}): {evidence}")
        self.rollouts.append("Promoted")

    def rollback(self, reason: str, evidence: str, aborted: bool = False) -> None:
        st = self.st
        r = st.rollout
        assert r is not None
        outcome: HistoryOutcome = "Aborted" if aborted else "RolledBack"
        st.failed_revisions = [f for f in st.failed_revisions if f.revision != r.revision]
        st.failed_revisions.append(FailedRevision(revision=r.revision, time=self.now, reason=reason, evidence=evidence))
        del st.failed_revisions[:-FAILED_REVISIONS_LIMIT]
        st.rollout = None
        self.history(r.revision, outcome, reason, evidence)
        self.ledger(outcome, r.revision, reason=reason, evidence=evidence)
        self.event(
            "Warning",
            outcome,
            f"canary {r.revision} rolled back ({reason}): {evidence}; stable {st.stable_revision} serves",
        )
        self.rollouts.append(outcome)
        self.rollback_reasons.append(reason)

    # ------------------------------------------------------------------ finish

    def stall(self) -> tuple[str, str] | None:
        st = self.st
        r = st.rollout
        if r is None:
            if st.stable_revision is not None and st.is_failed(self.desired):
                return (
                    "RolledBack",
                    f"desired revision {self.desired} was rolled back; waiting for a new revision",
                )
            return None
        if st.paused:
            return None
        if r.metrics_error_since is not None:
            mu = self.spec.rollout.on_metrics_unavailable
            since = _ts(r.metrics_error_since)
            if mu.action == "Rollback":
                at = _ts(r.metrics_error_since + timedelta(seconds=mu.deadline))
                return (
                    "MetricsUnavailable",
                    f"metrics unavailable since {since}; rolling back at {at} unless back",
                )
            return "MetricsUnavailable", f"metrics unavailable since {since}; holding the rollout (Hold)"
        if r.inconclusive_streak >= self.spec.rollout.max_inconclusive:
            if r.underfed is not None:
                return (
                    "CanaryUnderfed",
                    f"{r.inconclusive_streak} Inconclusive analyses in a row; {r.underfed}; holding, not rolling back",
                )
            return (
                "InconclusiveLimit",
                f"{r.inconclusive_streak} Inconclusive analyses in a row (fewer than "
                f"{self.spec.rollout.min_samples} samples); holding, not rolling back",
            )
        return None

    def finish(self) -> Decision:
        st = self.st
        spec = self.spec
        observed = self.inputs.observed
        r = st.rollout
        stable_rev = st.stable_revision or self.desired
        os = observed.stable
        stable_ready = os.ready_replicas if os is not None and os.revision == stable_rev else 0
        finishing = False
        draining = False
        routed = spec.rollout.traffic_routing is not None
        # the canary still takes traffic on the route: by weight, or by our header rule
        route_canary = (
            max(observed.route.canary_weight, 1 if observed.route.header_rule else 0)
            if observed.route is not None
            else 0
        )
        canary_rev: str | None = None
        if r is not None:
            split = split_for(spec, r.step_weight)
            stable_replicas, canary_replicas, canary_rev = split.stable, split.canary, r.revision
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
            elif routed and oc is not None and oc.replicas > 0 and (route_canary > 0 or not self.route_drained()):
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
        st.canary_weight = _percent(canary_replicas, stable_replicas + canary_replicas)
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
                )
            )
            st.canary_weight = route.canary_weight

        stall = self.stall()
        phase, message = self.phase_and_message(stable_ready, finishing, stall)
        st.phase = phase
        st.message = message
        self.set_conditions(phase, message, stable_ready, stall)
        self.set_degraded(stable_rev, stable_replicas, finishing)

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
            events=tuple(self.events),
            rollout_outcomes=tuple(self.rollouts),
            rollback_reasons=tuple(self.rollback_reasons),
            analysis_outcomes=tuple(self.analyses),
            requeue_after=self.requeue(phase, finishing or draining, stable_ready),
            route=route,
        )

    def phase_and_message(self, stable_ready: int, finishing: bool, stall: tuple[str, str] | None) -> tuple[Phase, str]:
        st = self.st
        spec = self.spec
        r = st.rollout
        n = spec.replicas
        if st.stable_revision is None:
            return Phase.PENDING, f"rolling out the first revision {self.desired}: {stable_ready}/{n} ready"
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
                oc = self.inputs.observed.canary
                ready = oc.ready_replicas if oc is not None and oc.revision == r.revision else 0
                detail = f"waiting for canary pods ({ready}/{st.canary_replicas} ready)"
            else:
                pending = [lane.name for lane in spec.lanes if lane.name not in r.passed_lanes]
                ends = r.step_started_at + timedelta(seconds=spec.rollout.steps[r.step_index].pause)
                waits = []
                if r.step_started_at > self.now:
                    waits.append(f"canary pods ready, warming up until {_ts(r.step_started_at)} (spec.rollout.warmup)")
                if ends > self.now:
                    # an absolute time: the message (and so .status) does not change on every call
                    waits.append(f"step pause ends at {_ts(ends)}")
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
            why = self.inputs.pod_trouble.get("stable")
            return Phase.PROGRESSING, f"{message}; waiting on {why}" if why else message
        if st.is_failed(self.desired) and self.desired != st.stable_revision:
            failed = next(f for f in st.failed_revisions if f.revision == self.desired)
            return Phase.ROLLED_BACK, (
                f"revision {self.desired} rolled back ({failed.reason}): {failed.evidence}; stable "
                f"{st.stable_revision} serves; not retried until the spec changes or a retry command"
            )
        if stable_ready == 0:
            return Phase.DEGRADED, f"stable revision {st.stable_revision} has no ready pods (0/{n})"
        return Phase.HEALTHY, f"revision {st.stable_revision} is stable ({stable_ready}/{n} ready)"

    def set_conditions(self, phase: Phase, message: str, stable_ready: int, stall: tuple[str, str] | None) -> None:
        ready = phase is Phase.HEALTHY and stable_ready >= self.spec.replicas
        reconciling = phase in (Phase.PENDING, Phase.PROGRESSING, Phase.PAUSED) or (
            phase is Phase.HEALTHY and not ready
        )
        if ready:
            self.set_condition("Ready", "True", "Healthy", message)
        else:
            reason = "StableScaling" if phase is Phase.HEALTHY else phase.value
            self.set_condition("Ready", "False", reason, message)
        self.set_condition("Reconciling", "True" if reconciling else "False", phase.value, message)
        previous = self.inputs.status.condition("Stalled")
        if stall is None:
            self.set_condition("Stalled", "False", "NotStalled", "")
            return
        reason, text = stall
        self.set_condition("Stalled", "True", reason, text)
        if previous is None or previous.status != "True" or previous.reason != reason:
            revision = self.st.rollout.revision if self.st.rollout else self.desired
            if reason != "RolledBack":  # the rollback itself already left an event and a ledger entry
                self.ledger("Stalled", revision, reason=reason, evidence=text)
                self.event("Warning", "Stalled", f"{reason}: {text}")

    def set_degraded(self, stable_rev: str, stable_replicas: int, finishing: bool) -> None:
        """The Degraded condition: the stable track runs fewer ready pods than it should.

        Judged on the stable Deployment as observed, once it runs the stable revision at the
        replicas it should (a scale-up or a promotion still rolling is not a loss). The
        pods' reasons (node lost, unschedulable) come from :attr:`PlanInputs.pod_trouble`;
        a Warning event marks the transition when a reason is known.
        """
        st = self.st
        obs = self.inputs.observed.stable
        short = (
            st.stable_revision is not None
            and not finishing
            and obs is not None
            and obs.revision == stable_rev
            and obs.replicas == stable_replicas
            and obs.ready_replicas < stable_replicas
        )
        if not short:
            if st.condition("Degraded") is not None:
                self.set_condition("Degraded", "False", "StableAtCapacity", "")
            return
        assert obs is not None
        why = self.inputs.pod_trouble.get("stable")
        reason = "StableUnavailable" if obs.ready_replicas == 0 else "StableUnderCapacity"
        message = f"stable revision {stable_rev} has {obs.ready_replicas}/{stable_replicas} ready pods"
        if why:
            message += f": {why}"
        previous = self.inputs.status.condition("Degraded")
        self.set_condition("Degraded", "True", reason, message)
        if why and (previous is None or previous.status != "True" or previous.reason != reason):
            self.event("Warning", "Degraded", message)

    def set_condition(self, type_: ConditionType, status: ConditionStatus, reason: str, message: str) -> None:
        generation = self.inputs.generation
        for i, cond in enumerate(self.st.conditions):
            if cond.type == type_:
                transition = cond.last_transition_time if cond.status == status else self.now
                self.st.conditions[i] = Condition(
                    type=type_,
                    status=status,
                    reason=reason,
                    message=message,
                    last_transition_time=transition,
                    observed_generation=generation,
                )
                return
        self.st.conditions.append(
            Condition(
                type=type_,
                status=status,
                reason=reason,
                message=message,
                last_transition_time=self.now,
                observed_generation=generation,
            )
        )

    def route_drained(self) -> bool:
        """Whether the route has sent the leaving canary nothing for ROUTE_DRAIN_SECONDS (the
        clock starts at the first reconcile that reads it so)."""
        if self.st.canary_drained_at is None:
            self.st.canary_drained_at = self.now
        return self.seconds_since(self.st.canary_drained_at) >= ROUTE_DRAIN_SECONDS

    def requeue(self, phase: Phase, finishing: bool, stable_ready: int) -> float | None:
        r = self.st.rollout
        if phase in (Phase.PENDING, Phase.DEGRADED) or finishing:
            return POLL_SECONDS
        if phase is Phase.HEALTHY and stable_ready < self.spec.replicas:
            return POLL_SECONDS
        if r is None or self.st.paused:
            return None
        if r.step_started_at is None:
            return POLL_SECONDS
        candidates: list[datetime] = []
        due = next_analysis_at(self.spec, r)
        if due is not None:
            candidates.append(due)
        candidates.append(r.step_started_at + timedelta(seconds=self.spec.rollout.steps[r.step_index].pause))
        mu = self.spec.rollout.on_metrics_unavailable
        if r.metrics_error_since is not None and mu.action == "Rollback":
            candidates.append(r.metrics_error_since + timedelta(seconds=mu.deadline))
        future = [c for c in candidates if c > self.now]
        if not future:
            return POLL_SECONDS
        return max(1.0, (min(future) - self.now).total_seconds())


# --------------------------------------------------------------------------- small helpers


def _ready(obs: TrackObserved) -> str:
    return f"{obs.ready_replicas}/{obs.replicas}"


def _ts(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _json_float(value: float | None) -> float | None:
    """JSON (and so .status) has no Inf/NaN: those are stored as absent."""
    return value if value is not None and math.isfinite(value) else None


def command_time(value: str | None) -> datetime | None:
    """The time in a ``user@<RFC 3339>`` command value (None when there is none)."""
    if not value or "@" not in value:
        return None
    text = value.rsplit("@", 1)[1].strip()
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return when if when.tzinfo is not None else None


def resumed_by(resume: str | None, pause: str, rollout: RolloutState | None) -> str | None:
    """Who resumed: the resume annotation, when it is not older than the pause it ends.

    The annotation stays on the object after it was handled; a later pause removed by hand
    (``kubectl annotate ... batchpilot.dev/pause-``) must not be credited to whoever resumed
    the previous one. The pause's time comes from its value, else from when the step clock
    stopped; a resume value without a time is not trusted.
    """
    resumed_at = command_time(resume)
    if resume is None or resumed_at is None:
        return None
    paused_at = command_time(pause) or (rollout.paused_at if rollout is not None else None)
    if paused_at is not None and resumed_at < paused_at:
        return None
    return resume


def _val(check: MetricCheck | None) -> float | None:
    return None if check is None else _json_float(check.value)


def _predicted(m: RevisionCheck | None, metric: str) -> tuple[float | None, float | None]:
    """(the model's value as shown, its error against the pods' own record) for one metric."""
    c = m.check if m is not None else None
    if c is None:
        return None, None
    if metric == "p99Latency":
        return _json_float(c.predicted_p99 * c.correction), _json_float(c.error)
    error = c.predicted_wait / c.observed_wait - 1 if c.observed_wait > 0 else math.nan
    return _json_float(c.predicted_wait), _json_float(error)


def _model_entry(a: AnalysisResult, lane: str, metric: str) -> dict[str, Any]:
    """The ledger fields of the model's check beside a lane's p99 or queue-age entry (``modelwatch``)."""
    got = a.model_checks(lane)
    if not got or metric not in ("p99Latency", "queueAge"):
        return {}
    value, error = _predicted(got.get("canary"), metric)
    stable_value, stable_error = _predicted(got.get("stable"), metric)
    return {
        "predicted_value": value,
        "model_error": error,
        "stable_predicted_value": stable_value,
        "stable_model_error": stable_error,
    }


def _model_summary(a: AnalysisResult, lane: str) -> dict[str, Any]:
    """The LaneSummary fields of the model's check of each track (``modelwatch``)."""
    got = a.model_checks(lane)
    if not got:
        return {}
    order = [got[t] for t in ("canary", "stable") if t in got]
    return {
        "predicted_p99_latency": _predicted(got.get("canary"), "p99Latency")[0],
        "stable_predicted_p99_latency": _predicted(got.get("stable"), "p99Latency")[0],
        "model": "model: " + "; ".join(m.describe() for m in order),
    }


def _detectable(lane: LaneVerdict, confidence: float, analyses: int) -> dict[str, object]:
    """The LaneSummary fields saying what the gate can see at this window's traffic (``power``)
    over the ``analyses`` windows the rollout's promoting tally can hold: the smallest p99
    regression and the smallest error rate."""
    out: dict[str, object] = {}
    said: list[str] = []
    lat, slat = lane.check("p99Latency"), lane.check("p99Latency", "stable")
    found = lane_detectable_regression(lat, slat, confidence, analyses) if lat is not None else None
    if found is not None and math.isinf(found):
        said.append(f"no p99 regression up to {LIMIT + 1:g}x (the stable is far under its SLO or the traffic is thin)")
    elif found is not None:
        out["detectable_p99_regression"] = found
        said.append(f"a p99 regression of {found:.0%} or more")
    err, serr = lane.check("errorRate"), lane.check("errorRate", "stable")
    # Errors a queue sheds come in the same bursts as slow requests: the larger clustering counts.
    bursts = max((c.burstiness for c in (lat, err) if c is not None and c.burstiness is not None), default=None)
    rate = lane_detectable_error_rate(err, serr, confidence, analyses, burstiness=bursts) if err is not None else None
    if rate is not None and err is not None:
        budget = f"budget {format_share(err.budget)}"
        if math.isinf(rate):
            said.append(f"no error rate at all ({budget}: the traffic is too thin or too bursty)")
        else:
            out["detectable_error_rate"] = rate
            said.append(f"an error rate of {format_share(rate)} or more ({budget})")
    if said:
        out["detects"] = " and ".join(said) + " at the current traffic"
    return out


def _tenant_summary(sl: LaneVerdict) -> TenantSummary:
    lat, slat = sl.check("p99Latency"), sl.check("p99Latency", "stable")
    rej, srej = sl.check("clientErrors"), sl.check("clientErrors", "stable")
    held = [
        c.describe()
        for c in sl.canary
        if c.outcome in (Outcome.FAILED, Outcome.ERROR) or (c.outcome is Outcome.INCONCLUSIVE and c.note)
    ]
    return TenantSummary(
        tenant=sl.tenant or "",
        outcome=sl.outcome.value,
        thin=sl.thin,
        p99_latency=_val(lat),
        stable_p99_latency=_val(slat),
        samples=lat.samples if lat else None,
        requests=rej.samples if rej else None,
        rejected=_val(rej),
        stable_rejected=_val(srej),
        evidence="; ".join(held) or None,
    )


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g}s"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else format_value("errorRate", value)


def _count(value: float | None) -> str:
    return "0" if value is None else f"{value:.0f}"


def _progress(r: RolloutState, spec: PolicySpec) -> str:
    return (
        f"at step {min(r.step_index, len(spec.rollout.steps) - 1) + 1}/{len(spec.rollout.steps)}, "
        f"failures {r.failures}, passed lanes {r.passed_lanes or 'none'}"
    )
