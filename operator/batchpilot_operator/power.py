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
  the stable's requests each: ``fairness.gating_analyses``), the regression is detected when the expected
  counts fail the canary: its share over the budget (1%), worse than the stable's by Fisher's
  one-sided test with ``rollout.confidence``, and at least :data:`analysis.SHARED_BREACH_RATIO`
  times the stable's share when the stable breaches too.
* X is the smallest such ``f - 1``, found by bisection (the rule is monotone in ``f``), to 1%.
  A regression of X is caught about half the time from one tally (the expected counts sit at
  the test's threshold), a larger one more often; the sub-window test the verdict also runs
  can only make it harder, so X is a floor, not a promise.

A stable far under its SLO needs a large X before a slowdown breaches at all: the gate judges
SLO breaches, not changes that stay inside the SLO (README "How the canary verdict decides").

The error objective (requests shed, timed out or failed, against ``maxErrorRate``) gets the
same treatment without a histogram: the smallest canary error share E that the rule fails on
the expected counts of the same tally, against the stable's error share of the window
(:func:`detectable_error_rate`). A queue shedding 2% against a 1% budget is caught from one
tally when E <= 2%; where the traffic is too thin, the status says so before it matters.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from batchpilot_operator.analysis import SHARED_BREACH_RATIO, TALLY_ANALYSES, MetricCheck
from batchpilot_operator.stats import binomial_sf, count_above, fisher_greater

LIMIT = 9.0
"""The largest regression looked for (10x the stable's latency): beyond it, "not detectable"."""
PRECISION = 0.01


def detects(
    buckets: Sequence[tuple[float, float]],
    slo: float,
    factor: float,
    *,
    canary_requests: float,
    stable_requests: float,
    confidence: float,
    budget: float,
) -> bool:
    """Whether the verdict fails a canary whose latencies are the stable's times ``factor``
    (expected counts over ``canary_requests`` and ``stable_requests``)."""
    total = max(b[1] for b in buckets)
    if total <= 0:
        return False
    p_stable = count_above(buckets, slo) / total
    p_canary = count_above(buckets, slo / factor) / total
    return fails(
        p_canary,
        p_stable,
        canary_requests=canary_requests,
        stable_requests=stable_requests,
        confidence=confidence,
        budget=budget,
    )


def fails(
    p_canary: float,
    p_stable: float,
    *,
    canary_requests: float,
    stable_requests: float,
    confidence: float,
    budget: float,
) -> bool:
    """The verdict's rule on expected counts: a canary whose share of bad events is
    ``p_canary`` against the stable's ``p_stable`` fails (over the budget and worse than the
    stable, each with ``confidence``; twice the stable's share when the stable breaches too)."""
    if canary_requests <= 0 or stable_requests <= 0:
        return False
    if p_canary <= budget or 1.0 - binomial_sf(p_canary * canary_requests, canary_requests, budget) < confidence:
        return False  # over the budget with the confidence, as the verdict requires
    if p_stable > budget and p_canary < SHARED_BREACH_RATIO * p_stable:
        return False
    worse = 1.0 - fisher_greater(
        p_canary * canary_requests, canary_requests, p_stable * stable_requests, stable_requests
    )
    return worse >= confidence


RATE_PRECISION = 0.0005
"""Error rates are found to 0.05 percentage points."""


def detectable_error_rate(
    stable_share: float,
    *,
    canary_requests: float,
    stable_requests: float,
    confidence: float,
    budget: float,
) -> float:
    """The smallest share of the canary's requests answered with an error (shed, timed out,
    failed) that the rule fails, against a stable erring at ``stable_share``, rounded up to
    :data:`RATE_PRECISION`; ``math.inf`` when not even every request failing is."""

    def ok(p: float) -> bool:
        return fails(
            p,
            stable_share,
            canary_requests=canary_requests,
            stable_requests=stable_requests,
            confidence=confidence,
            budget=budget,
        )

    lo, hi = min(max(budget, 0.0), 1.0), 1.0
    if not ok(hi):
        return math.inf
    while hi - lo > RATE_PRECISION / 4:
        mid = (lo + hi) / 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return min(1.0, round(math.ceil(round(hi / RATE_PRECISION, 6)) * RATE_PRECISION, 4))


def detectable_regression(
    buckets: Sequence[tuple[float, float]],
    slo: float,
    *,
    canary_requests: float,
    stable_requests: float,
    confidence: float,
    budget: float,
) -> float:
    """The smallest regression (a fraction: 0.5 is p99 1.5x the stable's) the rule detects,
    to :data:`PRECISION`; ``math.inf`` when not even :data:`LIMIT` is."""

    def ok(factor: float) -> bool:
        return detects(
            buckets,
            slo,
            factor,
            canary_requests=canary_requests,
            stable_requests=stable_requests,
            confidence=confidence,
            budget=budget,
        )

    lo, hi = 1.0, 1.0 + LIMIT
    if ok(lo):
        return 0.0
    if not ok(hi):
        return math.inf
    while hi - lo > PRECISION:
        mid = (lo + hi) / 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return round(math.ceil(round((hi - 1.0) / PRECISION, 6)) * PRECISION, 2)  # up: at X itself the rule fails


def lane_detectable_regression(
    canary: MetricCheck, stable: MetricCheck | None, confidence: float, analyses: int = TALLY_ANALYSES
) -> float | None:
    """:func:`detectable_regression` of a lane's p99 objective from this window's checks, over
    a tally of ``analyses`` windows at this window's traffic (a full tally by default; the
    planner passes what the rollout's last like-for-like steps can gather,
    ``fairness.gating_analyses``); None when the window cannot tell (no stable histogram, no
    requests on either track)."""
    if stable is None or not stable.buckets or not canary.samples or not stable.samples:
        return None
    return detectable_regression(
        stable.buckets,
        stable.threshold,
        canary_requests=canary.samples * analyses,
        stable_requests=stable.samples * analyses,
        confidence=confidence,
        budget=stable.budget,
    )


def lane_detectable_error_rate(
    canary: MetricCheck, stable: MetricCheck | None, confidence: float, analyses: int = TALLY_ANALYSES
) -> float | None:
    """:func:`detectable_error_rate` of a lane's error objective from this window's checks, over a
    tally of ``analyses`` windows at this window's traffic and the stable's error share of the
    window; None when the window cannot tell (no stable, no requests on either track)."""
    if stable is None or not canary.samples or not stable.samples:
        return None
    return detectable_error_rate(
        (stable.bad or 0.0) / stable.samples,
        canary_requests=canary.samples * analyses,
        stable_requests=stable.samples * analyses,
        confidence=confidence,
        budget=canary.budget,
    )
