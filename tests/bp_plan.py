"""The rollout planner driven as the controller drives it, for the pure tests (imported as
``bp_plan``; tests/ is on pythonpath): time is injected, nothing sleeps.

:class:`Sim` analyses when due, plans, and (``converge``) makes the observed Deployments what
the decision asked for, so that a test runs whole rollouts; :func:`measured` is an analysis
judged by the real verdict code (``analysis.verdicts``) from fake measurements.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from typing import Any

from batchpilot_operator import rollout
from batchpilot_operator.analysis import (
    AnalysisResult,
    Measurement,
    lane_thresholds,
    plan_queries,
    promql_window,
    verdicts,
)
from batchpilot_operator.spec import PolicySpec
from batchpilot_operator.status import Status

T0 = datetime(2026, 11, 30, 1, 0, 0, tzinfo=UTC)
POLICY, NS = "chat", "ml"


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def measured(
    spec: PolicySpec,
    status: Status,
    now: datetime,
    *,
    p99: float = 0.1,
    queue_age: float = 0.01,
    error_rate: float = 0.0,
    samples: float = 500,
    error: bool = False,
    per_lane: dict[str, dict[str, Any]] | None = None,
    stable_values: dict[str, float] | None = None,
) -> AnalysisResult:
    """An analysis of the status's canary, judged by the real verdict code. The stable is
    healthy unless ``stable_values`` overrides its ``p99`` / ``queue_age`` (a breach both share)
    or its ``samples`` (a quiet stable)."""
    target = rollout.analysis_target(status)
    assert target is not None, "no canary to analyse"
    canary, stable = target
    lqs = plan_queries(spec, policy=POLICY, namespace=NS, canary_revision=canary, stable_revision=stable)
    ms: dict[str, Measurement] = {}
    for lq in lqs:
        thresholds = lane_thresholds(spec, lq.lane)
        o = (per_lane or {}).get(lq.lane, {})
        lane_p99 = o.get("p99", p99)
        lane_qa = o.get("queue_age", queue_age)
        lane_err = o.get("error_rate", error_rate)
        lane_samples = o.get("samples", samples)
        lane_error = o.get("error", error)
        if lq.track == "stable":
            lane_p99, lane_qa, lane_err, lane_error = 0.05, 0.005, 0.0, False
            lane_p99 = (stable_values or {}).get("p99", lane_p99)
            lane_qa = (stable_values or {}).get("queue_age", lane_qa)
            lane_samples = (stable_values or {}).get("samples", lane_samples)
        for m in lq.metrics:
            value = {
                "p99Latency": lane_p99,
                "p99Increase": lane_p99,  # the same series as the SLO's (maxP99Increase)
                "queueAge": lane_qa,
                "errorRate": lane_err,
                "clientErrors": 0.0,
            }[m.metric]
            if lane_error:
                for q in (m.value, m.samples, m.bad):
                    ms[q] = Measurement(q, error="prometheus unreachable")
                continue
            ms[m.value] = Measurement(m.value, value=value)
            ms[m.samples] = Measurement(m.samples, value=lane_samples)
            # The bad events behind the value: half the requests over a breached latency
            # objective (a clear breach), the error rate's share of errors.
            n = lane_samples if lane_samples == lane_samples else 0.0  # NaN: no data
            if m.metric in ("errorRate", "clientErrors"):
                ms[m.bad] = Measurement(m.bad, value=value * n if value == value else None)
            else:
                k = n / 2 if value == value and value > thresholds[m.metric] else 0.0
                ms[m.bad] = Measurement(m.bad, buckets=((thresholds[m.metric], n - k), (math.inf, n)))
    return AnalysisResult(
        time=now,
        window=promql_window(spec.rollout.analysis_interval),
        canary_revision=canary,
        stable_revision=stable,
        lanes=verdicts(spec, lqs, ms),
    )


def converge(d: rollout.Decision) -> rollout.Observed:
    """The world after the handler applied a decision and every pod became ready."""
    stable = rollout.TrackObserved(d.stable_revision, d.stable_replicas, d.stable_replicas)
    canary = (
        rollout.TrackObserved(d.canary_revision, d.canary_replicas, d.canary_replicas)
        if d.canary_revision is not None
        else None
    )
    return rollout.Observed(stable=stable, canary=canary)


class Sim:
    """Drives plan() like the handler does: analyse when due, apply, converge."""

    def __init__(self, spec: PolicySpec, *, roundtrip: bool = False) -> None:
        self.spec = spec
        self.status = Status()
        self.observed = rollout.Observed()
        self.generation = 1
        self.commands = rollout.Commands()
        self.roundtrip = roundtrip
        self.decisions: list[rollout.Decision] = []

    def tick(self, now: datetime, *, converge_after: bool = True, **analysis: Any) -> rollout.Decision:
        result = None
        if rollout.analysis_due(self.spec, self.status, now):
            result = measured(self.spec, self.status, now, **analysis)
        return self.plan(now, result, converge_after=converge_after)

    def plan(
        self, now: datetime, result: AnalysisResult | None = None, *, converge_after: bool = True
    ) -> rollout.Decision:
        d = rollout.plan(
            rollout.PlanInputs(
                spec=self.spec,
                generation=self.generation,
                status=self.status,
                observed=self.observed,
                now=now,
                analysis=result,
                commands=self.commands,
            )
        )
        self.decisions.append(d)
        self.status = Status.from_dict(d.status.to_dict()) if self.roundtrip else d.status
        if converge_after:
            self.observed = converge(d)
        return d

    def set_spec(self, spec: PolicySpec) -> None:
        self.spec = spec
        self.generation += 1
