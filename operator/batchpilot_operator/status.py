"""The BatchingPolicy ``.status`` as pydantic models (camelCase on the wire).

Pure: imports no kopf and no Kubernetes client. The planner reads a :class:`Status` and
returns a new one; the handler writes it back with :meth:`Status.to_patch`.

Everything that decides a promotion or a rollback lives here (step index, when the step's
clock started, failure count, Inconclusive streak, when metrics went missing, when the last
analysis ran, which manual commands were already handled), so an operator restart resumes a
rollout exactly where it was: ``plan()`` is a function of (spec, status, observed, analysis,
commands, now).

Wire shape (all keys camelCase; optional keys are omitted when empty)::

    observedGeneration: int
    phase: Pending | Progressing | Paused | Healthy | RolledBack | Degraded
    message: str
    desiredRevision / stableRevision / canaryRevision: str
    currentStepIndex: int (0-based) ; stepCount: int
    stepWeight: int (requested %) ; canaryWeight: int (effective %, canary/(stable+canary))
    stableReplicas / canaryReplicas: int (desired)
    paused: bool
    rollout: {revision, stepIndex, stepWeight, startedAt, stepEnteredAt, stepStartedAt,
              failures, inconclusiveStreak, underfed, metricsErrorSince, lastAnalysisAt,
              passedLanes, pausedAt}
    failedRevisions: [{revision, time, reason, evidence}]
    handledCommands: {promote|abort|retry|pause: <last handled annotation value>}
    conditions: [{type: Ready|Reconciling|Stalled|SettingsStale|Degraded, status, reason, message,
                  lastTransitionTime, observedGeneration}]
    lastAnalysis: {time, revision, outcome, window, lanes: [{lane, outcome, p99Latency,
                   p99LatencySlo, queueAge, maxQueueAge, errorRate, maxErrorRate,
                   samples, queueSamples, requests, stableP99Latency, stableQueueAge,
                   stableErrorRate, stableSamples}]}
    ledger: [{time, kind, revision, ...}]   (bounded per kind, newest last: see trim_ledger)
    history: [{revision, outcome, time, reason, evidence}] (bounded, newest last)
    recommendation: {time, nextAt, window, growth, margin, stale, reason, message, pods,
                     lanes: [...], failed, patch}   (spec.tuning only; see Recommendation)

Datetimes are RFC 3339 strings in UTC (``2026-11-30T01:45:00Z``).
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

DECISION_LIMIT = 60
"""Decision entries (every ledger kind but Analysis) kept in status, newest last. A rollout
makes a few (CanaryStarted, one StepAdvanced a step, Promoted or RolledBack, and the pauses,
commands and stalls on-call caused), so status holds the last several rollouts whole; every
decision is also appended to the policy's ledger ConfigMap (``ledger.py``), which keeps the
older ones. Analyses never push a decision out."""
ANALYSIS_LIMIT = 60
"""Analysis entries kept in status, newest last: one analysis adds one per lane and objective
(and per tenant slice held against the canary), so a two-lane policy keeps its last ten. Their
verdicts are carried by the decisions they led to (whose evidence quotes them) and their
counts by ``rollout.evidence``; the measurements themselves stay in Prometheus."""
HISTORY_LIMIT = 20
"""Revision outcomes kept in status.history."""
FAILED_REVISIONS_LIMIT = 20
"""Failed revisions remembered so they are not canaried again (oldest forgotten first)."""


class Phase(StrEnum):
    PENDING = "Pending"
    """Nothing is stable yet: the first revision rolls out directly as stable."""
    PROGRESSING = "Progressing"
    """A canary is running (or a promotion is finishing)."""
    PAUSED = "Paused"
    """A canary is running and held by the pause command (Argo CD: Suspended)."""
    HEALTHY = "Healthy"
    """The desired revision is stable, no canary."""
    ROLLED_BACK = "RolledBack"
    """The desired revision failed (or was aborted); stable serves; not retried until spec or retry."""
    DEGRADED = "Degraded"
    """The stable track has no ready pod."""


class _Model(BaseModel):
    # extra="ignore": kopf and others may keep their own keys in .status (e.g. status.kopf).
    model_config = ConfigDict(populate_by_name=True, extra="ignore")


ConditionType = Literal["Ready", "Reconciling", "Stalled", "SettingsStale", "Degraded"]
ConditionStatus = Literal["True", "False", "Unknown"]


class Condition(_Model):
    type: ConditionType
    status: ConditionStatus
    reason: str
    message: str = ""
    last_transition_time: datetime = Field(alias="lastTransitionTime")
    observed_generation: int = Field(default=0, alias="observedGeneration")


LedgerKind = Literal[
    "Analysis",
    "CanaryStarted",
    "StepAdvanced",
    "Promoted",
    "RolledBack",
    "Aborted",
    "Superseded",
    "Stalled",
    "MetricsRestored",
    "Paused",
    "Resumed",
    "Command",
    "Adopted",
    "Initial",
]


class LedgerEntry(_Model):
    """One decision or one measurement. Analysis entries carry the measurement fields."""

    time: datetime
    kind: LedgerKind
    revision: str
    reason: str | None = None
    evidence: str | None = None
    # Analysis entries (one per lane and metric, canary track; stable values for comparison):
    track: str | None = None
    lane: str | None = None
    metric: str | None = None
    query: str | None = None
    value: float | None = None
    samples: float | None = None
    threshold: float | None = None
    outcome: str | None = None
    stable_value: float | None = Field(default=None, alias="stableValue")
    stable_samples: float | None = Field(default=None, alias="stableSamples")
    # The verdict's counts and tests: the share of requests over the objective (or errors) on
    # each track, and how sure the tests were that the canary is worse than the stable and
    # over its budget (set when the canary breached).
    bad_fraction: float | None = Field(default=None, alias="badFraction")
    stable_bad_fraction: float | None = Field(default=None, alias="stableBadFraction")
    confidence_worse: float | None = Field(default=None, alias="confidenceWorse")
    confidence_over_budget: float | None = Field(default=None, alias="confidenceOverBudget")
    # The rollout's sequential evidence after this window (the e-value that the canary is worse
    # than the stable, or over its budget where none was compared) and what a rollback needs.
    evidence_value: float | None = Field(default=None, alias="evidenceValue")
    evidence_needed: float | None = Field(default=None, alias="evidenceNeeded")
    tenant: str | None = Field(default=None, description="the tenant slice judged (absent: the lane's total)")
    # The latency model's value for the same window at the traffic each revision really got, and
    # its error against what the pods recorded (modelwatch; p99 and queue-age entries, with spec.tuning).
    predicted_value: float | None = Field(default=None, alias="predictedValue")
    model_error: float | None = Field(default=None, alias="modelError")
    stable_predicted_value: float | None = Field(default=None, alias="stablePredictedValue")
    stable_model_error: float | None = Field(default=None, alias="stableModelError")


HistoryOutcome = Literal["Promoted", "RolledBack", "Superseded", "Aborted"]


class HistoryEntry(_Model):
    revision: str
    outcome: HistoryOutcome
    time: datetime
    reason: str = ""
    evidence: str = ""


class FailedRevision(_Model):
    revision: str
    time: datetime
    reason: str
    evidence: str = ""


class RolloutState(_Model):
    """The canary in flight. Every counter and timestamp that decides is here."""

    revision: str
    step_index: int = Field(default=0, alias="stepIndex")
    step_weight: int = Field(default=0, alias="stepWeight")
    started_at: datetime = Field(alias="startedAt")
    step_entered_at: datetime = Field(alias="stepEnteredAt")
    step_started_at: datetime | None = Field(
        default=None,
        alias="stepStartedAt",
        description="the step clock starts when the canary's pods are ready, plus spec.rollout.warmup (it may lie ahead)",
    )
    failures: int = 0
    inconclusive_streak: int = Field(default=0, alias="inconclusiveStreak")
    underfed: str | None = Field(
        default=None,
        description="why the last analysis could not pass the step: the canary fed below minCanaryLoadRatio "
        "with no later step feeding it, and what to change (fairness.judge_load)",
    )
    metrics_error_since: datetime | None = Field(default=None, alias="metricsErrorSince")
    last_analysis_at: datetime | None = Field(default=None, alias="lastAnalysisAt")
    passed_lanes: list[str] = Field(default_factory=list, alias="passedLanes")
    paused_at: datetime | None = Field(default=None, alias="pausedAt")
    evidence: dict[str, list[list[float]]] = Field(
        default_factory=dict,
        description="the canary's tally: [bad events, requests] per analysed sub-window, by lane/metric/track",
    )


class LaneSummary(_Model):
    lane: str
    outcome: str
    p99_latency: float | None = Field(default=None, alias="p99Latency")
    p99_latency_slo: float = Field(alias="p99LatencySlo")
    queue_age: float | None = Field(default=None, alias="queueAge")
    max_queue_age: float = Field(alias="maxQueueAge")
    error_rate: float | None = Field(default=None, alias="errorRate")
    max_error_rate: float | None = Field(default=None, alias="maxErrorRate")  # None: written before v0.2
    samples: float | None = None
    queue_samples: float | None = Field(default=None, alias="queueSamples")
    requests: float | None = None
    """Well-formed requests over the window (the error rate's denominator)."""
    stable_p99_latency: float | None = Field(default=None, alias="stableP99Latency")
    stable_queue_age: float | None = Field(default=None, alias="stableQueueAge")
    stable_error_rate: float | None = Field(default=None, alias="stableErrorRate")
    stable_samples: float | None = Field(default=None, alias="stableSamples")
    rejected: float | None = None
    """The share of the lane's requests answered 4xx (issue 12), and the stable's."""
    stable_rejected: float | None = Field(default=None, alias="stableRejected")
    tenants: list[TenantSummary] | None = None
    detectable_p99_regression: float | None = Field(
        default=None,
        alias="detectableP99Regression",
        description="the smallest p99 regression (0.5: 1.5x the stable's) the rollout's tally detects at this "
        "window's traffic (batchpilot_operator.power); absent when none up to 10x is or the window cannot tell",
    )
    detectable_error_rate: float | None = Field(
        default=None,
        alias="detectableErrorRate",
        description="the smallest share of the canary's requests answered with an error (shed, timed out, failed) "
        "the rollout's tally detects at this window's traffic and the stable's error share; absent when none is",
    )
    detects: str | None = None
    """Both in words, for ``kubectl batchpilot status``."""
    detects_as_of: datetime | None = Field(
        default=None,
        alias="detectsAsOf",
        description="with maxP99Increase: the last analysis of the step whose window compared the canary's p99 "
        "with the stable's (the p99 statement is of those windows; a quiet window's stable compares nothing)",
    )
    predicted_p99_latency: float | None = Field(default=None, alias="predictedP99Latency")
    """The latency model's p99 for the canary at the traffic it got in this window (``modelwatch``)."""
    stable_predicted_p99_latency: float | None = Field(default=None, alias="stablePredictedP99Latency")
    model: str | None = None
    """The model's check of each track in words: predicted, observed by the pods, the error."""


class TenantSummary(_Model):
    """One tenant slice of a lane in the last analysis (issue 12): its own counts and verdict."""

    tenant: str
    outcome: str
    thin: bool = Field(default=False, description="too few requests to judge: counted for nothing")
    p99_latency: float | None = Field(default=None, alias="p99Latency")
    stable_p99_latency: float | None = Field(default=None, alias="stableP99Latency")
    samples: float | None = None
    requests: float | None = None
    """Every request of the tenant, rejected ones too (the 4xx share's denominator)."""
    rejected: float | None = None
    """The share answered 4xx."""
    stable_rejected: float | None = Field(default=None, alias="stableRejected")
    evidence: str | None = None
    """What held the slice against the canary (Failed, or a breach not yet pinned)."""


class AnalysisSummary(_Model):
    time: datetime
    revision: str
    outcome: str
    window: str
    lanes: list[LaneSummary] = Field(default_factory=list)


class Recommendation(_Model):
    """The last scheduled recommendation (spec.tuning), written by recommender.py.

    ``lanes`` holds, per lane, what ``kubectl batchpilot recommend -o json`` shows: the observed
    traffic, the current and the recommended setting with capacity and predicted p99 / queue age
    at the observed and the planned traffic, and the reasons it is stale; ``calibration`` per
    lane the model's measured error and its correction, carried from one recommendation to the next.
    """

    time: datetime
    next_at: datetime = Field(alias="nextAt")
    window: str
    growth: float
    margin: float
    stale: bool = False
    reason: str | None = None
    message: str = ""
    pods: list[str] = Field(default_factory=list)
    lanes: list[dict[str, Any]] = Field(default_factory=list)
    failed: dict[str, str] = Field(default_factory=dict)
    patch: list[dict[str, Any]] = Field(default_factory=list)
    calibration: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="per lane: the model's p99 checked against the pods' over recent windows, the error and "
        "the correction applied (batchpilot_operator.tune.calibration)",
    )


