"""Scheduled recommendations (``spec.tuning``): the operator's side of ``kubectl batchpilot recommend``.

One function, :func:`refresh`, called from ``controller.reconcile`` before the plan. When the
policy has ``spec.tuning`` and its last recommendation is older than ``interval``, it reads the
ready pods' arrivals (the last ``window``) and latency profiles through the apiserver's pod proxy
(:mod:`batchpilot_operator.livedata`), runs the same merge and tuner as the command
(:func:`batchpilot_operator.tune.live.recommend_policy`), and returns the status with

* ``status.recommendation``: per lane the observed traffic, the current and the recommended
  setting with capacity and predicted p99 / queue age at the observed and the planned traffic
  (x ``growth``), the reasons, and the RFC 6902 patch (for Git; never applied);
* the condition ``SettingsStale`` (True with the first lane's first reason:
  ``BreachAtCurrentTraffic``, ``BreachAtPlannedGrowth`` or ``MoreCapacityAvailable``; False
  with ``SettingsCurrent``), an Event ``SettingsStale`` when it turns True or its reason
  changes, and the gauge ``batchpilot_operator_settings_stale`` the ``BatchpilotSettingsStale``
  alert reads.

The planner carries both through unchanged (it copies the status and touches only its own
conditions), and the controller writes them with the rest of the status. The spec is never
written. Cost when not due: a timestamp comparison, no I/O (the idle-cost target holds). When
due: one pod list and two proxied GETs per ready pod, and the tuner's search (about a second
for an hour of traffic). Failures (no ready pod, a pod that does not answer, no traffic) are
recorded in the recommendation and retried at the next interval; they never fail the reconcile.

Requeue: the operator's resync timer runs reconcile every few seconds, which is enough; a
controller that requeues only on the planner's due times must also requeue at
``status.recommendation.nextAt`` (see :func:`next_due`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any, Final

from batchpilot_operator import opmetrics
from batchpilot_operator.spec import PolicySpec
from batchpilot_operator.status import ConditionStatus, Recommendation, Status
from batchpilot_runtime.config import format_duration

log = logging.getLogger(__name__)

CONDITION: Final = "SettingsStale"
CURRENT = "SettingsCurrent"
UNKNOWN = "RecommendationFailed"

Gather = Callable[[str, str, float], Any]
"""(namespace, policy, window seconds) -> livedata.Gathered."""


def next_due(status: Status) -> datetime | None:
    """When the next recommendation is due (None: tuning off or never ran)."""
    return status.recommendation.next_at if status.recommendation is not None else None


def refresh(
    kube: Any,
    spec: PolicySpec,
    body: dict[str, Any],
    status: Status,
    now: datetime,
    emit: Callable[[str, str, str], None],
    gather: Gather | None = None,
) -> Status:
    """The status with a fresh recommendation when one is due (see the module docstring)."""
    meta = body["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    tuning = spec.tuning
    if tuning is None:
        if status.recommendation is None and status.condition(CONDITION) is None:
            return status
        # Tuning switched off: drop what it wrote.
        out = status.model_copy(deep=True)
        out.recommendation = None
        out.conditions = [c for c in out.conditions if c.type != CONDITION]
        _set_gauge(namespace, name, {})
        return out
    if status.recommendation is not None and status.recommendation.next_at > now:
        return status
    if gather is None:
        from batchpilot_operator.livedata import gather as live_gather

        api_client = kube.dyn.client

        def gather(ns: str, policy: str, window: float) -> Any:
            return live_gather(api_client, ns, policy, since=window)

    prior = status.recommendation.calibration if status.recommendation is not None else {}
    rec = _recommend(spec, namespace, name, now, gather, prior)
    out = status.model_copy(deep=True)
    out.recommendation = rec
    cond_status: ConditionStatus
    if rec.reason == UNKNOWN:
        cond_status, reason = "Unknown", UNKNOWN
    elif rec.stale:
        cond_status, reason = "True", rec.reason or "Stale"
    else:
        cond_status, reason = "False", CURRENT
    previous = status.condition(CONDITION)
    out.set_condition(CONDITION, cond_status, reason, rec.message[:1000], meta.get("generation", 0), now)
    if cond_status == "True" and (previous is None or previous.status != "True" or previous.reason != reason):
        emit("Warning", CONDITION, rec.message)
    lanes = {lane["lane"]: lane["reasons"][0] for lane in rec.lanes if lane.get("stale") and lane.get("reasons")}
    _set_gauge(namespace, name, lanes)
    return out


def _recommend(
    spec: PolicySpec, namespace: str, name: str, now: datetime, gather: Gather, prior: dict[str, dict[str, Any]]
) -> Recommendation:
    from batchpilot_operator.tune.calibration import calibrations_from_status
    from batchpilot_operator.tune.live import recommend_policy

    assert spec.tuning is not None
    tuning = spec.tuning
    window = tuning.read_window
    base: dict[str, Any] = {
        "time": now,
        "next_at": now + timedelta(seconds=tuning.interval),
        "window": format_duration(window),
        "growth": tuning.growth,
        "margin": tuning.margin,
        "calibration": prior,  # kept as it was when this window gives no check
    }
    try:
        got = gather(namespace, name, window)
        result = recommend_policy(
            spec,
            got.arrivals,
            got.profiles,
            growth=tuning.growth,
            margin=tuning.margin,
            pod_errors=got.errors,
            calibration=calibrations_from_status({"calibration": prior}),
        )
    except Exception as exc:  # the recommendation is advisory: never fail the reconcile for it
        log.warning("recommendation for %s/%s failed: %s", namespace, name, exc)
        return Recommendation(**base, reason=UNKNOWN, message=f"{type(exc).__name__}: {exc}"[:1000])
    if not result.lanes:
        why = "; ".join(f"lane {k}: {v}" for k, v in result.failed.items())
        return Recommendation(
            **base, pods=result.pods, failed=result.failed, reason=UNKNOWN, message=f"no recommendation: {why}"[:1000]
        )
    base["calibration"] = prior | result.calibration()
    stale = result.stale_lanes
    lanes = [rec.to_dict() for rec in result.lanes]
    # The model's measured error goes with every figure it stated (the first lane's in the message).
    model_text = f"; {result.lanes[0].model.summary()}"
    if stale:
        first = stale[0]
        cur, new = first.current, first.recommended
        message = (
            f"lane {first.lane}: {', '.join(first.reasons)}: current maxBatchSize {cur.settings.max_batch_size} / "
            f"maxQueueDelay {format_duration(cur.settings.max_queue_delay)} serves {cur.capacity:.4g} rows/s within "
            f"the SLO less {tuning.margin:.0%}, observed {first.observed_rate:.4g}, planned {first.planned_rate:.4g} "
            f"(x{first.growth:.3g}); recommended {new.settings.max_batch_size} / "
            f"{format_duration(new.settings.max_queue_delay)} serves {new.capacity:.4g}"
        )
        if len(stale) > 1:
            message += f" (and {len(stale) - 1} more lane(s))"
        note = next((n for n in first.notes if "replicas would serve" in n), None)
        if note:
            message += f"; {note}"
        message += model_text
        return Recommendation(
            **base,
            stale=True,
            reason=first.reasons[0],
            message=message[:1000],
            pods=result.pods,
            lanes=lanes,
            failed=result.failed,
            patch=result.patch,
        )
    message = "; ".join(
        f"lane {r.lane}: capacity {r.current.capacity:.4g} rows/s for planned {r.planned_rate:.4g}"
        for r in result.lanes
    )
    return Recommendation(
        **base,
        reason=CURRENT,
        message=f"current settings hold: {message}{model_text}"[:1000],
        pods=result.pods,
        lanes=lanes,
        failed=result.failed,
        patch=result.patch,
    )


def _set_gauge(namespace: str, policy: str, lanes: dict[str, str]) -> None:
    gauge = opmetrics.SETTINGS_STALE
    for metric in gauge.collect():
        for sample in metric.samples:
            labels = sample.labels
            mine = labels.get("namespace") == namespace and labels.get("policy") == policy
            if mine and lanes.get(labels["lane"]) != labels["reason"]:
                gauge.labels(namespace, policy, labels["lane"], labels["reason"]).set(0)
    for lane, reason in lanes.items():
        gauge.labels(namespace, policy, lane, reason).set(1)
