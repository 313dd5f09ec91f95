"""The exact and burst-robust tests behind the canary verdict (pure)."""

from __future__ import annotations

import math
import random

import pytest

from batchpilot_operator.stats import (
    binomial_sf,
    clustered_greater,
    clustered_over_budget,
    count_above,
    fisher_greater,
    rate_variance,
    student_t_cdf,
)


def _binom_sf_brute(k: int, n: int, p: float) -> float:
    return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k, n + 1))


def _fisher_brute(ka: int, na: int, kb: int, nb: int) -> float:
    bad = ka + kb
    total = math.comb(na + nb, bad)
    return sum(math.comb(na, i) * math.comb(nb, bad - i) for i in range(ka, min(bad, na) + 1)) / total


@pytest.mark.parametrize(("k", "n", "p"), [(0, 10, 0.1), (1, 100, 0.01), (3, 150, 0.01), (7, 80, 0.01), (40, 60, 0.5)])
def test_binomial_sf_matches_the_definition(k: int, n: int, p: float) -> None:
    assert binomial_sf(k, n, p) == pytest.approx(_binom_sf_brute(k, n, p), rel=1e-9, abs=1e-15)


def test_binomial_sf_edges() -> None:
    assert binomial_sf(0, 50, 0.01) == 1.0 and binomial_sf(51, 50, 0.01) == 0.0
    assert binomial_sf(2.4, 100, 0.01) == binomial_sf(2, 100, 0.01)  # counts round to what they stand for
    with pytest.raises(ValueError):
        binomial_sf(1, 10, 1.5)


@pytest.mark.parametrize(
    ("ka", "na", "kb", "nb"), [(5, 150, 0, 450), (36, 300, 81, 900), (12, 300, 12, 900), (3, 10, 1, 10)]
)
def test_fisher_matches_the_hypergeometric_tail(ka: int, na: int, kb: int, nb: int) -> None:
    assert fisher_greater(ka, na, kb, nb) == pytest.approx(_fisher_brute(ka, na, kb, nb), rel=1e-9)


def test_fisher_identical_and_empty() -> None:
    assert fisher_greater(0, 100, 0, 100) == 1.0  # no bad events anywhere: nothing to see
    assert 0.4 < fisher_greater(10, 100, 10, 100) < 0.7  # identical: not worse
    with pytest.raises(ValueError):
        fisher_greater(5, 4, 0, 10)


@pytest.mark.parametrize(
    ("t", "df", "cdf"),
    [(0.0, 4, 0.5), (2.132, 4, 0.95), (3.747, 4, 0.99), (1.833, 9, 0.95), (6.314, 1, 0.95), (2.015, 5, 0.95)],
)
def test_student_t_cdf_against_tables(t: float, df: int, cdf: float) -> None:
    assert student_t_cdf(t, df) == pytest.approx(cdf, abs=2e-4)
    assert student_t_cdf(-t, df) == pytest.approx(1 - cdf, abs=2e-4)


def test_one_burst_is_one_cluster_of_evidence() -> None:
    # 15 of 500 requests over the objective (3%, 3x the budget): as independent requests that is
    # near-certain, but all 15 came in one of five sub-windows -- one burst.
    burst = [(15.0, 100.0), (0.0, 100.0), (0.0, 100.0), (0.0, 100.0), (0.0, 100.0)]
    assert 1 - binomial_sf(15, 500, 0.01) > 0.999
    over = clustered_over_budget(burst, 0.01)
    assert over is not None and over < 0.9
    # The same 3% spread over every sub-window is a steady breach.
    steady = [(3.0, 100.0)] * 5
    assert clustered_over_budget(steady, 0.01) == 1.0
    # Compared with a stable that had none: a burst on the canary's pod alone is not proof.
    clean = [(0.0, 300.0)] * 5
    worse = clustered_greater(burst, clean)
    assert worse is not None and worse < 0.9
    assert clustered_greater(steady, clean) == 1.0


def test_paired_sub_windows_cancel_a_burst_both_tracks_saw() -> None:
    canary = [(0.0, 100.0), (30.0, 100.0), (0.0, 100.0), (1.0, 100.0), (0.0, 100.0)]
    stable = [(0.0, 300.0), (84.0, 300.0), (0.0, 300.0), (3.0, 300.0), (0.0, 300.0)]
    worse = clustered_greater(canary, stable)
    assert worse is not None and worse < 0.95  # not proof at the default confidence
    assert clustered_greater(canary, stable[:4]) is None  # sub-windows must pair up
    assert clustered_over_budget(canary[:1], 0.01) is None  # one sub-window has no spread


def test_count_above_interpolates_like_histogram_quantile() -> None:
    buckets = [(0.1, 985.0), (0.3, 1000.0), (math.inf, 1000.0)]
    assert count_above(buckets, 0.2) == pytest.approx(7.5)
    assert count_above(buckets, 0.05) == pytest.approx(1000 - 985 / 2)  # first bucket starts at 0
    assert count_above(buckets, 5.0) == 0.0
    assert count_above([(0.1, 5.0), (math.inf, 9.0)], 1.0) == 4.0  # beyond the last finite bound
    assert count_above(list(reversed(buckets)), 0.2) == pytest.approx(7.5)  # order does not matter
    assert count_above([], 0.2) == 0.0
    with pytest.raises(ValueError):
        count_above([(0.1, 1.0)], 0.2)


def poisson(rng: random.Random, mean: float) -> int:
    """A Poisson draw (Knuth's product method in chunks; small means only matter here)."""
    count, left = 0, mean
    while left > 0:
        step = min(left, 30.0)
        left -= step
        limit, prod = math.exp(-step), rng.random()
        while prod > limit:
            count += 1
            prod *= rng.random()
    return count


def test_rate_variance_tells_bursty_traffic_from_poisson() -> None:
    rng = random.Random(3)
    steady = [(0.0, float(poisson(rng, 200.0))) for _ in range(400)]
    found = rate_variance(steady)
    assert found is not None and found < 0.02
    # on/off: every other sub-window at 4x the rate, the rest at a quarter (mean 2.125x / 2)
    onoff = [(0.0, float(poisson(rng, 400.0 if i % 2 else 25.0))) for i in range(400)]
    found = rate_variance(onoff)
    mean = (400 + 25) / 2
    assert found is not None and found == pytest.approx(((400 - mean) ** 2) / mean**2, rel=0.1)
    assert rate_variance([(0.0, 10.0)]) is None and rate_variance([(0.0, 0.0), (0.0, 0.0)]) is None
