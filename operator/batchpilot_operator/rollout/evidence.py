"""What an analysis leaves in the status: a ledger entry per objective, the lanes' summary
(values, the stable's, what the gate can detect, the latency model's check) and the short
evidence a step change or promotion carries."""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from batchpilot_operator.analysis import (
    P99_BUDGET,
    SLICES,
    TALLY_ANALYSES,
    AnalysisResult,
    LaneVerdict,
    MetricCheck,
    Outcome,
    format_share,
    format_value,
    lane_key,
    sequential_needed,
)
from batchpilot_operator.analysis.tally import ComparedWindow, compared_windows
from batchpilot_operator.fairness import gating_analyses
from batchpilot_operator.power import (
    LIMIT,
    POWER,
    Tally,
    lane_detectable_error_rate,
    lane_detectable_regression,
    relative_detectable_regression,
)
from batchpilot_operator.rollout.state import PlanState
from batchpilot_operator.status import AnalysisSummary, LaneSummary, LedgerEntry, TenantSummary
from batchpilot_operator.tune.calibration import RevisionCheck


def record_analysis(p: PlanState, a: AnalysisResult) -> None:
    lanes: list[LaneSummary] = []
    for lane in a.lanes:
        # The lane's total, every objective; of a tenant slice only what holds against the
        # canary (Failed, Error, or a breach not yet pinned), so the ledger stays readable.
        judged: list[tuple[LaneVerdict, MetricCheck]] = [(lane, c) for c in lane.canary]
        judged += [
            (sl, c)
            for sl in lane.slices
            for c in sl.canary
            if c.outcome in (Outcome.FAILED, Outcome.ERROR) or (c.outcome is Outcome.INCONCLUSIVE and c.note)
        ]
        for owner, c in judged:
            s = owner.check(c.metric, "stable")
            p.append_ledger(
                LedgerEntry(
                    time=p.now,
                    kind="Analysis",
                    revision=c.revision,
                    track=c.track,
                    lane=c.lane,
                    metric=c.metric,
                    query=c.query,
                    value=json_float(c.value),
                    samples=c.samples,
                    threshold=json_float(c.threshold),
                    outcome=c.outcome.value,
                    evidence=c.describe(),
                    stable_value=json_float(s.value) if s else None,
                    stable_samples=s.samples if s else None,
                    bad_fraction=c.bad_fraction,
                    stable_bad_fraction=s.bad_fraction if s else None,
                    confidence_worse=c.confidence_worse,
                    confidence_over_budget=c.confidence_over_budget,
                    evidence_value=json_float(c.evidence) if c.outcome is not Outcome.SUCCESSFUL else None,
                    evidence_needed=c.evidence_needed if c.outcome is not Outcome.SUCCESSFUL else None,
                    tenant=c.tenant,
                    **(_model_entry(a, c.lane, c.metric) if owner is lane else {}),
                )
            )
        lat = lane.check("p99Latency")
        qa = lane.check("queueAge")
        err = lane.check("errorRate")
        slat = lane.check("p99Latency", "stable")
        sqa = lane.check("queueAge", "stable")
        serr = lane.check("errorRate", "stable")
        rej, srej = lane.check("clientErrors"), lane.check("clientErrors", "stable")
        slo = p.spec.lane_slo(lane.lane)
        lanes.append(
            LaneSummary(
                lane=lane.lane,
                outcome=lane.outcome.value,
                p99_latency=_val(lat),
                p99_latency_slo=slo.p99_latency,
                queue_age=_val(qa),
                max_queue_age=slo.max_queue_age,
                error_rate=_val(err),
                max_error_rate=slo.max_error_rate,
                samples=lat.samples if lat else None,
                queue_samples=qa.samples if qa else None,
                requests=err.samples if err else None,
                stable_p99_latency=_val(slat),
                stable_queue_age=_val(sqa),
                stable_error_rate=_val(serr),
                stable_samples=slat.samples if slat else None,
                rejected=_val(rej),
                stable_rejected=_val(srej),
                tenants=[_tenant_summary(sl) for sl in lane.slices] or None,
                **_detectable(
                    lane,
                    p.spec.rollout.confidence,
                    gating_analyses(p.spec),
                    sequential_needed(p.spec, False),
                    compared_windows(a.tally, lane_key(lane.lane, None)),
                ),
                **_model_summary(a, lane.lane),
            )
        )
    p.st.last_analysis = AnalysisSummary(
        time=p.now, revision=a.canary_revision, outcome=a.outcome.value, window=a.window, lanes=lanes
    )


def last_evidence(p: PlanState) -> str:
    la = p.st.last_analysis
    if la is None:
        return ""
    parts = [
        f"{lane.lane}: p99 {fmt_seconds(lane.p99_latency)}/{lane.p99_latency_slo:g}s, "
        f"queue age {fmt_seconds(lane.queue_age)}/{lane.max_queue_age:g}s, "
        f"errors {fmt_rate(lane.error_rate)}/{fmt_rate(lane.max_error_rate)}, {fmt_count(lane.samples)} samples"
        for lane in la.lanes
    ]
    return f"last analysis {la.outcome}: " + "; ".join(parts)


