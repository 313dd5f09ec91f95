"""The operator's own Prometheus metrics (served by `batchpilot run --metrics-port`)."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge

if TYPE_CHECKING:
    from batchpilot_operator.planner import Decision

ROLLOUTS = Counter(
    "batchpilot_operator_rollouts_total",
    "Rollouts finished, by outcome (Promoted, RolledBack, Aborted, Superseded)",
    ["namespace", "policy", "outcome"],
)
ANALYSES = Counter(
    "batchpilot_operator_analyses_total",
    "Canary analyses, by outcome (Successful, Failed, Inconclusive, Error)",
    ["namespace", "policy", "outcome"],
)
RECONCILES = Counter(
    "batchpilot_operator_reconciles_total",
    "Reconciles run, by whether they wrote to the API",
    ["namespace", "policy", "wrote"],
)
RECONCILE_ERRORS = Counter(
    "batchpilot_operator_reconcile_errors_total",
    "Reconciles that raised (API or Prometheus trouble); they are retried",
    ["namespace", "policy", "reason"],
)
CANARY_WEIGHT = Gauge(
    "batchpilot_operator_canary_weight_percent",
    "Effective share of traffic on the canary track (0 when no canary runs)",
    ["namespace", "policy"],
)
PHASE = Gauge(
    "batchpilot_operator_policy_phase",
    "1 for the phase a policy is in, 0 for the others",
    ["namespace", "policy", "phase"],
)
PHASES = ("Pending", "Progressing", "Paused", "Healthy", "RolledBack", "Degraded")


def record(namespace: str, policy: str, decision: Decision) -> None:
    for outcome in decision.rollout_outcomes:
        ROLLOUTS.labels(namespace, policy, outcome).inc()
    for outcome in decision.analysis_outcomes:
        ANALYSES.labels(namespace, policy, outcome).inc()
    status = decision.status
    CANARY_WEIGHT.labels(namespace, policy).set(status.canary_weight or 0)
    current = status.phase.value if status.phase else ""
    for phase in PHASES:
        PHASE.labels(namespace, policy, phase).set(1 if phase == current else 0)


def forget(namespace: str, policy: str) -> None:
    """Drop a deleted policy's gauges."""
    with contextlib.suppress(KeyError):
        CANARY_WEIGHT.remove(namespace, policy)
    for phase in PHASES:
        with contextlib.suppress(KeyError):
            PHASE.remove(namespace, policy, phase)
