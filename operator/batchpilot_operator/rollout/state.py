"""The plan in progress: :class:`PlanState` holds the inputs and the status being decided,
and what every stage writes through it (events, ledger entries, history) and the two ways a
canary ends (promoted, rolled back)."""

from __future__ import annotations

from datetime import UTC, datetime

from batchpilot_operator.rollout.inputs import CommandName, Event, EventType, PlanInputs, TrackObserved
from batchpilot_operator.spec import PolicySpec
from batchpilot_operator.status import (
    FAILED_REVISIONS_LIMIT,
    HISTORY_LIMIT,
    FailedRevision,
    HistoryEntry,
    HistoryOutcome,
    LedgerEntry,
    LedgerKind,
    RolloutState,
    trim_ledger,
)


class PlanState:
    """One call of plan(): the inputs, a deep copy of the status it rewrites, and what it emits."""

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

    def event(self, type_: EventType, reason: str, message: str) -> None:
        self.events.append(Event(type=type_, reason=reason, message=message))

    def ledger(self, kind: LedgerKind, revision: str, reason: str | None = None, evidence: str | None = None) -> None:
        self.append_ledger(LedgerEntry(time=self.now, kind=kind, revision=revision, reason=reason, evidence=evidence))

    def append_ledger(self, entry: LedgerEntry) -> None:
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


def ready_text(obs: TrackObserved) -> str:
    return f"{obs.ready_replicas}/{obs.replicas}"


def ts(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def progress_text(r: RolloutState, spec: PolicySpec) -> str:
    return (
        f"at step {min(r.step_index, len(spec.rollout.steps) - 1) + 1}/{len(spec.rollout.steps)}, "
        f"failures {r.failures}, passed lanes {r.passed_lanes or 'none'}"
    )
