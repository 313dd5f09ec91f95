"""The latency model watched at every analysis window: predicted against observed, per revision.

When a policy has ``spec.tuning`` (it lets the operator read its pods' ``/admin/arrivals`` and
``/admin/profile`` through the apiserver's pod proxy: :mod:`batchpilot_operator.livedata`), each
canary analysis is followed by one read of the ready pods over the analysis's own window. Per
revision (canary and stable) and lane, the arrivals that revision's pods really got are replayed
through the tuner's model, with the setting they ran, the profile they measured and the lane's
correction in force (``status.recommendation.calibration``), and its p99 is set beside the p99
the pods recorded for the same requests
(:func:`batchpilot_operator.tune.live.check_revisions`), on windows with at least
``rollout.minSamples`` answered requests (the floor the verdict judges by; below it the check
says how many there were).

The result rides on the analysis (``AnalysisResult.model``) into ``status.rollout.lastAnalysis``
(each lane's ``model`` line, shown by ``kubectl batchpilot status``) and into the ledger's
p99 and queue-age entries (``predictedValue`` / ``stablePredictedValue`` and the model's error
against the pods' record). It never changes a verdict: the canary is judged on Prometheus alone.

Cost: one pod LIST and two proxied GETs per ready pod per analysis, with a short timeout; a pod
that does not answer is named in the check's reason, and nothing here fails the reconcile.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any, Final

from batchpilot_operator.analysis import AnalysisResult
from batchpilot_operator.spec import PolicySpec
from batchpilot_operator.status import Status
from batchpilot_operator.tune.calibration import RevisionCheck, calibrations_from_status
from batchpilot_operator.tune.live import check_revisions
from batchpilot_runtime.config import parse_duration

log = logging.getLogger(__name__)

TIMEOUT: Final = 3.0
"""Seconds per proxied GET: an analysis waits at most this per pod that does not answer."""

Gather = Callable[[str, str, float], Any]
"""(namespace, policy, window seconds) -> livedata.Gathered."""


def attach(
    kube: Any,
    spec: PolicySpec,
    status: Status,
    analysis: AnalysisResult,
    *,
    policy: str,
    namespace: str,
    gather: Gather | None = None,
) -> AnalysisResult:
    """``analysis`` with the model's check of each revision and lane over its window."""
    if spec.tuning is None:
        return analysis
    if gather is None:
        from batchpilot_operator.livedata import gather as live_gather

        api_client = kube.dyn.client

        def gather(ns: str, name: str, window: float) -> Any:
            return live_gather(api_client, ns, name, since=window, timeout=TIMEOUT)

    revisions = {analysis.canary_revision: "canary"}
    if analysis.stable_revision:
        revisions[analysis.stable_revision] = "stable"
    lanes = [lane.name for lane in spec.lanes]
    rec = status.recommendation
    corrections = {
        lane: cal.correction
        for lane, cal in calibrations_from_status({"calibration": rec.calibration if rec else {}}).items()
    }
    try:
        got = gather(namespace, policy, parse_duration(analysis.window))
        # The windows the verdict judges (minSamples) are the windows the model is checked on.
        checks = check_revisions(
            got.arrivals, got.profiles, lanes, revisions, corrections, min_requests=spec.rollout.min_samples
        )
        if got.errors:
            note = "; ".join(got.errors)
            checks = [
                c if c.check is not None else dataclasses.replace(c, skipped=f"{c.skipped}; {note}") for c in checks
            ]
    except Exception as exc:  # the model check is evidence beside the verdict: never fail the reconcile
        log.warning("model check for %s/%s failed: %s", namespace, policy, exc)
        why = f"{type(exc).__name__}: {exc}"[:300]
        checks = [RevisionCheck(rev, track, lane, skipped=why) for rev, track in revisions.items() for lane in lanes]
    return dataclasses.replace(analysis, model=tuple(checks))