def inconclusive_advice(p: PlanState) -> str:
    """Why a streak of Inconclusive analyses stalled the rollout, and what would end it.

    A canary too thin to judge (fewer than ``minSamples`` requests in its window and in the
    tally of its last analyses, ``analysis.check_metric``) gets the numbers: its rate in the
    last window, and the ``analysisInterval`` at which the tally would hold ``minSamples``.
    With ``maxP99Increase``, a stable too quiet for a p99 of its own in every window (the
    relative objective compares nothing: ``analysis.STABLE_TOO_THIN``) gets its numbers too.
    Otherwise the analyses saw breaches they could not pin on the canary (the stable breaching
    too, or the rollout's evidence still short): the last analysis says which."""
    spec = p.spec.rollout
    need = spec.min_samples
    la = p.st.last_analysis
    thin = [lane for lane in la.lanes if (lane.samples or 0.0) < need] if la is not None else []
    hand = "holding, not rolling back (`kubectl batchpilot promote` or `abort` decides by hand)"
    quiet = [
        lane
        for lane in (la.lanes if la is not None and spec.max_p99_increase is not None else [])
        if lane not in thin and lane.stable_samples is not None and lane.stable_samples < need
    ]
    if quiet and not thin:
        # maxP99Increase compares with the stable's p99 of each window (analysis.STABLE_TOO_THIN)
        lane = min(quiet, key=lambda lane: lane.stable_samples or 0.0)
        got, interval = _got(spec.analysis_interval, lane.stable_samples, need, 1)
        text = (
            f"lane {lane.lane}'s stable got {got}, fewer than minSamples ({need}) for a p99 to compare "
            "maxP99Increase with"
        )
        return f"{text}{interval}, or a lower minSamples; {hand}"
    if not thin:
        evidence = last_evidence(p)
        return f"breaches the analyses could not pin on the canary ({evidence}); {hand}"
    lane = min(thin, key=lambda lane: lane.samples or 0.0)
    got, interval = _got(spec.analysis_interval, lane.samples, need, TALLY_ANALYSES)
    text = (
        f"lane {lane.lane}'s canary got {got}; a verdict needs minSamples ({need}) in a window or in the tally "
        f"of its last {TALLY_ANALYSES}"
    )
    if interval:
        text += f"{interval}, or a larger step weight"
    else:
        text += ": the canary got no request; check the route's weights and the canary pods"
    return f"{text}; {hand}"


def _got(window: float, requests: float | None, need: int, windows: int) -> tuple[str, str]:
    """A track's requests in the last ``window`` seconds in words, and the analysisInterval at
    which ``windows`` windows at that rate gather ``need`` (empty at no traffic)."""
    got = requests or 0.0
    rate = got / window
    said = f"{got:.0f} requests in the last {window:g}s window ({rate:.2g}/s)"
    if rate <= 0:
        return said, ""
    return said, f": at this rate an analysisInterval of {math.ceil(need / (rate * windows))}s or more gathers them"


def json_float(value: float | None) -> float | None:
    """JSON (and so .status) has no Inf/NaN: those are stored as absent."""
    return value if value is not None and math.isfinite(value) else None


def _val(check: MetricCheck | None) -> float | None:
    return None if check is None else json_float(check.value)


def _predicted(m: RevisionCheck | None, metric: str) -> tuple[float | None, float | None]:
    """(the model's value as shown, its error against the pods' own record) for one metric."""
    c = m.check if m is not None else None
    if c is None:
        return None, None
    if metric == "p99Latency":
        return json_float(c.predicted_p99 * c.correction), json_float(c.error)
    error = c.predicted_wait / c.observed_wait - 1 if c.observed_wait > 0 else math.nan
    return json_float(c.predicted_wait), json_float(error)


def _model_entry(a: AnalysisResult, lane: str, metric: str) -> dict[str, Any]:
    """The ledger fields of the model's check beside a lane's p99 or queue-age entry (``modelwatch``)."""
    got = a.model_checks(lane)
    if not got or metric not in ("p99Latency", "queueAge"):
        return {}
    value, error = _predicted(got.get("canary"), metric)
    stable_value, stable_error = _predicted(got.get("stable"), metric)
    return {
        "predicted_value": value,
        "model_error": error,
        "stable_predicted_value": stable_value,
        "stable_model_error": stable_error,
    }


def _model_summary(a: AnalysisResult, lane: str) -> dict[str, Any]:
    """The LaneSummary fields of the model's check of each track (``modelwatch``)."""
    got = a.model_checks(lane)
    if not got:
        return {}
    order = [got[t] for t in ("canary", "stable") if t in got]
    return {
        "predicted_p99_latency": _predicted(got.get("canary"), "p99Latency")[0],
        "stable_predicted_p99_latency": _predicted(got.get("stable"), "p99Latency")[0],
        "model": "model: " + "; ".join(m.describe() for m in order),
    }


