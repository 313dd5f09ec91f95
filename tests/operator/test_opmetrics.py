"""The operator's own metrics of a policy (opmetrics.record, forget): a condition's reason gauge
says 1 for the reason it is True with, 0 for the reasons it was before; forget drops them."""

from __future__ import annotations

from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

from batchpilot_operator import opmetrics
from batchpilot_operator.status import Status
from bptest import make_spec

NOW = datetime(2026, 11, 30, 1, 0, 0, tzinfo=UTC)


def record(status: Status) -> None:
    decision: Any = SimpleNamespace(rollout_outcomes=[], analysis_outcomes=[], rollback_reasons=[], status=status)
    opmetrics.record("ml", "gauges", make_spec(lanes=2), decision)


def series(gauge: Any) -> dict[str, float]:
    return {
        s.labels["reason"]: s.value
        for family in gauge.collect()
        for s in family.samples
        if s.labels.get("namespace") == "ml" and s.labels.get("policy") == "gauges"
    }


def test_reason_gauges_follow_the_conditions_and_forget_drops_them() -> None:
    status = Status()
    status.set_condition("Stalled", "True", "MetricsUnavailable", "", 1, NOW)
    status.set_condition("Degraded", "True", "StableUnderCapacity", "", 1, NOW)
    record(status)
    assert series(opmetrics.STALLED) == {"MetricsUnavailable": 1}
    assert series(opmetrics.DEGRADED) == {"StableUnderCapacity": 1}

    status.set_condition("Stalled", "True", "InconclusiveAnalyses", "", 1, NOW)
    status.set_condition("Degraded", "False", "StableReady", "", 1, NOW)
    record(status)
    assert series(opmetrics.STALLED) == {"MetricsUnavailable": 0, "InconclusiveAnalyses": 1}
    assert series(opmetrics.DEGRADED) == {"StableUnderCapacity": 0}

    opmetrics.forget("ml", "gauges")
    assert series(opmetrics.STALLED) == {} and series(opmetrics.DEGRADED) == {}
    assert not [s for f in opmetrics.LANE_SLO.collect() for s in f.samples if s.labels["policy"] == "gauges"]


def test_set_condition_moves_the_transition_time_only_when_the_status_changes() -> None:
    later = datetime(2026, 11, 30, 2, 0, 0, tzinfo=UTC)
    status = Status()
    status.set_condition("Ready", "True", "Healthy", "a", 1, NOW)
    status.set_condition("Stalled", "False", "Progressing", "", 1, NOW)
    status.set_condition("Ready", "True", "Healthy", "b", 2, later)
    ready = status.condition("Ready")
    assert ready is not None and ready.last_transition_time == NOW
    assert (ready.message, ready.observed_generation) == ("b", 2)
    status.set_condition("Ready", "False", "CanaryFailed", "c", 3, later)
    ready = status.condition("Ready")
    assert ready is not None and ready.last_transition_time == later
    assert [c.type for c in status.conditions] == ["Ready", "Stalled"], "set in its place"
