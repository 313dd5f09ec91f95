"""The rollout decision, as a pure function: ``plan(PlanInputs) -> Decision``.

The package's rooms, bottom up: :mod:`.inputs` (what the plan reads and decides),
:mod:`.schedule` (replicas per step weight, when an analysis is due), :mod:`.state` (the plan in
progress, promotion and rollback), :mod:`.evidence` (what an analysis leaves in the status),
:mod:`.commands`, :mod:`.revisions` and :mod:`.steps` (the stages), :mod:`.finish` (replicas,
route, phase, conditions, requeue) and :mod:`.planner` (the table of stages, :func:`plan`).

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
Inconclusive analyses in a row, not counting one that passes the step on a breach both tracks
share: the rollout holds, it never rolls back for thin traffic) or
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

from batchpilot_operator.rollout.commands import (
    command_time,
    resumed_by,
)
from batchpilot_operator.rollout.inputs import (
    ABORT_ANNOTATION,
    ANNOTATION_PREFIX,
    CANARY_READY_DEADLINE,
    PAUSE_ANNOTATION,
    POLL_SECONDS,
    PROMOTE_ANNOTATION,
    RESUME_ANNOTATION,
    RETRY_ANNOTATION,
    ROUTE_DRAIN_SECONDS,
    CommandName,
    Commands,
    Decision,
    Event,
    EventType,
    Observed,
    PlanInputs,
    TrackObserved,
)
from batchpilot_operator.rollout.planner import (
    STAGES,
    Stage,
    plan,
)
from batchpilot_operator.rollout.schedule import (
    ReplicaSplit,
    analysis_due,
    analysis_target,
    canary_deadline_passed,
    next_analysis_at,
    pods_needed,
    split_for,
    split_replicas,
)

__all__ = [
    "ABORT_ANNOTATION",
    "ANNOTATION_PREFIX",
    "CANARY_READY_DEADLINE",
    "PAUSE_ANNOTATION",
    "POLL_SECONDS",
    "PROMOTE_ANNOTATION",
    "RESUME_ANNOTATION",
    "RETRY_ANNOTATION",
    "ROUTE_DRAIN_SECONDS",
    "STAGES",
    "CommandName",
    "Commands",
    "Decision",
    "Event",
    "EventType",
    "Observed",
    "PlanInputs",
    "ReplicaSplit",
    "Stage",
    "TrackObserved",
    "analysis_due",
    "analysis_target",
    "canary_deadline_passed",
    "command_time",
    "next_analysis_at",
    "plan",
    "pods_needed",
    "resumed_by",
    "split_for",
    "split_replicas",
]