def _detectable(
    lane: LaneVerdict,
    confidence: float,
    analyses: int,
    needed: float,
    compared: Sequence[ComparedWindow] = (),
) -> dict[str, object]:
    """The LaneSummary fields saying what the gate can see at this window's traffic (``power``)
    over the ``analyses`` windows the rollout's promoting tally can hold, with the evidence a
    rollback ``needed`` (``analysis.sequential_needed``): the smallest p99 regression and the
    smallest error rate.

    With ``maxP99Increase``, the relative objective's statement is of the step's windows that
    compared the canary's p99 with the stable's (``compared``, kept beside the tally), each at
    its own threshold, their requests projected to the tally the rollout can gather: the verdict
    is on them, and one window's histogram read its few slowest requests (the status said +51%
    for a window and +25% for the next of the same step). A window whose stable is too quiet to
    compare (``analysis.STABLE_TOO_THIN``) restates them, saying as of when."""
    out: dict[str, object] = {}
    said: list[str] = []
    rel = lane.check("p99Increase")
    # The SLO's objective, and the relative one where the policy sets maxP99Increase: a
    # regression either fails is caught, so the smaller of the two is what the gate sees (the
    # relative one only with a stable p99 to compare with: its threshold is finite; at a step
    # that feeds the canary unlike the stable, what the like-for-like step would see at this
    # window's rates, since it is that step that judges it).
    found: float | None = None
    for metric in ("p99Latency", "p99Increase"):
        check, stable = lane.check(metric), lane.check(metric, "stable")
        if check is None or not math.isfinite(check.threshold) or (metric == "p99Increase" and compared):
            continue
        x = lane_detectable_regression(check, stable, confidence, analyses, needed=needed)
        if x is not None:
            found = x if found is None else min(found, x)
    as_of = ""
    if compared:
        scale = max(1.0, analyses / len(compared))  # the tally the rollout can gather, at these windows' mix
        tally = Tally(
            sum(w.canary_requests for w in compared) * scale,
            sum(w.stable_requests for w in compared) * scale,
            confidence,
            P99_BUDGET,
            POWER,
            subwindows=max(1, round(len(compared) * scale * SLICES)),
            needed=needed,
            on_budget=True,  # the relative objective's gate reads the evidence over the budget
        )
        x = relative_detectable_regression(compared, tally)
        found = x if found is None else min(found, x)
        last = datetime.fromtimestamp(compared[-1].at, UTC)
        out["detects_as_of"] = last
        if rel is not None and rel.unjudged is not None:
            as_of = f" (as of the analysis at {last:%H:%M:%S}: this window's stable was too quiet to compare)"
    if found is not None and math.isinf(found):
        why = "the stable is far under its SLO or the traffic is thin"
        if rel is not None:
            why = "the traffic is too thin"  # maxP99Increase: the stable's headroom does not matter
        said.append(f"no p99 regression up to {LIMIT + 1:g}x ({why}){as_of}")
    elif found is not None:
        out["detectable_p99_regression"] = found
        said.append(f"a p99 regression of {found:.0%} or more{as_of}")
    _detectable_errors(lane, confidence, analyses, needed, out, said)
    return out


def _detectable_errors(
    lane: LaneVerdict, confidence: float, analyses: int, needed: float, out: dict[str, object], said: list[str]
) -> None:
    """The error part of :func:`_detectable`, and both parts in words (``detects``)."""
    lat = lane.check("p99Latency")
    err, serr = lane.check("errorRate"), lane.check("errorRate", "stable")
    # Errors a queue sheds come in the same bursts as slow requests: the larger clustering counts.
    bursts = max((c.burstiness for c in (lat, err) if c is not None and c.burstiness is not None), default=None)
    rate = (
        lane_detectable_error_rate(err, serr, confidence, analyses, burstiness=bursts, needed=needed)
        if err is not None
        else None
    )
    if rate is not None and err is not None:
        budget = f"budget {format_share(err.budget)}"
        if math.isinf(rate):
            said.append(f"no error rate at all ({budget}: the traffic is too thin or too bursty)")
        else:
            out["detectable_error_rate"] = rate
            said.append(f"an error rate of {format_share(rate)} or more ({budget})")
    if said:
        out["detects"] = " and ".join(said) + " at the current traffic"


def _tenant_summary(sl: LaneVerdict) -> TenantSummary:
    lat, slat = sl.check("p99Latency"), sl.check("p99Latency", "stable")
    rej, srej = sl.check("clientErrors"), sl.check("clientErrors", "stable")
    held = [
        c.describe()
        for c in sl.canary
        if c.outcome in (Outcome.FAILED, Outcome.ERROR) or (c.outcome is Outcome.INCONCLUSIVE and c.note)
    ]
    return TenantSummary(
        tenant=sl.tenant or "",
        outcome=sl.outcome.value,
        thin=sl.thin,
        p99_latency=_val(lat),
        stable_p99_latency=_val(slat),
        samples=lat.samples if lat else None,
        requests=rej.samples if rej else None,
        rejected=_val(rej),
        stable_rejected=_val(srej),
        evidence="; ".join(held) or None,
    )


def fmt_seconds(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g}s"


def fmt_rate(value: float | None) -> str:
    return "n/a" if value is None else format_value("errorRate", value)


def fmt_count(value: float | None) -> str:
    return "0" if value is None else f"{value:.0f}"