class Status(_Model):
    observed_generation: int | None = Field(default=None, alias="observedGeneration")
    phase: Phase | None = None
    message: str = ""
    desired_revision: str | None = Field(default=None, alias="desiredRevision")
    stable_revision: str | None = Field(default=None, alias="stableRevision")
    canary_revision: str | None = Field(default=None, alias="canaryRevision")
    current_step_index: int | None = Field(default=None, alias="currentStepIndex")
    step_count: int | None = Field(default=None, alias="stepCount")
    step_weight: int | None = Field(default=None, alias="stepWeight")
    canary_weight: int = Field(default=0, alias="canaryWeight")
    stable_replicas: int | None = Field(default=None, alias="stableReplicas")
    canary_replicas: int = Field(default=0, alias="canaryReplicas")
    paused: bool = False
    rollout: RolloutState | None = None
    canary_drained_at: datetime | None = Field(
        default=None,
        alias="canaryDrainedAt",
        description="a routed canary leaving: when the route was first read sending it nothing",
    )
    failed_revisions: list[FailedRevision] = Field(default_factory=list, alias="failedRevisions")
    handled_commands: dict[str, str] = Field(default_factory=dict, alias="handledCommands")
    conditions: list[Condition] = Field(default_factory=list)
    last_analysis: AnalysisSummary | None = Field(default=None, alias="lastAnalysis")
    ledger: list[LedgerEntry] = Field(default_factory=list)
    history: list[HistoryEntry] = Field(default_factory=list)
    recommendation: Recommendation | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> Status:
        """Parse ``.status`` as the API holds it (``None`` or ``{}`` for a new policy)."""
        return cls.model_validate(data or {})

    def to_dict(self) -> dict[str, Any]:
        """The status as JSON-ready dict, empty optional keys omitted (for display, fixtures)."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)

    def to_patch(self) -> dict[str, Any]:
        """A JSON merge patch that turns any previous status into this one.

        Like :meth:`to_dict`, but cleared optional fields are ``None`` so the merge patch
        deletes them (a merge patch merges nested objects key by key, so an omitted key would
        keep a stale value, e.g. ``rollout.metricsErrorSince``). Lists are replaced whole by a
        merge patch, so ``None`` is stripped inside list items.
        """
        patch: dict[str, Any] = _nulls_outside_lists(self.model_dump(mode="json", by_alias=True, exclude_none=False))
        return patch

    def condition(self, type_: ConditionType) -> Condition | None:
        for cond in self.conditions:
            if cond.type == type_:
                return cond
        return None

    def set_condition(
        self,
        type_: ConditionType,
        status: ConditionStatus,
        reason: str,
        message: str,
        generation: int,
        now: datetime,
    ) -> None:
        """Set condition ``type_`` (in its place, or added last); its lastTransitionTime is
        ``now`` unless it had this status already."""
        at = next((i for i, cond in enumerate(self.conditions) if cond.type == type_), None)
        kept = at is not None and self.conditions[at].status == status
        condition = Condition(
            type=type_,
            status=status,
            reason=reason,
            message=message,
            last_transition_time=self.conditions[at].last_transition_time if kept and at is not None else now,
            observed_generation=generation,
        )
        if at is None:
            self.conditions.append(condition)
        else:
            self.conditions[at] = condition

    def is_failed(self, revision: str) -> bool:
        return any(f.revision == revision for f in self.failed_revisions)


def trim_ledger(entries: list[LedgerEntry]) -> list[LedgerEntry]:
    """The ledger bounded per kind, in order: the newest :data:`ANALYSIS_LIMIT` analyses and
    the newest :data:`DECISION_LIMIT` decisions. A burst of analyses (a long rollout, a slow
    machine) can never push out the decision that started a canary."""
    left = {True: ANALYSIS_LIMIT, False: DECISION_LIMIT}
    kept: list[LedgerEntry] = []
    for entry in reversed(entries):
        is_analysis = entry.kind == "Analysis"
        if left[is_analysis] > 0:
            left[is_analysis] -= 1
            kept.append(entry)
    kept.reverse()
    return kept


def _strip_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_strip_none(v) for v in value]
    return value


def _nulls_outside_lists(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _nulls_outside_lists(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_strip_none(v) for v in value]
    return value
