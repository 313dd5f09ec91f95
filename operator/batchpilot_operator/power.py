"""What the canary gate can see: the smallest p99 regression and the smallest error rate a
rollout detects. Pure.

A gate that cannot see a regression passes it blind, so ``kubectl batchpilot status`` says,
per lane and from the last analysis, "this rollout detects a p99 regression of X% or more at
the current traffic". X comes from the verdict's own rule (``analysis.judge``) applied to the
counts the regression would produce:

* A regression by a factor ``f`` is the stable's latencies, each ``f`` times longer (a model
  that slows every request alike; queueing makes a real slowdown worse than that, so X is on
  the safe side). The canary's share of requests over the SLO is then the stable's share over
  ``SLO / f``, read from the stable's latency histogram of the window (the runtime's buckets,
  interpolated inside a bucket as ``histogram_quantile`` does).
* Over the tally that can promote the canary (the analyses its last like-for-like steps
  gather, at most :data:`analysis.TALLY_ANALYSES`, at this window's traffic, the canary's and
  the stable's requests each: ``fairness.gating_analyses``; or the requests the canary's tally
  already holds, where that is more: :func:`tally_scale`), the regression is detected when
  the canary's count of bad events at its 5th percentile (:data:`POWER`) still fails it: its
  share over the budget (1%), worse than the stable's by Fisher's one-sided test with
  ``rollout.confidence``, and at least :data:`analysis.SHARED_BREACH_RATIO` times the stable's
  share when the stable breaches too. So a regression of X is caught from one tally in about
  95% of rollouts like this one, not half of them (at the expected counts, the earlier
  statement, a 2% shedding queue the status called visible was caught in 11-31% of simulated
  rollouts on the code trace).
* Errors that come in bursts are worth less than independent ones: the verdict's sub-window
  test counts a burst once, and a queue that sheds does so in the traffic's bursts. The error
  statement's counts are therefore those of ``n / D`` independent requests, ``D`` the design
  effect (:func:`stats.design_effect`) that the burstiness of the stable's slow requests and
  errors across the tally's sub-windows, floored by that of its request rate
  (:func:`stats.burst_variance`, :func:`stats.rate_variance`: 0 for Poisson traffic, large
  for the code trace's bursts), gives at the canary's share and sub-window size. The p99
  statement is not discounted so: the uniform slowdown it states slows every request, in
  every sub-window alike.
* X is the smallest such ``f - 1``, found by bisection (the rule is monotone in ``f``), to 1%.
* With ``maxP99Increase`` the relative objective's statement is of the step's windows that
  compared the canary with the stable, each at its own threshold
  (:func:`relative_detectable_regression`), not of this window's histogram alone.

A stable far under its SLO needs a large X before a slowdown breaches at all: the gate judges
SLO breaches, not changes that stay inside the SLO (docs/canary-analysis.md "How the canary verdict decides").

The error objective (requests shed, timed out or failed, against ``maxErrorRate``) gets the
same treatment without a histogram: the smallest canary error share E that the rule fails on
the same counts of the same tally, against the stable's error share of the window
(:func:`detectable_error_rate`). A queue shedding 2% against a 1% budget is caught from one
tally when E <= 2%; where the traffic is too thin or too bursty, the status says so before it
matters. A bare :class:`Tally` is of the expected counts (``power`` 0.5, ``burstiness`` 0), the
rule's own threshold, which ``tests/operator/test_power.py`` checks against the
verdict; the lane's statements (:func:`lane_detectable_regression`,
:func:`lane_detectable_error_rate`) use :data:`POWER` and the measured burstiness.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from statistics import NormalDist

from batchpilot_operator.analysis import SHARED_BREACH_RATIO, SLICES, TALLY_ANALYSES, MetricCheck, objective
from batchpilot_operator.analysis.tally import ComparedWindow
from batchpilot_operator.stats import (
    binomial_sf,
    count_above,
    design_effect,
    e_value,
    fisher_greater,
    log_lr_over_budget,
    log_lr_worse,
)

LIMIT = 9.0
"""The largest regression looked for (10x the stable's latency): beyond it, "not detectable"."""
PRECISION = 0.01
POWER = 0.95
"""What the status states is caught in at least this share of rollouts like this one (the
canary's count at its 5th percentile fails), not the threshold a canary meets half the time."""


@dataclass(frozen=True)
class Tally:
    """The counts the verdict's rule is applied to: a tally's requests on each track, the rule's
    ``confidence`` and the objective's ``budget``. With ``power`` 0.5 and ``burstiness`` 0 the
    counts are the expected ones (the rule's own threshold: a canary there fails about half the
    time); ``power`` takes the canary's count at that probability instead, and ``burstiness``
    (:func:`stats.burst_variance`, over a tally of ``subwindows`` sub-windows) discounts each
    track's requests for their bursts (:func:`fails`)."""

    canary_requests: float
    stable_requests: float
    confidence: float
    budget: float
    power: float = 0.5
    burstiness: float = 0.0
    subwindows: int = 1
    needed: float | None = None
    """The e-value a rollback needs (``analysis.sequential_needed``; None: the rule without its
    sequential gate). The rollout's evidence is taken as that of the tally's counts."""
    on_budget: bool = False
    """The sequential gate reads the evidence that the canary is over its budget, not that it is
    worse than the stable (a relative objective: ``analysis.checks._gates_on_budget``)."""


def detects(buckets: Sequence[tuple[float, float]], slo: float, factor: float, tally: Tally) -> bool:
    """Whether the verdict fails a canary whose latencies are the stable's times ``factor``
    (the counts of :func:`fails` over the ``tally``)."""
    total = max(b[1] for b in buckets)
    if total <= 0:
        return False
    p_stable = count_above(buckets, slo) / total
    p_canary = count_above(buckets, slo / factor) / total
    return fails(p_canary, p_stable, tally)


def fails(p_canary: float, p_stable: float, tally: Tally) -> bool:
    """The verdict's rule on the counts a canary whose share of bad events is ``p_canary``
    gives, against the stable's ``p_stable``: over the budget and worse than the stable, each
    with ``confidence``; twice the stable's share when the stable breaches too.

    ``power`` other than 0.5 takes the canary's count at that probability (the verdict fails it
    at least that often; normal approximation), and ``burstiness`` counts each track's requests
    as the ``n / D`` independent ones its bursts are worth to the sub-window test
    (:func:`stats.design_effect`)."""
    t = tally
    if t.canary_requests <= 0 or t.stable_requests <= 0:
        return False
    subs = max(1, t.subwindows)
    n_c = t.canary_requests / design_effect(t.burstiness, p_canary, t.canary_requests / subs)
    n_s = t.stable_requests / design_effect(t.burstiness, p_stable, t.stable_requests / subs)
    spread = NormalDist().inv_cdf(t.power) * math.sqrt(n_c * p_canary * (1.0 - p_canary)) if t.power != 0.5 else 0.0
    k_c = max(0.0, p_canary * n_c - spread)
    share = k_c / n_c
    if share <= t.budget or 1.0 - binomial_sf(k_c, n_c, t.budget) < t.confidence:
        return False  # over the budget with the confidence, as the verdict requires
    if p_stable > t.budget and share < SHARED_BREACH_RATIO * p_stable:
        return False
    worse = 1.0 - fisher_greater(k_c, n_c, p_stable * n_s, n_s)
    if worse < t.confidence:
        return False
    if t.needed is None:
        return True
    # The sequential gate (worse than the stable, or over the budget), on the same (already
    # discounted) counts.
    if t.on_budget:
        return e_value(log_lr_over_budget(k_c, n_c, t.budget)) >= t.needed
    return e_value(log_lr_worse(k_c, n_c, p_stable * n_s, n_s)) >= t.needed


def _smallest(ok: Callable[[float], bool], lo: float, hi: float, precision: float) -> float:
    """The smallest x in (lo, hi] with ``ok(x)`` (monotone: false below it, true from it on), by
    bisection to within ``precision``, from above."""
    while hi - lo > precision:
        mid = (lo + hi) / 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return hi


RATE_PRECISION = 0.0005
"""Error rates are found to 0.05 percentage points."""


def detectable_error_rate(stable_share: float, tally: Tally) -> float:
    """The smallest share of the canary's requests answered with an error (shed, timed out,
    failed) that the rule fails (:func:`fails`), against a stable erring at ``stable_share``,
    rounded up to :data:`RATE_PRECISION`; ``math.inf`` when nothing short of every request
    failing is."""

    def ok(p: float) -> bool:
        return fails(p, stable_share, tally)

    lo, hi = min(max(tally.budget, 0.0), 1.0), 1.0
    if not ok(hi):
        return math.inf
    hi = _smallest(ok, lo, hi, RATE_PRECISION / 4)
    found = round(math.ceil(round(hi / RATE_PRECISION, 6)) * RATE_PRECISION, 4)
    return math.inf if found >= 1.0 else found  # only every request failing: none in reach


def detectable_regression(buckets: Sequence[tuple[float, float]], slo: float, tally: Tally) -> float:
    """The smallest regression (a fraction: 0.5 is p99 1.5x the stable's) the rule detects
    (:func:`detects`), to :data:`PRECISION`; ``math.inf`` when not even :data:`LIMIT` is."""

    return _smallest_regression(lambda factor: detects(buckets, slo, factor, tally))


def _smallest_regression(ok: Callable[[float], bool]) -> float:
    """The smallest ``f - 1`` in [0, LIMIT] with ``ok(f)``, to :data:`PRECISION`, rounded up (at
    X itself the rule fails); ``math.inf`` when not even ``1 + LIMIT`` is."""
    lo, hi = 1.0, 1.0 + LIMIT
    if ok(lo):
        return 0.0
    if not ok(hi):
        return math.inf
    hi = _smallest(ok, lo, hi, PRECISION)
    return round(math.ceil(round((hi - 1.0) / PRECISION, 6)) * PRECISION, 2)


def relative_detectable_regression(windows: Sequence[ComparedWindow], tally: Tally) -> float:
    """The smallest regression the relative objective detects over the windows of its tally,
    each counted against its own threshold as the verdict counts it (a window's slow requests
    are those over that window's ``(1 + maxP99Increase)`` times the stable's p99): a uniform
    regression by ``f`` puts each window's canary share over its threshold at the stable's share
    over ``threshold / f`` in that window; the shares are pooled by the windows' requests, and
    the tally's counts are those of ``tally`` (the caller scales the windows' requests to the
    tally the rollout can gather). One window's histogram alone reads its 1-3 slowest requests
    and swings the statement by tens of points from one window to the next."""
    usable = [w for w in windows if w.stable_requests > 0 and w.canary_requests > 0 and math.isfinite(w.threshold)]
    if not usable:
        return math.inf
    weight_c = sum(w.canary_requests for w in usable)
    weight_s = sum(w.stable_requests for w in usable)
    p_stable = sum(count_above(w.buckets, w.threshold) for w in usable) / weight_s

    def ok(factor: float) -> bool:
        p_canary = (
            sum(w.canary_requests * count_above(w.buckets, w.threshold / factor) / w.stable_requests for w in usable)
            / weight_c
        )
        return fails(p_canary, p_stable, tally)

    return _smallest_regression(ok)


def tally_scale(canary: MetricCheck, analyses: int) -> float:
    """How many windows' worth of this window's traffic the statement counts: ``analyses``, or
    more where the canary's tally already holds more requests than that (a quiet window after
    busier ones: the verdict is on the tally they filled, and a statement from the quiet window
    alone said a 1.5x regression was out of reach while the tally caught it). Both tracks are
    scaled alike: their windows are the same."""
    window = canary.samples or 0.0
    held = canary.tally[1] if canary.tally is not None else 0.0
    if window <= 0:
        return float(analyses)
    return max(float(analyses), held / window)


def _lane_tally(
    canary: float,
    stable: float,
    confidence: float,
    analyses: float,
    budget: float,
    power: float,
    burstiness: float,
    needed: float | None,
    on_budget: bool = False,
) -> Tally:
    """A tally of ``analyses`` windows at this window's traffic (``canary`` and ``stable``
    requests a window), over ``analyses * SLICES`` sub-windows (:func:`tally_scale`: possibly a
    fractional count of windows)."""
    return Tally(
        canary * analyses,
        stable * analyses,
        confidence,
        budget,
        power,
        burstiness,
        max(1, round(analyses * SLICES)),
        needed,
        on_budget,
    )


def lane_detectable_regression(
    canary: MetricCheck,
    stable: MetricCheck | None,
    confidence: float,
    analyses: int = TALLY_ANALYSES,
    *,
    power: float = POWER,
    burstiness: float | None = None,
    needed: float | None = None,
) -> float | None:
    """:func:`detectable_regression` of a lane's p99 objective from this window's checks, over
    a tally of ``analyses`` windows at this window's traffic (a full tally by default; the
    planner passes what the rollout's last like-for-like steps can gather,
    ``fairness.gating_analyses``), caught with ``power``. Not discounted for bursts unless
    ``burstiness`` is given: the regression it states slows every request alike, so its slow
    requests fall in every sub-window, not in the traffic's bursts (with the demo's bursty
    trace, discounting them made the status call a 10x regression invisible while the demo's
    bad change, a smaller one, was rolled back every time); None when the window cannot tell
    (no stable histogram, no requests on either track)."""
    if stable is None or not stable.buckets or not canary.samples or not stable.samples:
        return None
    relative = objective(canary.metric).relative  # its gate reads the evidence over the budget
    windows = tally_scale(canary, analyses)
    tally = _lane_tally(
        canary.samples, stable.samples, confidence, windows, stable.budget, power, burstiness or 0.0, needed, relative
    )
    return detectable_regression(stable.buckets, stable.threshold, tally)


def lane_detectable_error_rate(
    canary: MetricCheck,
    stable: MetricCheck | None,
    confidence: float,
    analyses: int = TALLY_ANALYSES,
    *,
    power: float = POWER,
    burstiness: float | None = None,
    needed: float | None = None,
) -> float | None:
    """:func:`detectable_error_rate` of a lane's error objective from this window's checks, over a
    tally of ``analyses`` windows at this window's traffic and the stable's error share of the
    window, caught with ``power`` at ``burstiness`` (the canary check's unless given: the
    planner passes the larger of it and the p99 objective's, since errors that a queue sheds
    come in the same bursts as slow requests); None when the window cannot tell (no stable, no
    requests on either track)."""
    if stable is None or not canary.samples or not stable.samples:
        return None
    bursts = burstiness if burstiness is not None else canary.burstiness or 0.0
    windows = tally_scale(canary, analyses)
    tally = _lane_tally(canary.samples, stable.samples, confidence, windows, canary.budget, power, bursts, needed)
    return detectable_error_rate((stable.bad or 0.0) / stable.samples, tally)
