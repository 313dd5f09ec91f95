"""The operator's own Prometheus metrics (served by `batchpilot run --metrics-port`)."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge

if TYPE_CHECKING:
    from batchpilot_operator.rollout import Decision
    from batchpilot_operator.spec import PolicySpec
    from batchpilot_operator.status import Condition

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
LANE_SLO = Gauge(
    "batchpilot_operator_lane_slo_seconds",
    "Each lane's objectives as the policy states them (for alerts: p99 and queue age against SLO)",
    ["namespace", "policy", "lane", "objective"],
)
LANE_MAX_ERROR_RATIO = Gauge(
    "batchpilot_operator_lane_max_error_ratio",
    "Each lane's largest allowed error rate (429/503/504/500 per well-formed request) as the policy states it",
    ["namespace", "policy", "lane"],
)
STALLED = Gauge(
    "batchpilot_operator_policy_stalled",
    "1 while the policy's Stalled condition is True with this reason",
    ["namespace", "policy", "reason"],
)
SETTINGS_STALE = Gauge(
    "batchpilot_operator_settings_stale",
    "1 while spec.tuning predicts a lane's batching setting stale, with the reason "
    "(BreachAtCurrentTraffic, BreachAtPlannedGrowth, MoreCapacityAvailable); set by recommender.py",
    ["namespace", "policy", "lane", "reason"],
)
API_REQUESTS = Counter(
    "batchpilot_operator_api_requests_total",
    "Requests this process's Kubernetes client sent (reconcile writes, informers, leader election), by verb",
    ["verb"],
)
LEADER = Gauge(
    "batchpilot_operator_leader",
    "1 while this replica holds the leader Lease (or runs without leader election), else 0",
    ["identity"],
)
QUEUE_DEPTH = Gauge("batchpilot_operator_workqueue_depth", "Policies waiting for a reconcile worker")
REQUEUES_PENDING = Gauge(
    "batchpilot_operator_requeues_pending", "Policies with a timed requeue pending (planner due times, retries)"
)
RECONCILE_SECONDS = Counter(
    "batchpilot_operator_reconcile_seconds_total", "Wall time spent in reconciles (cache reads, analysis, writes)"
)
ROLLBACKS = Counter(
    "batchpilot_operator_rollbacks_total",
    "Canaries rolled back, by reason (AnalysisFailed, MetricsUnavailable, CanaryNotReady, Aborted)",
    ["namespace", "policy", "reason"],
)
DEGRADED = Gauge(
    "batchpilot_operator_policy_degraded",
    "1 while the policy's Degraded condition is True (the stable track has fewer ready pods than it should), "
    "with its reason (StableUnderCapacity, StableUnavailable)",
    ["namespace", "policy", "reason"],
)
AUTH_ERRORS = Counter(
    "batchpilot_operator_auth_errors_total",
    "Requests rejected for our credentials (HTTP 401/403), by target (kubernetes, prometheus): "
    "an expired or revoked token",
    ["target"],
)
AUTH_OK = Gauge(
    "batchpilot_operator_auth_ok",
    "1 while the target accepted the operator's last request, 0 after it rejected its credentials",
    ["target"],
)
PHASES = ("Pending", "Progressing", "Paused", "Healthy", "RolledBack", "Degraded")


def record(namespace: str, policy: str, spec: PolicySpec, decision: Decision) -> None:
    for outcome in decision.rollout_outcomes:
        ROLLOUTS.labels(namespace, policy, outcome).inc()
    for outcome in decision.analysis_outcomes:
        ANALYSES.labels(namespace, policy, outcome).inc()
    for why in decision.rollback_reasons:
        ROLLBACKS.labels(namespace, policy, why).inc()
    status = decision.status
    CANARY_WEIGHT.labels(namespace, policy).set(status.canary_weight or 0)
    current = status.phase.value if status.phase else ""
    for phase in PHASES:
        PHASE.labels(namespace, policy, phase).set(1 if phase == current else 0)
    for lane in spec.lanes:
        slo = spec.lane_slo(lane.name)
        LANE_SLO.labels(namespace, policy, lane.name, "p99Latency").set(slo.p99_latency)
        LANE_SLO.labels(namespace, policy, lane.name, "maxQueueAge").set(slo.max_queue_age)
        LANE_MAX_ERROR_RATIO.labels(namespace, policy, lane.name).set(slo.max_error_rate)
    _set_reason(STALLED, namespace, policy, status.condition("Stalled"))
    _set_reason(DEGRADED, namespace, policy, status.condition("Degraded"))


def _set_reason(gauge: Gauge, namespace: str, policy: str, condition: Condition | None) -> None:
    """A condition's reason gauge: 1 for its reason while it is True, 0 for the policy's others."""
    reason = condition.reason if condition is not None and condition.status == "True" else None
    for labels in _series(gauge, namespace, policy):
        if labels["reason"] != reason:
            gauge.labels(namespace, policy, labels["reason"]).set(0)
    if reason:
        gauge.labels(namespace, policy, reason).set(1)


def _series(metric: Gauge, namespace: str, policy: str) -> list[dict[str, str]]:
    """The labels of each of the policy's series of ``metric``."""
    return [
        s.labels
        for family in metric.collect()
        for s in family.samples
        if s.labels.get("namespace") == namespace and s.labels.get("policy") == policy
    ]


def forget(namespace: str, policy: str) -> None:
    """Drop a deleted policy's gauges."""
    for gauge in (LANE_SLO, LANE_MAX_ERROR_RATIO, STALLED, SETTINGS_STALE, DEGRADED):
        for labels in _series(gauge, namespace, policy):
            with contextlib.suppress(KeyError):
                gauge.remove(*labels.values())
    with contextlib.suppress(KeyError):
        CANARY_WEIGHT.remove(namespace, policy)
    for phase in PHASES:
        with contextlib.suppress(KeyError):
            PHASE.remove(namespace, policy, phase)
