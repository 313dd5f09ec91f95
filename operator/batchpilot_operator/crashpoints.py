"""Test-only crash points: the drills kill the operator at named points of a reconcile.

``BATCHPILOT_CRASH_AT=<point>[,<point>...]`` makes the process SIGKILL itself the first time
a reconcile reaches one of the named points (no cleanup, no Lease release: as a node loss or
the OOM killer would end it). Unset (always, in production) :func:`reached` is one lookup in
an empty set. An unknown name is refused at start-up, so a typo cannot make a drill pass
without crashing.

The points, in the order a rollout meets them (``controller.execute`` writes the status
first, as the record of what it decided, then makes the children match it):

``configmap-written``
    a revision's ConfigMap was just created; no Deployment runs it yet.
``canary-created``
    the canary Deployment was just created; the rest of the reconcile's writes are not done.
``analysis-recorded``
    the status holding a new analysis (ledger entry, failure count) was just written;
    the children of that decision and its Events are not.
``step-advanced``
    the status of a step advance was just written; the canary is not resized yet.
``promotion-half-done``
    the promoted status is written and the stable Deployment switched to the new revision;
    the canary Deployment and the old ConfigMaps are not handled yet.
``rollback-half-done``
    the rolled-back status is written; the canary Deployment still runs.
"""

from __future__ import annotations

import logging
import os
import signal

log = logging.getLogger(__name__)

ENV = "BATCHPILOT_CRASH_AT"
POINTS = (
    "configmap-written",
    "canary-created",
    "analysis-recorded",
    "step-advanced",
    "promotion-half-done",
    "rollback-half-done",
)


def _armed(value: str | None) -> frozenset[str]:
    names = frozenset(n.strip() for n in (value or "").split(",") if n.strip())
    unknown = sorted(names - set(POINTS))
    if unknown:
        raise ValueError(f"{ENV}: unknown crash point(s) {unknown}; known: {', '.join(POINTS)}")
    return names


ARMED = _armed(os.environ.get(ENV))


def reached(point: str) -> None:
    """SIGKILL this process if ``point`` is armed (see the module docstring)."""
    if point in ARMED:
        log.critical("crash point %s reached: SIGKILL (%s)", point, ENV)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os.kill(os.getpid(), signal.SIGKILL)
