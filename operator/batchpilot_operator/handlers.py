"""kopf wiring, kept thin: every event and a periodic timer call controller.reconcile().

kopf stores nothing of its own on a BatchingPolicy apart from its finalizer (needed by the
timer): no ``last-handled-configuration`` annotation (only change-detecting handlers use it,
and there are none), no progress in status. A GitOps tool therefore sees only the spec it
applied; the operator's bookkeeping is in ``.status`` (which Argo CD does not diff).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

import kopf

from batchpilot_operator import controller, opmetrics
from batchpilot_operator.kube import Kube, TransientKubeError
from batchpilot_operator.prom import PrometheusBackend
from batchpilot_operator.spec import GROUP, PLURAL, VERSION

log = logging.getLogger("batchpilot")
RESYNC_SECONDS = float(os.environ.get("BATCHPILOT_RESYNC_SECONDS", "2"))
ERROR_EVENT_EVERY = 300.0
"""A reconcile error that repeats unchanged is posted as an Event at most this often."""


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.persistence.finalizer = "batchpilot.dev/finalizer"
    settings.posting.level = logging.INFO
    settings.watching.server_timeout = 300
    memo["kube"] = Kube.connect(os.environ.get("BATCHPILOT_KUBECONFIG") or None)
    memo["metrics"] = PrometheusBackend(
        os.environ.get("BATCHPILOT_PROMETHEUS_URL", "http://prometheus-operated.monitoring:9090"),
        timeout=float(os.environ.get("BATCHPILOT_PROMETHEUS_TIMEOUT", "5")),
    )


def _lock(memo: kopf.Memo) -> asyncio.Lock:
    lock = memo.get("reconcile_lock")
    if lock is None:
        lock = memo["reconcile_lock"] = asyncio.Lock()
    return lock


async def _reconcile(body: kopf.Body, memo: kopf.Memo, logger: logging.Logger | logging.LoggerAdapter[Any]) -> None:
    # The event and the timer handler of one policy never reconcile at the same time.
    async with _lock(memo):

        def emit(type_: str, reason: str, message: str) -> None:
            kopf.event(body, type=type_, reason=reason, message=message)

        raw = dict(body)
        try:
            result = await asyncio.to_thread(controller.reconcile, memo["kube"], memo["metrics"], raw, emit)
        except TransientKubeError as exc:
            opmetrics.RECONCILE_ERRORS.labels(body.metadata.namespace, body.metadata.name, "Conflict").inc()
            logger.info("retrying on the next resync: %s", exc)
            return
        except Exception as exc:
            # Surfaced where on-call looks (an Event on the policy) and retried next resync.
            opmetrics.RECONCILE_ERRORS.labels(body.metadata.namespace, body.metadata.name, type(exc).__name__).inc()
            logger.exception("reconcile failed; retrying on the next resync")
            message = f"{type(exc).__name__}: {exc}"[:1000]
            last = memo.get("last_error")
            if last is None or last[0] != message or time.monotonic() - last[1] > ERROR_EVENT_EVERY:
                kopf.event(body, type="Warning", reason="ReconcileError", message=message)
                memo["last_error"] = (message, time.monotonic())
            return
        memo["last_error"] = None
        opmetrics.RECONCILES.labels(body.metadata.namespace, body.metadata.name, str(bool(result.writes)).lower()).inc()
        if result.writes:
            logger.debug("reconcile wrote %d object(s)", result.writes)


@kopf.on.event(GROUP, VERSION, PLURAL)
async def on_event(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, type: str | None, **_: Any) -> None:
    if type == "DELETED":
        opmetrics.forget(body.metadata.namespace or "", body.metadata.name or "")
        return
    await _reconcile(body, memo, logger)


@kopf.timer(GROUP, VERSION, PLURAL, interval=RESYNC_SECONDS, sharp=False)
async def resync(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    await _reconcile(body, memo, logger)
