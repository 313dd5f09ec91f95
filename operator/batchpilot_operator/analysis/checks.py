"""One objective of one lane of one track: its check from the raw measurements
(:func:`check_metric`) and the canary's verdict against the stable and its budget
(:func:`judge`, :func:`judge_client_errors`), with the evidence in words (:meth:`MetricCheck.describe`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from batchpilot_operator.analysis.backend import Measurement, finite, not_nan
from batchpilot_operator.analysis.objectives import (
    P99_BUDGET,
    MetricName,
    Outcome,
    Track,
    format_confidence,
    format_share,
    format_value,
    judged_metrics,
    objective,
)
from batchpilot_operator.analysis.queries import LaneQueries
from batchpilot_operator.analysis.tally import SLICES
from batchpilot_operator.spec import PolicySpec
from batchpilot_operator.stats import (
    Slices,
    accumulate,
    binomial_sf,
    burst_variance,
    clustered_greater,
    clustered_over_budget,
    count_above,
    design_effect,
    e_value,
    fisher_greater,
    log_lr_over_budget,
    log_lr_worse,
    rate_variance,
)

SHARED_BREACH_RATIO = 2.0
"""When the stable breaches too, the canary is blamed only if at least this many times as bad."""


@dataclass(frozen=True)
class MetricCheck:
    """One metric of one lane of one track: the evidence and its outcome.

    ``bad`` is the number of bad events among ``samples`` requests (over the threshold, or
    errors) and ``budget`` the fraction the objective allows. For a canary check that
    breached, ``confidence_over_budget`` and ``confidence_worse`` are the confidences of the
    two tests of the verdict (``None``: not run, e.g. no usable stable), and ``stable`` the
    stable track's check it was compared with.
    """

    track: Track
    revision: str
    lane: str
    metric: MetricName
    query: str
    samples_query: str
    value: float | None
    samples: float | None
    threshold: float
    outcome: Outcome
    error: str | None = None
    note: str | None = None
    """Why the outcome is not the plain SLO comparison (a breach not attributed to the canary)."""
    bad: float | None = None
    budget: float = P99_BUDGET
    confidence_over_budget: float | None = None
    confidence_worse: float | None = None
    stable: MetricCheck | None = None
    tally: tuple[float, float] | None = None
    """(bad events, requests) the verdict was on: this window's and the earlier analyses'."""
    stable_tally: tuple[float, float] | None = None
    shared_breach: bool = False
    """Inconclusive because the stable's tally breaches too, or sits at the budget (not
    clearly under it), and the canary is not clearly worse: a burst or an overload both
    tracks see, or a system at its SLO, not the canary."""
    tenant: str | None = None
    """The tenant slice this check is of (None: the lane's total)."""
    codes: tuple[tuple[str, float], ...] | None = None
    """clientErrors: the rejected requests by status code over the window."""
    buckets: tuple[tuple[float, float], ...] | None = None
    """p99Latency and queueAge: the window's cumulative histogram ``(le, count)`` (``power``)."""
    burstiness: float | None = None
    """How bursty the stable's bad events of this objective are over the tally's sub-windows,
    at least as bursty as its traffic (:func:`stats.burst_variance`, :func:`stats.rate_variance`;
    None without sub-windows): what the sub-window test discounts a burst by, and so what the
    gate can see (``power``)."""
    sequential: tuple[tuple[float, ...], tuple[float, ...]] | None = None
    """The rollout's evidence after this window (:func:`judge`): per alternative, the log
    likelihood ratios over every analysed window of the rollout that the canary is over its
    budget, and that it is worse than the stable (``stats.log_lr_over_budget``, ``stats.log_lr_worse``)."""
    evidence_needed: float | None = None
    """The e-value a failure needs (:func:`sequential_needed`; None: no sequential gate)."""
    unjudged: str | None = None
    """Why this window could not judge the objective although the canary has requests enough
    (the relative objective without a stable p99 of ``minSamples`` requests): Inconclusive and
    :attr:`thin`, so it neither passes the step nor takes a pass back; said in :meth:`describe`."""

    @property
    def e_over_budget(self) -> float | None:
        return e_value(self.sequential[0]) if self.sequential is not None else None

    @property
    def e_worse(self) -> float | None:
        return e_value(self.sequential[1]) if self.sequential is not None else None

    @property
    def evidence(self) -> float | None:
        """The e-value the sequential gate reads (:func:`judge`): that the canary is worse than
        the stable where one was compared, that it is over its budget otherwise, and always for
        a relative objective (:func:`_gates_on_budget`)."""
        if self.confidence_worse is None or _gates_on_budget(self):
            return self.e_over_budget
        return self.e_worse

    @property
    def thin(self) -> bool:
        """Too few requests (or none) to judge: Inconclusive with no breach to report."""
        return self.outcome is Outcome.INCONCLUSIVE and self.note is None

    @property
    def bad_fraction(self) -> float | None:
        if self.bad is None or not self.samples:
            return None
        return min(1.0, self.bad / self.samples)

    def breaches(self) -> bool:
        """More bad events than the budget allows (the point estimate; no test)."""
        frac = self.bad_fraction
        return frac is not None and frac > self.budget

    def describe(self) -> str:
        """The check in words on-call reads (Events, ledger, ``kubectl batchpilot``)."""
        where = f"lane {self.lane}" + (f" tenant {self.tenant}" if self.tenant is not None else "")
        head = f"{where} {objective(self.metric).label}"
        if self.outcome is Outcome.ERROR:
            return f"{head}: query error ({self.error})"
        if objective(self.metric).stable_only:
            return self._describe_rejected(where)
        threshold = format_value(self.metric, self.threshold)
        value = "no data" if self.value is None else format_value(self.metric, self.value)
        samples = "0" if self.samples is None else f"{self.samples:.0f}"
        if self.samples is None or self.value is None or self.bad_fraction is None:
            return f"{head}: no data from {samples} requests"
        if self.outcome is Outcome.INCONCLUSIVE and self.note is None:
            return f"{head}: {value} from {samples} requests " + (
                f"({self.unjudged})" if self.unjudged else "(too few)"
            )
        if self.outcome is Outcome.SUCCESSFUL and self.note is not None:
            return f"{head}: {value} from {samples} requests; {self.note}"
        if self.outcome is Outcome.SUCCESSFUL:
            if self.value > self.threshold and self.tally is not None:
                k, n = self.tally
                return (
                    f"{head}: {value} > {threshold} in this window, but {format_share(k / n if n else 0.0)} of "
                    f"{n:.0f} requests of the tally {objective(self.metric).bad}: within the {format_share(self.budget)} budget"
                )
            earlier = ""
            if self.tally is not None and self.tally[1] > (self.samples or 0) + 0.5:
                earlier = f", {self.tally[1]:.0f} with the earlier analyses"  # what a thin window is judged on
            return f"{head}: {value} <= {threshold} ({samples} requests{earlier})"
        stable = self.stable
        vs = ""
        if stable is not None and stable.value is not None and stable.bad_fraction is not None:
            vs = f" vs stable {format_value(self.metric, stable.value)}"
        k, n = self.tally or (self.bad or 0.0, self.samples or 0.0)
        share = f"{format_share(k / n if n else 0.0)} of {n:.0f} requests {objective(self.metric).bad}"
        if self.stable_tally is not None:
            ks, ns = self.stable_tally
            share += f" vs {format_share(ks / ns if ns else 0.0)} of {ns:.0f} on stable"
        elif stable is not None and stable.bad_fraction is not None:
            share += f" vs {format_share(stable.bad_fraction)} of {stable.samples or 0:.0f} on stable"
        if self.tally is not None and self.tally[1] > (self.samples or 0) + 0.5:
            share += " (this and earlier analyses)"
        text = f"{head}: canary {value} > {threshold}{vs}; {share}"
        tests = []
        if self.confidence_worse is not None:
            tests.append(f"worse than stable with {format_confidence(self.confidence_worse)} confidence")
        if self.confidence_over_budget is not None:
            tests.append(
                f"over its {format_share(self.budget)} budget with {format_confidence(self.confidence_over_budget)}"
                " confidence"
            )
        if tests:
            text += "; " + ", ".join(tests)
        if self.note:
            text += f"; {self.note}"
        elif self.outcome is Outcome.FAILED:
            text += self._describe_evidence()
        return text

    def _describe_evidence(self) -> str:
        """A failure's sequential evidence in words: what it reached against what it needed."""
        e = self.evidence
        if self.evidence_needed is None or e is None:
            return ""
        return f"; the rollout's evidence {e:.3g} >= the {self.evidence_needed:.0f} a rollback needs"

    def _describe_rejected(self, where: str) -> str:
        """The 4xx comparison in words: ``lane x tenant b: rejected 100% (400) of 120 requests vs stable 0% of 300``."""
        k, n = self.tally or (self.bad or 0.0, self.samples or 0.0)
        if self.samples is None or self.bad is None or n <= 0:
            return f"{where}: rejected (4xx) no data from {self.samples or 0:.0f} requests"
        codes = ", ".join(code for code, count in sorted(self.codes or ()) if count > 0)
        text = f"{where}: rejected {format_share(k / n)}" + (f" ({codes})" if codes else "") + f" of {n:.0f} requests"
        if self.stable_tally is not None:
            ks, ns = self.stable_tally
            text += f" vs stable {format_share(ks / ns if ns else 0.0)} of {ns:.0f}"
        elif self.stable is not None and self.stable.bad_fraction is not None:
            text += f" vs stable {format_share(self.stable.bad_fraction)} of {self.stable.samples or 0:.0f}"
        if self.tally is not None and self.tally[1] > (self.samples or 0) + 0.5:
            text += " (this and earlier analyses)"
        if self.outcome is Outcome.INCONCLUSIVE and self.note is None:
            return text + " (too few)"
        if self.confidence_worse is not None and self.outcome is not Outcome.SUCCESSFUL:
            text += f"; worse than stable with {format_confidence(self.confidence_worse)} confidence"
        if self.note:
            text += f"; {self.note}"
        elif self.outcome is Outcome.FAILED:
            text += self._describe_evidence()
        return text


def _bad_events(metric: MetricName, m: Measurement, threshold: float, samples: float | None) -> float | None:
    """Bad events from the ``bad`` query: the count over ``threshold`` from buckets, or errors."""
    histogram = not objective(metric).counted
    bad = (count_above(m.buckets, threshold) if m.buckets else None) if histogram else finite(m.value)
    if bad is None or samples is None:
        return bad
    return min(bad, samples)


def check_metric(
    *,
    queries: LaneQueries,
    metric: MetricName,
    measurements: Mapping[str, Measurement],
    threshold: float,
    min_samples: int,
    budget: float = P99_BUDGET,
    tally: Slices | None = None,
) -> MetricCheck:
    """One track's metric from its raw measurements, judged on its own (no comparison yet):
    Error, Inconclusive (too few samples or no data), Failed (over budget) or Successful.

    ``tally``: the track's pooled sub-windows (this window's and the earlier analyses' that fed
    the canary alike, :func:`tally.pooled`). A window with fewer than ``minSamples`` requests
    whose tally holds ``minSamples`` is not too few: :func:`judge` runs on the tally's counts
    anyway. Without this, a canary fed less than ``minSamples`` per window (the shipped gateway
    example's 10% step at 30 req/s: about 85 requests in 30 s) was never judged at all: a bad
    change served its share until two windows happened to reach 100, a good one could not pass.
    The sequential gate bounds the false-rollback rate however thin each look is. A window
    without a request on the track stays thin: it has nothing to add."""
    mq = queries.metric(metric)
    missing = "not measured"
    value_m = measurements.get(mq.value, Measurement(mq.value, error=missing))
    samples_m = measurements.get(mq.samples, Measurement(mq.samples, error=missing))
    bad_m = measurements.get(mq.bad, Measurement(mq.bad, error=missing))
    value = not_nan(value_m.value)
    samples = finite(samples_m.value)
    error = value_m.error or samples_m.error or bad_m.error
    bad = None if error else _bad_events(metric, bad_m, threshold, samples)
    codes = measurements.get(mq.codes) if mq.codes is not None else None
    check = MetricCheck(
        track=queries.track,
        revision=queries.revision,
        lane=queries.lane,
        metric=metric,
        query=mq.value,
        samples_query=mq.samples,
        value=value,
        samples=samples,
        threshold=threshold,
        outcome=Outcome.SUCCESSFUL,
        error=error,
        bad=bad,
        budget=budget,
        tenant=queries.tenant,
        codes=codes.groups if codes is not None and codes.error is None else None,
        buckets=bad_m.buckets if not objective(metric).counted and error is None else None,
    )
    if error is not None:
        outcome = Outcome.ERROR
    elif samples is None or value is None or bad is None or not _enough(samples, tally, min_samples):
        outcome = Outcome.INCONCLUSIVE
    elif check.breaches():
        outcome = Outcome.FAILED
    else:
        outcome = Outcome.SUCCESSFUL
    return dataclasses.replace(check, outcome=outcome)


def _enough(samples: float, tally: Slices | None, min_samples: int) -> bool:
    """``minSamples`` requests in the window, or in its tally when the window has any."""
    return samples >= min_samples or (samples > 0 and tally is not None and _totals(tally)[1] >= min_samples)


def _least(*confidences: float | None) -> float | None:
    known = [c for c in confidences if c is not None]
    return min(known) if known else None


def judge(
    canary: MetricCheck,
    stable: MetricCheck | None,
    confidence: float,
    canary_slices: Slices | None = None,
    stable_slices: Slices | None = None,
    earlier: Sequence[Sequence[float]] | None = None,
    needed: float | None = None,
) -> MetricCheck:
    """The canary's verdict on one objective: its tally against the stable's and its budget.

    ``canary`` and ``stable`` are this window's checks (:func:`check_metric`); a canary check
    that is Error or Inconclusive (too few requests in this window) stays so. ``*_slices``
    are (bad events, requests) per sub-window of the tally (without them, this window's
    counts). Successful when the tallied bad share is within the budget; Failed when it is
    not and the canary is worse than a usable stable with ``confidence`` (no usable stable:
    over its budget with ``confidence``); otherwise Inconclusive with the reason in ``note``.
    Each confidence is the lesser of the exact test and the sub-window test (module doc).

    ``earlier`` is the rollout's evidence before this window (:attr:`MetricCheck.sequential`),
    which this window's counts extend whatever its outcome; with ``needed``, a failure also
    needs the e-value that the canary is worse than the stable (over its budget, where no
    stable was compared) to be at least ``needed``: the sequential gate that bounds the
    false-rollback rate over the whole rollout (:func:`sequential_needed`,
    :func:`_short_of_evidence`). Short of it: Inconclusive, with the evidence so far.
    """
    if canary.outcome in (Outcome.ERROR, Outcome.INCONCLUSIVE) or canary.bad is None or canary.samples is None:
        return canary
    burstiness = _burstiness(stable_slices) if stable_slices else None
    sequential = _extend(canary, stable, earlier, burstiness or 0.0)
    k_c, n_c = _totals(canary_slices) if canary_slices else (canary.bad, canary.samples)
    if n_c <= 0 or k_c / n_c <= canary.budget:
        return dataclasses.replace(
            canary,
            outcome=Outcome.SUCCESSFUL,
            tally=(k_c, n_c),
            burstiness=burstiness,
            sequential=sequential,
            evidence_needed=needed,
        )
    over = _least(
        1.0 - binomial_sf(k_c, n_c, canary.budget),
        clustered_over_budget(canary_slices, canary.budget) if canary_slices else None,
    )
    assert over is not None
    worse: float | None = None
    stable_tally: tuple[float, float] | None = None
    paired = stable_slices if canary_slices and stable_slices and len(stable_slices) == len(canary_slices) else None
    if _baseline(stable, paired, confidence):
        assert stable is not None and stable.bad is not None and stable.samples is not None
        k_s, n_s = _totals(paired) if paired else (stable.bad, stable.samples)
        k_c_, n_c_ = (k_c, n_c) if paired else (canary.bad, canary.samples)
        stable_tally = (k_s, n_s)
        worse = _least(
            1.0 - fisher_greater(k_c_, n_c_, k_s, n_s),
            clustered_greater(canary_slices, paired) if canary_slices and paired else None,
        )
    note = None
    stable_share = stable_tally[0] / stable_tally[1] if stable_tally is not None and stable_tally[1] > 0 else 0.0
    shared = stable_tally is not None and stable_share > canary.budget
    # A canary not clearly worse than the stable passes the step where the stable breaches too,
    # and also where the stable sits at its budget: not clearly under it, with requests enough
    # that a clean stable would be (a thinner stable says nothing either way: its point share
    # decides, as before). The line between a stable at 1.02% (shared) and 0.98% (the canary's
    # 1.1% held the step) is noise, and a healthy canary beside a stable at its SLO held on it
    # window after window until the rollout stalled (docs/traffic-routing.md). Not for a
    # relative objective: the stable's share over its threshold is under the budget by
    # construction.
    at_budget = shared or (
        stable_tally is not None
        and not _gates_on_budget(canary)
        and _clearly_under(0.0, stable_tally[1], canary.budget, confidence)
        and not _clearly_under(stable_tally[0], stable_tally[1], canary.budget, confidence)
    )
    needs = f"needs {format_confidence(confidence)} confidence"
    # Far worse by the point estimate, but not clearly (its bad events in few bursts, or too
    # few windows yet): nothing a shared burst explains, so it holds the step instead of
    # passing it. On on/off traffic a model 20% slower had 29% of its requests over the SLO
    # against the stable's 1.6%, all in the one ON burst of the window; the sub-window test
    # cannot pin one burst on it, the breach counted as shared, and a quiet window after it
    # promoted the canary: 3 of the 8 in 100 simulated rollouts that promoted it (bench/canary_eval.py
    # --explain; the other 5 met only quiet windows).
    far_worse = k_c / n_c > SHARED_BREACH_RATIO * max(stable_share, canary.budget)
    if worse is None and over < confidence:
        note = f"a breach this thin is not conclusive ({needs})"
    elif worse is not None and worse < confidence and at_budget and far_worse:
        note = (
            f"{format_share(k_c / n_c)} of the canary's requests against the stable track's "
            f"{format_share(stable_share)}, which is at its budget too: over {SHARED_BREACH_RATIO:g}x as bad, "
            f"not clearly yet ({needs}); "
            "the step waits for windows that pin it on the canary or clear it"
        )
    elif worse is not None and worse < confidence:
        if shared:
            note = "the stable track breaches too: not clearly the canary's doing"
        elif at_budget:
            note = (
                f"the stable track sits at its {format_share(canary.budget)} budget too "
                f"({format_share(stable_share)}, not clearly under it): not clearly the canary's doing"
            )
        else:
            note = "not clearly worse than the stable track"
        note += f" ({needs})"
    elif shared and k_c / n_c < SHARED_BREACH_RATIO * stable_share:
        note = (
            f"the stable track breaches too ({format_share(stable_share)}): the canary is worse, but not "
            f"{SHARED_BREACH_RATIO:g}x as bad, as a bad change would be in a burst or overload both tracks see"
        )
    elif over < confidence:
        # Both halves of the rule are tested (an intersection-union test: each at the
        # confidence, so the pair is too): worse than the stable, and over the budget.
        note = f"worse than the stable track, but not clearly over its {format_share(canary.budget)} budget ({needs})"
    elif needed is not None:
        note = _short_of_evidence(sequential, needed, compared=worse is not None and not _gates_on_budget(canary))
    return dataclasses.replace(
        canary,
        sequential=sequential,
        evidence_needed=needed,
        outcome=Outcome.FAILED if note is None else Outcome.INCONCLUSIVE,
        note=note,
        confidence_over_budget=over,
        confidence_worse=worse,
        stable=stable,
        tally=(k_c, n_c),
        stable_tally=stable_tally,
        shared_breach=at_budget and worse is not None and worse < confidence and not far_worse,
        burstiness=burstiness,
    )


def _extend(
    canary: MetricCheck, stable: MetricCheck | None, earlier: Sequence[Sequence[float]] | None, burstiness: float
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The rollout's evidence with this window's counts: over the budget from the canary's
    requests, worse than the stable from both tracks' (none from a stable without counts).

    Bursty traffic is discounted as the sub-window test counts it: a track's requests are worth
    ``n / D`` independent ones (:func:`stats.design_effect` at the stable's burstiness). ``D``
    is taken at the null's share of bad events (the stable's; the budget without a stable), not
    at the canary's: a bad canary's own large share would inflate ``D`` and discount away the
    very evidence against it (the demo's bad change was held in 14% of simulated rollouts on
    the code trace with 2 replicas on a route)."""
    k_c, n_c = canary.bad or 0.0, canary.samples or 0.0
    over = log_lr_over_budget(k_c, n_c, canary.budget, design_effect(burstiness, canary.budget, n_c / SLICES))
    worse = log_lr_worse(0.0, 0.0, 0.0, 0.0)
    if stable is not None and stable.outcome is not Outcome.ERROR and stable.bad is not None and stable.samples:
        k_s, n_s = stable.bad, stable.samples
        share = k_s / n_s
        discount = max(design_effect(burstiness, share, n / SLICES) for n in (n_c, n_s))
        worse = log_lr_worse(k_c, n_c, k_s, n_s, discount)
    before_over, before_worse = (tuple(earlier[0]), tuple(earlier[1])) if earlier and len(earlier) == 2 else ((), ())
    return accumulate(before_over, over), accumulate(before_worse, worse)


def _clearly_under(k: float, n: float, budget: float, confidence: float) -> bool:
    """Whether ``k`` bad events in ``n`` requests are under ``budget`` with ``confidence``:
    as few would be seen at the budget itself less than ``1 - confidence`` of the time (the
    exact binomial test; no requests: not clearly anything)."""
    if n <= 0:
        return False
    return 1.0 - binomial_sf(k + 1, n, budget) < 1.0 - confidence


def _gates_on_budget(check: MetricCheck) -> bool:
    """Whether the sequential gate reads the evidence that the canary is over its budget even
    where it was compared with the stable: a relative objective's budget *is* the comparison
    (over 1% of the canary's requests slower than ``1 + maxP99Increase`` times the stable's
    p99: its p99 beyond that factor), and the stable's own share over that threshold is under
    1% by construction, so "worse than the stable" is the easier half there: a canary a little
    slower than the stable, well inside the allowance, shows it, and the over-budget half would
    be left to the per-look test alone, which bounds nothing across looks."""
    return objective(check.metric).relative


def _short_of_evidence(
    sequential: tuple[tuple[float, ...], tuple[float, ...]], needed: float, *, compared: bool
) -> str | None:
    """Why a canary this window would fail is not failed yet: the rollout's evidence is short
    of ``needed`` (None when it is not). Compared with a stable, the evidence that it is worse
    than the stable decides: a change no worse than the stable (A/A, a faster model) is the
    good change the bound is for, and that evidence does not fade in quiet windows (no bad
    events on either track: a likelihood ratio of 1), where a shared burst makes both tracks
    over budget alike. Without a stable, the evidence that it is over its budget does."""
    e = e_value(sequential[1] if compared else sequential[0])
    if e >= needed:
        return None
    what = "worse than the stable" if compared else "over its budget"
    return (
        f"the rollout's evidence that it is {what} is {e:.3g} so far, of the {needed:.0f} a rollback needs"
        f" (at most {format_share(1.0 / needed)} of good changes rolled back per objective)"
    )


def sequential_needed(spec: PolicySpec, tenant: bool) -> float:
    """The e-value a failure of one objective needs, so that a good change is rolled back by
    chance in at most ``1 - rollout.confidence`` of rollouts, however many analyses it takes.

    The evidence starts afresh at each step (``rollout.steps``: a change that breaks only at
    a larger weight is not held back by the healthy windows of a smaller one), so the rate is
    split evenly (Bonferroni) over the steps and over every objective of every lane; when the
    policy declares tenant slices, half of it goes to the lanes' totals and half to their
    slices, shared evenly among them."""
    objectives = len(spec.rollout.steps) * len(spec.lanes) * len(judged_metrics(spec))
    alpha = (1.0 - spec.rollout.confidence) / max(1, objectives)
    if spec.tenant_slices:
        alpha /= 2.0
        if tenant:
            alpha /= len(spec.tenant_slices)
    return 1.0 / alpha


def slice_confidence(confidence: float, judged: int) -> float:
    """The confidence each of ``judged`` tenant slices of a lane is held to: the lane's
    ``1 - confidence`` split evenly among them (Bonferroni; for "does any slice fail", which is
    all the lane's outcome asks, Holm's step-down test rejects exactly when this does).

    Each slice is another chance for chance alone to fail a good canary: with 9 slices each
    at the lane's own 0.95, simulated A/A rollouts on on/off traffic rolled back 7 of 400 with
    slices against 2 of 400 without (``bench/canary_eval.py --tenants both``). The lane's total
    keeps ``confidence``: the slices together add at most ``1 - confidence`` to its
    false-failure rate per analysis, whatever their number."""
    if judged <= 1:
        return confidence
    return 1.0 - (1.0 - confidence) / judged


def _burstiness(slices: Slices) -> float | None:
    """The stable's burstiness over the tally (``power``): that of its bad events, floored by
    that of its traffic (:func:`stats.burst_variance`, :func:`stats.rate_variance`)."""
    return max((v for v in (burst_variance(slices), rate_variance(slices)) if v is not None), default=None)


def _baseline(stable: MetricCheck | None, paired: Slices | None, confidence: float) -> bool:
    """Whether the stable's check is a baseline to compare the canary with.

    A stable with enough requests in the window is one. A *thin* stable (measured, but fewer
    than ``minSamples`` requests: a tenant slice the canary's pods happened to get most of) is
    one only when its own tally breaches the budget with ``confidence`` (the exact binomial
    test): the breach is then established on the stable too, and failing the canary on its
    budget alone would pin on it what both tracks show (``make demo``: a slice 16% slow on the
    canary against 42% of 93 requests on the stable was rolled back). A thin stable that does
    not show a breach is no evidence either way: the budget test decides, as with no stable.
    """
    if stable is None or stable.outcome is Outcome.ERROR or stable.bad is None or not stable.samples:
        return False
    if stable.outcome is not Outcome.INCONCLUSIVE:
        return True
    k_s, n_s = _totals(paired) if paired else (stable.bad, stable.samples)
    return n_s > 0 and k_s / n_s > stable.budget and 1.0 - binomial_sf(k_s, n_s, stable.budget) >= confidence


NO_STABLE_4XX = "no stable track with enough requests to compare with: 4xx are taken as the clients' own"


def judge_client_errors(
    canary: MetricCheck,
    stable: MetricCheck | None,
    confidence: float,
    canary_slices: Slices | None = None,
    stable_slices: Slices | None = None,
    earlier: Sequence[Sequence[float]] | None = None,
    needed: float | None = None,
) -> MetricCheck:
    """The verdict on the canary's 4xx share: :func:`judge` with a zero budget, so any 4xx is a
    "breach" that fails only when the canary rejects more than the stable with ``confidence``
    (Fisher's one-sided test and the sub-window test), and, when the stable rejects some too
    (clients sending bad requests to both), only at :data:`SHARED_BREACH_RATIO` times its
    share: 4xx both tracks return alike stay the clients' fault. Without a usable stable
    (none, too few requests, its queries failing) there is nothing to tell a client's mistake
    from the canary's: Successful, with that said in ``note``."""
    usable = stable is not None and stable.outcome not in (Outcome.ERROR, Outcome.INCONCLUSIVE)
    if usable or canary.outcome in (Outcome.ERROR, Outcome.INCONCLUSIVE) or canary.bad is None:
        return judge(canary, stable, confidence, canary_slices, stable_slices, earlier, needed)
    return dataclasses.replace(canary, outcome=Outcome.SUCCESSFUL, note=NO_STABLE_4XX if canary.bad else None)


def _totals(slices: Slices) -> tuple[float, float]:
    return sum(k for k, _ in slices), sum(n for _, n in slices)
