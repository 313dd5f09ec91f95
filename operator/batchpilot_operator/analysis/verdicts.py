"""The canary's verdict per lane and tenant slice (:func:`verdicts`), and one whole analysis
against a metrics backend (:func:`run_analysis`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from batchpilot_operator.analysis.backend import Measurement, MetricsBackend
from batchpilot_operator.analysis.checks import (
    MetricCheck,
    check_metric,
    judge,
    judge_client_errors,
    sequential_needed,
    slice_confidence,
)
from batchpilot_operator.analysis.objectives import (
    MetricName,
    Outcome,
    Track,
    combine,
    judged_metrics,
    lane_budgets,
    lane_thresholds,
    objective,
    relative_threshold,
)
from batchpilot_operator.analysis.queries import (
    LaneQueries,
    SliceKey,
    counter_queries,
    lane_key,
    plan_queries,
    promql_window,
)
from batchpilot_operator.analysis.tally import (
    SLICES,
    ComparedWindow,
    compared_evidence,
    next_tally,
    pooled,
    sequential_key,
    slice_counts,
)
from batchpilot_operator.spec import PolicySpec
from batchpilot_operator.stats import Slices
from batchpilot_operator.tune.calibration import RevisionCheck


@dataclass(frozen=True)
class LaneVerdict:
    """A lane's verdict: its total (every tenant) and, when the policy declares tenants, one
    verdict per tenant slice in ``slices``, each by the same rule on the slice's own requests.

    How slices combine into the lane (docs/tenants.md "Tenant slices"): a slice's objective with too few
    requests in the window (``minSamples``, as for the total) is *thin*: Inconclusive for that
    slice, recorded, and left out of the lane's outcome and of its step pass, so a tenant that
    sends little never holds the rollout (its requests still count in the lane's total). Any
    other slice outcome counts as the total's would: a Failed slice fails the lane even when
    the total passes, an Error or a breach not yet pinned on the canary holds the step. The
    judged slices share the lane's error rate: each is held to :func:`slice_confidence`.
    """

    lane: str
    outcome: Outcome
    canary: tuple[MetricCheck, ...]
    stable: tuple[MetricCheck, ...] = ()
    tenant: str | None = None
    slices: tuple[LaneVerdict, ...] = ()

    @property
    def thin(self) -> bool:
        """A tenant slice with too few requests to judge any objective."""
        return bool(self.canary) and all(c.thin for c in self.canary)

    def checks(self) -> tuple[MetricCheck, ...]:
        """The canary's checks of the total and of every slice that was judged (not thin)."""
        return self.canary + tuple(c for s in self.slices for c in s.canary if not c.thin)

    def check(self, metric: MetricName, track: Track = "canary") -> MetricCheck | None:
        for c in self.canary if track == "canary" else self.stable:
            if c.metric == metric:
                return c
        return None

    @property
    def passes_step(self) -> bool:
        """Nothing against the canary: every objective Successful, or breached only as the
        stable breaches too, or sits at its budget, without the canary being clearly worse (a
        burst both tracks saw, a system at its SLO: ``MetricCheck.shared_breach``); and so in
        every tenant slice, where a thin objective counts for nothing."""
        thin_ok = self.tenant is not None

        def passes(c: MetricCheck) -> bool:
            return (
                c.outcome is Outcome.SUCCESSFUL
                or (c.outcome is Outcome.INCONCLUSIVE and c.shared_breach)
                or (thin_ok and c.thin)
            )

        return bool(self.canary) and all(passes(c) for c in self.canary) and all(s.passes_step for s in self.slices)

    @property
    def holds_step(self) -> bool:
        """Something against the canary: an objective Failed, or breached in a way the data
        cannot yet pin on it (alone, or clearly worse than a breaching stable but not twice
        as bad). Thin traffic (too few requests to judge) holds nothing against it."""
        return any(
            c.outcome is Outcome.FAILED
            or (c.outcome is Outcome.INCONCLUSIVE and c.note is not None and not c.shared_breach)
            for c in self.canary
        ) or any(s.holds_step for s in self.slices)


@dataclass(frozen=True)
class AnalysisResult:
    """One analysis of the canary over the last interval, all lanes."""

    time: datetime
    window: str
    canary_revision: str
    stable_revision: str | None
    lanes: tuple[LaneVerdict, ...] = field(default_factory=tuple)
    tally: dict[str, list[list[float]]] = field(default_factory=dict)
    """The canary's tally after this analysis, and the rollout's sequential evidence
    (``status.rollout.evidence``; see verdicts)."""
    underfed: str | None = None
    """Why this analysis could not pass the step with the canary fed less than the stable per
    pod and no later step feeding it (``fairness.judge_load``), with what to change."""
    model: tuple[RevisionCheck, ...] = ()
    """The latency model against each revision's pods over this window (``modelwatch``; only
    with ``spec.tuning``, which lets the operator read the pods' arrivals): never a verdict."""

    def model_checks(self, lane: str) -> dict[str, RevisionCheck]:
        """Track -> the model's check of that lane (absent: not attempted)."""
        return {m.track: m for m in self.model if m.lane == lane}

    @property
    def outcome(self) -> Outcome:
        return combine([lane.outcome for lane in self.lanes])

    def evidence(self, only: Sequence[Outcome] | None = None) -> str:
        """A short text with the canary's values (optionally only checks with given outcomes)."""
        parts = [c.describe() for lane in self.lanes for c in lane.checks() if only is None or c.outcome in only]
        return "; ".join(parts) if parts else "no measurements"


def verdicts(
    spec: PolicySpec,
    lane_queries: Sequence[LaneQueries],
    measurements: Mapping[str, Measurement],
    slices: Mapping[SliceKey, Slices] | None = None,
    history: Mapping[str, Sequence[Sequence[float]]] | None = None,
    unlike_load: str | None = None,
    relative: Mapping[str, float] | None = None,
) -> tuple[LaneVerdict, ...]:
    """Turn raw measurements into per-lane verdicts (the canary is judged against the stable).

    ``slices``: bad events and requests per sub-window of this window by (track, lane,
    metric) (:func:`slice_counts`); ``history``: the canary's tally so far
    (``status.rollout.evidence``, keyed by :func:`tally_key`), which this window's slices
    extend. The verdict is on the tally (:func:`judge`). ``unlike_load``: why this step's
    canary pods are not fed like the stable's (``fairness.unlike_load``); the relative
    objective, which compares the canary's p99 with the stable's, then passes saying so.
    ``relative``: its thresholds by lane key, when the caller has them
    (:func:`relative_thresholds` of these measurements otherwise)."""
    sl = pooled(slices or {}, history or {})
    min_samples = spec.rollout.min_samples
    if relative is None:
        relative = relative_thresholds(spec, lane_queries, measurements)
    by_lane: dict[str, dict[str, list[MetricCheck]]] = {}
    for lq in lane_queries:
        thresholds = lane_thresholds(spec, lq.lane)
        budgets = lane_budgets(spec, lq.lane)
        checks = by_lane.setdefault(lq.key, {"canary": [], "stable": []})
        for metric in judged_metrics(spec):
            checks[lq.track].append(
                check_metric(
                    queries=lq,
                    metric=metric,
                    measurements=measurements,
                    threshold=relative.get(lq.key, math.inf) if objective(metric).relative else thresholds[metric],
                    min_samples=min_samples,
                    budget=budgets[metric],
                    # a lane's total thin in this window is judged on its tally; a tenant slice
                    # thin in the window stays thin, counted for nothing (LaneVerdict), as
                    # docs/tenants.md promises a tenant that sends little
                    tally=sl.get((lq.track, lq.key, metric)) if lq.tenant is None else None,
                )
            )

    def lane_verdict(lane: str, tenant: str | None, confidence: float) -> LaneVerdict | None:
        key = lane_key(lane, tenant)
        lane_checks = by_lane.get(key)
        if lane_checks is None:
            return None
        stable = tuple(lane_checks["stable"])
        needed = sequential_needed(spec, tenant is not None)
        canary = tuple(
            _uncompared(c, unlike_load, tenant is None and _stable_thin(stable, min_samples))
            if objective(c.metric).relative and (unlike_load is not None or key not in relative)
            else (judge_client_errors if objective(c.metric).stable_only else judge)(
                c,
                next((s for s in stable if s.metric == c.metric), None),
                confidence,
                sl.get(("canary", key, c.metric)),
                sl.get(("stable", key, c.metric)),
                (history or {}).get(sequential_key(key, c.metric)),
                needed,
            )
            for c in lane_checks["canary"]
        )
        if tenant is None:
            outcome = combine([c.outcome for c in canary])
        else:  # a thin objective of a slice counts for nothing (LaneVerdict)
            counted = [c.outcome for c in canary if not c.thin]
            outcome = combine(counted) if counted else Outcome.INCONCLUSIVE
        return LaneVerdict(lane=lane, outcome=outcome, canary=canary, stable=stable, tenant=tenant)

    def judged_slices(lane: str) -> list[str]:
        """The lane's tenant slices with enough canary requests to judge some objective."""
        return [
            t
            for t in spec.tenant_slices
            if (checks := by_lane.get(lane_key(lane, t))) is not None and not all(c.thin for c in checks["canary"])
        ]

    result = []
    for lane in spec.lanes:
        total = lane_verdict(lane.name, None, spec.rollout.confidence)
        if total is None:
            continue
        per_slice = slice_confidence(spec.rollout.confidence, len(judged_slices(lane.name)))
        parts = tuple(v for t in spec.tenant_slices if (v := lane_verdict(lane.name, t, per_slice)) is not None)
        judged = [v.outcome for v in parts if not v.thin]
        result.append(
            dataclasses.replace(
                total, slices=parts, outcome=combine([total.outcome, *judged]) if judged else total.outcome
            )
        )
    return tuple(result)


def run_analysis(
    backend: MetricsBackend,
    spec: PolicySpec,
    *,
    policy: str,
    namespace: str,
    canary_revision: str,
    stable_revision: str | None,
    now: datetime,
    history: Mapping[str, Sequence[Sequence[float]]] | None = None,
    environment: str | None = None,
    unlike_load: str | None = None,
) -> AnalysisResult:
    """Query the backend for every lane of both tracks, over the window and each of its
    sub-windows, and judge the canary on its tally (``history`` extended by this window);
    ``unlike_load``: see :func:`verdicts`."""
    lane_queries = plan_queries(
        spec,
        policy=policy,
        namespace=namespace,
        canary_revision=canary_revision,
        stable_revision=stable_revision,
        environment=environment,
    )
    at = now.timestamp()
    # dict.fromkeys: a relative objective reads the same series as the SLO's, asked once
    measurements = backend.measure(list(dict.fromkeys(q for lq in lane_queries for q in lq.all())), at=at)
    counters = counter_queries(lane_queries, policy=policy, namespace=namespace)
    raw = list(dict.fromkeys(q for cq in counters for q in (cq.requests, cq.bad)))
    step = spec.rollout.analysis_interval / SLICES
    boundaries = [backend.measure(raw, at=at - j * step) for j in reversed(range(SLICES + 1))]
    totals: dict[SliceKey, float] = {
        (lq.track, lq.key, mq.metric): measurements[mq.samples].value or 0.0
        for lq in lane_queries
        for mq in lq.metrics
        if mq.samples in measurements and measurements[mq.samples].error is None
    }
    relative = relative_thresholds(spec, lane_queries, measurements)
    counts = slice_counts(spec, counters, boundaries, totals, relative)
    lanes = verdicts(spec, lane_queries, measurements, counts, history, unlike_load, relative)
    return AnalysisResult(
        time=now,
        window=promql_window(spec.rollout.analysis_interval),
        canary_revision=canary_revision,
        stable_revision=stable_revision,
        lanes=lanes,
        tally={
            **next_tally(counts, history or {}),
            **sequential_evidence(lanes),
            **compared_evidence(_compared(lanes, at) if unlike_load is None else {}, history or {}),
        },
    )


def _compared(lanes: Sequence[LaneVerdict], at: float) -> dict[str, ComparedWindow]:
    """This window's lanes (totals) whose relative objective compared the canary's p99 with the
    stable's: a finite threshold, the stable's histogram, canary requests (``power`` states what
    the gate can see from the step's such windows)."""
    out: dict[str, ComparedWindow] = {}
    for lane in lanes:
        c, s = lane.check("p99Increase"), lane.check("p99Increase", "stable")
        if c is None or s is None or not s.buckets or not c.samples or not math.isfinite(c.threshold):
            continue
        out[lane_key(lane.lane, None)] = ComparedWindow(at, c.threshold, c.samples, s.buckets)
    return out


NO_STABLE_P99 = (
    "no stable p99 to compare with in this window (fewer than minSamples stable requests, or beyond the"
    " largest bucket): judged on the SLOs alone"
)


def relative_thresholds(
    spec: PolicySpec, lane_queries: Sequence[LaneQueries], measurements: Mapping[str, Measurement]
) -> dict[str, float]:
    """Lane key -> this window's threshold of the relative objective (``rollout.maxP99Increase``
    times the stable's p99, :func:`.objectives.relative_threshold`), for the lanes and tenant
    slices whose stable p99 comes from at least ``minSamples`` requests: a p99 of fewer is
    one of its few slowest requests, no baseline. Empty when the policy sets no relative objective."""
    out: dict[str, float] = {}
    if spec.rollout.max_p99_increase is None:
        return out
    for lq in lane_queries:
        if lq.track != "stable":
            continue
        mq = lq.metric("p99Latency")
        value, samples = measurements.get(mq.value), measurements.get(mq.samples)
        if value is None or samples is None or value.error or samples.error:
            continue
        if (samples.value or 0.0) < spec.rollout.min_samples:
            continue
        threshold = relative_threshold(spec, value.value)
        if threshold is not None:
            out[lq.key] = threshold
    return out


STABLE_TOO_THIN = (
    "no stable p99 to compare with: fewer than minSamples stable requests in this window; the window neither"
    " passes the step nor holds it"
)


def _stable_thin(stable: Sequence[MetricCheck], min_samples: int) -> bool:
    """Whether the stable track was measured in this window but has fewer than ``minSamples``
    requests for a p99 (a quiet window; not a stable without a track or beyond the largest bucket)."""
    lat = next((s for s in stable if s.metric == "p99Latency"), None)
    return lat is not None and lat.outcome is not Outcome.ERROR and (lat.samples or 0.0) < min_samples


def _uncompared(check: MetricCheck, unlike_load: str | None, quiet: bool) -> MetricCheck:
    """A relative objective's canary check without a stable p99 to compare with: at a step that
    feeds the canary unlike the stable, or without a stable baseline, it passes saying why (the
    SLOs still gate it); in a lane's quiet window (``quiet``: the stable measured, under
    ``minSamples``) it waits for one that compares (:func:`_unjudged`)."""
    if unlike_load is not None:
        return _not_compared(check, unlike_load)
    return _unjudged(check, STABLE_TOO_THIN) if quiet else _not_compared(check, NO_STABLE_P99)


def _unjudged(check: MetricCheck, why: str) -> MetricCheck:
    """A lane's relative objective in a window whose stable is too quiet for a p99: Inconclusive
    and thin, counted for nothing. Passing it instead promoted a canary on a window that compared
    nothing, after busier windows had Failed it once (docs/canary-analysis.md "Quiet windows");
    the step is passed by a window that compares, and a quiet one does not take that pass back.
    A check that could not be measured stays so."""
    if check.outcome is Outcome.ERROR:
        return check
    return dataclasses.replace(check, outcome=Outcome.INCONCLUSIVE, note=None, unjudged=why)


def _not_compared(check: MetricCheck, why: str) -> MetricCheck:
    """A relative objective's canary check that is not compared with the stable's p99 (none of
    enough requests, or a step that feeds the canary unlike the stable): passes, saying ``why``
    (the lane's SLOs still gate it); one that could not be measured, or is thin, stays so."""
    if check.outcome in (Outcome.ERROR, Outcome.INCONCLUSIVE):
        return check
    return dataclasses.replace(check, outcome=Outcome.SUCCESSFUL, note=why)


def sequential_evidence(lanes: Sequence[LaneVerdict]) -> dict[str, list[list[float]]]:
    """The rollout's sequential evidence after this analysis, by :func:`tally.sequential_key`,
    of every objective this window extended (the others keep theirs: ``next_tally``)."""
    out: dict[str, list[list[float]]] = {}
    for lane in lanes:
        for v in (lane, *lane.slices):
            for c in v.canary:
                if c.sequential is not None:
                    key = sequential_key(lane_key(v.lane, v.tenant), c.metric)
                    out[key] = [[round(x, 4) for x in part] for part in c.sequential]
    return out
