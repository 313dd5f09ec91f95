"""Small exact tests on counts, for the canary verdict. Pure (math only, no numpy/scipy).

The canary analysis reduces every objective to *bad events among requests*: requests slower
than the p99 SLO (a p99 at or under the SLO is exactly "at most 1% of requests over it"),
requests that waited longer than ``maxQueueAge``, requests answered with an error. Two
questions are asked of such counts, and both have exact answers:

* Is the canary's bad-event rate above the budget? :func:`binomial_sf` gives
  ``P(X >= k)`` for ``X ~ Binomial(n, budget)``: how surprising ``k`` bad events among ``n``
  would be if the canary just met its objective.
* Is the canary worse than the stable over the same window? :func:`fisher_greater` is
  Fisher's exact test, one-sided: given that ``k_c + k_s`` bad events happened among
  ``n_c + n_s`` requests, how surprising is it that ``k_c`` or more of them fell on the
  canary's ``n_c`` requests, if both tracks had the same rate.

Counts read from Prometheus are real numbers (``increase()`` extrapolates, bucket
interpolation splits a bucket); both tests round them to the nearest integer, which is what
they stand for. :func:`count_above` reads "how many observations exceeded ``threshold``"
from cumulative histogram buckets with the same linear interpolation inside a bucket that
``histogram_quantile`` uses, so "p99 > SLO" and "more than 1% of the count above the SLO"
agree on the same data.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def _log_choose(n: int, k: int) -> float:
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


def _sum_log_terms(terms: list[float]) -> float:
    if not terms:
        return 0.0
    top = max(terms)
    return math.exp(top) * math.fsum(math.exp(t - top) for t in terms)


def binomial_sf(k: float, n: float, p: float) -> float:
    """``P(X >= k)`` for ``X ~ Binomial(n, p)`` (``k`` and ``n`` rounded to integers)."""
    ki, ni = round(k), round(n)
    if ni < 0 or not 0.0 <= p <= 1.0:
        raise ValueError(f"binomial_sf needs n >= 0 and 0 <= p <= 1, got n={n}, p={p}")
    if ki <= 0:
        return 1.0
    if ki > ni:
        return 0.0
    if p == 0.0:
        return 0.0
    if p == 1.0:
        return 1.0
    lp, lq = math.log(p), math.log1p(-p)
    terms: list[float] = []
    top = -math.inf
    for i in range(ki, ni + 1):
        t = _log_choose(ni, i) + i * lp + (ni - i) * lq
        terms.append(t)
        top = max(top, t)
        # Past the mode the terms only shrink; stop once they no longer matter.
        if i > ni * p and t < top - 40:
            break
    return min(1.0, _sum_log_terms(terms))


def fisher_greater(k_a: float, n_a: float, k_b: float, n_b: float) -> float:
    """One-sided Fisher exact p-value that group a's rate exceeds group b's.

    ``P(X >= k_a)`` for the hypergeometric ``X``: ``k_a + k_b`` bad events drawn without
    replacement from ``n_a + n_b`` requests, ``n_a`` of them group a's.
    """
    ka, na, kb, nb = round(k_a), round(n_a), round(k_b), round(n_b)
    if min(na, nb) < 0 or not (0 <= ka <= na and 0 <= kb <= nb):
        raise ValueError(f"fisher_greater needs 0 <= k <= n, got {k_a}/{n_a} and {k_b}/{n_b}")
    total, bad = na + nb, ka + kb
    if bad == 0 or na == 0 or nb == 0:
        return 1.0
    hi = min(bad, na)
    if ka > hi:
        return 0.0
    denominator = _log_choose(total, bad)
    terms = [_log_choose(na, i) + _log_choose(nb, bad - i) - denominator for i in range(ka, hi + 1)]
    return min(1.0, _sum_log_terms(terms))


def count_above(buckets: Sequence[tuple[float, float]], threshold: float) -> float:
    """Observations above ``threshold`` from cumulative buckets ``(upper bound, count)``.

    The buckets are Prometheus' ``le`` series (any order; ``+Inf`` holds the total). Inside
    the bucket that contains ``threshold`` the count is interpolated linearly, as
    ``histogram_quantile`` does (the first bucket's lower bound is 0); a threshold beyond the
    last finite bound counts only the ``+Inf`` bucket's excess.
    """
    if not buckets:
        return 0.0
    ordered = sorted(buckets)
    total = ordered[-1][1]
    if not math.isinf(ordered[-1][0]):
        raise ValueError("cumulative buckets must end with the +Inf bucket")
    below = 0.0
    lower, lower_count = 0.0, 0.0
    for bound, count in ordered:
        if math.isinf(bound):
            below = lower_count
            break
        if threshold <= bound:
            span = bound - lower
            frac = 1.0 if span <= 0 else (threshold - lower) / span
            below = lower_count + (count - lower_count) * max(0.0, min(1.0, frac))
            break
        lower, lower_count = bound, count
    return max(0.0, total - below)


def student_t_cdf(t: float, df: int) -> float:
    """``P(T <= t)`` for Student's t with an integer ``df >= 1`` (closed forms, A&S 26.7.3/4)."""
    if df < 1:
        raise ValueError(f"student_t_cdf needs df >= 1, got {df}")
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    theta = math.atan(abs(t) / math.sqrt(df))
    c2 = math.cos(theta) ** 2
    if df % 2 == 1:
        series, term = 0.0, 1.0
        if df > 1:
            series = 1.0
            for i in range(3, df, 2):  # 1 + 2/3 c^2 + 2*4/(3*5) c^4 + ...
                term *= (i - 1) / i * c2
                series += term
        a = (2 / math.pi) * (theta + (math.sin(theta) * math.cos(theta) * series if df > 1 else 0.0))
    else:
        series, term = 1.0, 1.0
        for i in range(2, df, 2):  # 1 + 1/2 c^2 + 1*3/(2*4) c^4 + ...
            term *= (i - 1) / i * c2
            series += term
        a = math.sin(theta) * series
    a = min(1.0, max(0.0, a))
    return 0.5 + a / 2 if t >= 0 else 0.5 - a / 2


Slices = Sequence[tuple[float, float]]
"""Bad events and requests per sub-window of one analysis window: ``((k_1, n_1), ...)``."""


def _share_residuals(slices: Slices) -> tuple[float, list[float]] | None:
    total = sum(n for _, n in slices)
    if total <= 0:
        return None
    share = sum(k for k, _ in slices) / total
    return share, [(k - share * n) / total for k, n in slices]


def _clustered(slices: Slices) -> tuple[float, list[float]] | None:
    """:func:`_share_residuals` of at least 2 sub-windows (a spread needs two)."""
    return _share_residuals(slices) if len(slices) >= 2 else None


def _t_confidence(effect: float, residuals: Sequence[float]) -> float:
    m = len(residuals)
    var = m / (m - 1) * math.fsum(u * u for u in residuals)
    if var <= 0.0:
        return 1.0 if effect > 0 else 0.5 if effect == 0 else 0.0
    return student_t_cdf(effect / math.sqrt(var), m - 1)


def clustered_over_budget(slices: Slices, budget: float) -> float | None:
    """Confidence that the bad share exceeds ``budget``, sub-windows as independent clusters.

    Bad events come in runs (a queue that builds on one pod makes every request behind it
    late), so counting requests as independent overstates the evidence of one burst. Here
    the variance of the share is estimated from how it varies across the sub-windows
    (a cluster-robust, ratio-estimator variance) and judged with Student's t on
    ``len(slices) - 1`` degrees of freedom. None with fewer than 2 sub-windows or no requests.
    """
    sr = _clustered(slices)
    if sr is None:
        return None
    share, residuals = sr
    return _t_confidence(share - budget, residuals)


def clustered_greater(canary: Slices, stable: Slices) -> float | None:
    """Confidence that the canary's bad share exceeds the stable's, paired by sub-window.

    Each sub-window contributes both tracks' residuals, so a burst that hits both tracks in
    the same seconds cancels out, and a burst that hit only one track's pods counts as one
    cluster, not as many independent requests (see :func:`clustered_over_budget`).
    """
    if len(canary) < 2 or len(canary) != len(stable):
        return None
    c, s = _share_residuals(canary), _share_residuals(stable)
    if c is None or s is None:
        return None
    residuals = [uc - us for uc, us in zip(c[1], s[1], strict=True)]
    return _t_confidence(c[0] - s[0], residuals)


def burst_variance(slices: Slices) -> float | None:
    """How bursty bad events are across sub-windows: the variance of a multiplier ``L`` (mean
    1) on each sub-window's bad-event rate, under the model that each request of sub-window
    ``i`` goes bad with probability ``p * L_i`` (a burst raises it for every request in it).
    Independent requests give 0; then the variance of a sub-window's count is ``n p (1 - p) +
    (n p)^2 Var(L)``, so the sub-window test counts the requests of a tally as ``n / D``
    independent ones, ``D = 1 + Var(L) n_sub p / (1 - p)`` (Kish's design effect, ``n_sub``
    requests per sub-window: :func:`design_effect`). ``Var(L)`` is a property of the traffic,
    not of its rate or the window's size, which is what lets the stable's slow requests say
    how a canary's errors would cluster (``power``).
    Estimated from the excess of the cluster-robust variance over the binomial one; None with
    fewer than 2 sub-windows, no requests or no bad events (nothing to measure it by)."""
    sr = _clustered(slices)
    if sr is None or not 0.0 < sr[0] < 1.0:
        return None
    share, residuals = sr
    total = math.fsum(n for _, n in slices)
    m = len(residuals)
    clustered = m / (m - 1) * math.fsum(u * u for u in residuals)
    design = clustered / (share * (1.0 - share) / total)
    return max(0.0, design - 1.0) * (1.0 - share) / (share * total / m)


def rate_variance(slices: Slices) -> float | None:
    """How bursty the traffic itself is across sub-windows: the variance of a multiplier (mean
    1) on each sub-window's request rate beyond what Poisson arrivals give (0 for Poisson,
    about 1 for traffic that comes and goes in sub-window-sized bursts). A floor for
    :func:`burst_variance`: bad events rise at least in step with the load that causes them
    (a queue sheds and delays more than in proportion to a burst), and it is measurable in a
    window without any bad event. None with fewer than 2 sub-windows or no requests."""
    if len(slices) < 2:
        return None
    counts = [n for _, n in slices]
    mean = math.fsum(counts) / len(counts)
    if mean <= 0.0:
        return None
    var = math.fsum((n - mean) ** 2 for n in counts) / (len(counts) - 1)
    return max(0.0, (var - mean) / (mean * mean))


def design_effect(burstiness: float, share: float, per_subwindow: float) -> float:
    """Kish's design effect of bad events at ``share`` among ``per_subwindow`` requests per
    sub-window, for traffic of :func:`burst_variance` ``burstiness``: how many requests count
    as one independent one to the sub-window test."""
    if burstiness <= 0.0 or share <= 0.0 or share >= 1.0:
        return 1.0
    return 1.0 + burstiness * per_subwindow * share / (1.0 - share)


# --------------------------------------------------------------------------- sequential evidence
#
# The tests above answer "does this tally show a breach?" once. The verdict asks it every
# analysis window, and a rule that asks often enough at a fixed confidence eventually blames a
# good canary by chance. The evidence below accumulates over the whole rollout instead: for each
# alternative of a small grid, the product over the analysed windows of the likelihood ratio of
# the window's counts under that alternative against the null. Under the null each product is a
# nonnegative supermartingale (its expectation given the past is at most 1), so is their mean
# (the e-value), and by Ville's inequality the chance that the e-value *ever* reaches ``1 / a``,
# however many windows are looked at and whenever the rollout stops, is at most ``a``.

OVER_BUDGET_RATIOS: tuple[float, ...] = (1.5, 2.0, 3.0, 5.0, 10.0, 30.0)
"""The alternatives of the over-budget evidence: the canary's bad share at these multiples of the budget."""
WORSE_ODDS: tuple[float, ...] = (1.5, 2.0, 3.0, 5.0, 10.0, 30.0)
"""The alternatives of the worse-than-stable evidence: a bad event is the canary's with these odds
ratios against its share of the requests."""
LOG_CAP = 700.0
"""Log likelihood ratios are kept below this (exp stays finite; the status stays JSON)."""


def _capped(x: float) -> float:
    return min(LOG_CAP, x)


def log_lr_over_budget(k: float, n: float, budget: float, discount: float = 1.0) -> tuple[float, ...]:
    """Per alternative of :data:`OVER_BUDGET_RATIOS`, the log likelihood ratio of ``k`` bad events
    among ``n`` requests with a bad share of ``ratio * budget`` (at most 0.999) against one of
    ``budget``, divided by ``discount`` (a design effect: bursty requests are worth ``n / D``
    independent ones). For any true share at or under the budget, each ratio's expectation is at
    most 1. A zero budget: any bad event refutes it outright (the cap), none says nothing."""
    k, n = max(0.0, min(k, n)), max(0.0, n)
    d = max(1.0, discount)
    if budget <= 0.0:
        return tuple(LOG_CAP if k > 0 else 0.0 for _ in OVER_BUDGET_RATIOS)
    out = []
    for r in OVER_BUDGET_RATIOS:
        p = min(0.999, r * budget)
        if p <= budget:
            out.append(0.0)
            continue
        out.append(_capped((k * math.log(p / budget) + (n - k) * math.log((1.0 - p) / (1.0 - budget))) / d))
    return tuple(out)


def log_lr_worse(k_c: float, n_c: float, k_s: float, n_s: float, discount: float = 1.0) -> tuple[float, ...]:
    """Per alternative of :data:`WORSE_ODDS`, the log likelihood ratio that the window's bad
    events fell on the canary more often than its share ``s`` of the requests: given the
    ``k_c + k_s`` bad events, each is the canary's with probability ``s`` when both tracks have
    the same bad rate (at most ``s`` when the canary's is lower), and with odds ``odds`` times
    ``s / (1 - s)`` under the alternative (Poisson counts: the conditional test of two rates).
    Divided by ``discount`` as :func:`log_lr_over_budget`. No requests on a track: no evidence."""
    k_c, k_s = max(0.0, min(k_c, n_c)), max(0.0, min(k_s, n_s))
    if n_c <= 0.0 or n_s <= 0.0 or k_c + k_s <= 0.0:
        return tuple(0.0 for _ in WORSE_ODDS)
    d = max(1.0, discount)
    s = n_c / (n_c + n_s)
    out = []
    for odds in WORSE_ODDS:
        q = odds * s / (1.0 - s + odds * s)
        out.append(_capped((k_c * math.log(q / s) + k_s * math.log((1.0 - q) / (1.0 - s))) / d))
    return tuple(out)


def accumulate(earlier: Sequence[float] | None, window: Sequence[float]) -> tuple[float, ...]:
    """Each alternative's log likelihood ratio over the windows so far, this one included."""
    if not earlier or len(earlier) != len(window):
        return tuple(window)
    return tuple(_capped(a + b) for a, b in zip(earlier, window, strict=True))


def e_value(logs: Sequence[float]) -> float:
    """The evidence against the null: the mean over the alternatives of their likelihood
    ratios (1 before any window; at least ``1 / a`` at most ``a`` of the time under the null,
    at any window)."""
    if not logs:
        return 1.0
    top = max(logs)
    return math.exp(top) * math.fsum(math.exp(x - top) for x in logs) / len(logs)
