"""McNemar's exact test and the paired intervals against hand-computed values and independent recomputation."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from app.api import paired


def binomial_tail(d: int, k_from: int, k_to: int, p: float) -> float:
    """sum_{k=k_from}^{k_to} C(d, k) p^k (1-p)^(d-k), term by term with math.comb."""
    return math.fsum(math.comb(d, k) * p**k * (1 - p) ** (d - k) for k in range(k_from, k_to + 1))


def test_mcnemar_exact_is_the_doubled_binomial_tail_written_out() -> None:
    assert paired.mcnemar_exact(0, 5) == 2 * 1 / 32  # C(5,0) / 2^5, doubled
    assert paired.mcnemar_exact(1, 9) == 2 * (1 + 10) / 1024
    assert paired.mcnemar_exact(9, 1) == paired.mcnemar_exact(1, 9)
    assert paired.mcnemar_exact(2, 3) == 1.0  # 2 * (1 + 5 + 10) / 32 = 1, capped at 1
    assert paired.mcnemar_exact(0, 0) == 1.0
    b, c = 13, 31  # a larger case: exact fractions, independently
    tail = sum(Fraction(math.comb(b + c, k), 2 ** (b + c)) for k in range(b + 1))
    assert paired.mcnemar_exact(b, c) == pytest.approx(float(2 * tail), rel=1e-12)
    with pytest.raises(ValueError, match="b >= 0 and c >= 0"):
        paired.mcnemar_exact(-1, 2)


def test_clopper_pearson_has_the_closed_forms_at_the_ends() -> None:
    n = 7
    assert paired.clopper_pearson(0, n) == (0.0, pytest.approx(1 - 0.025 ** (1 / n), abs=1e-12))
    assert paired.clopper_pearson(n, n) == (pytest.approx(0.025 ** (1 / n), abs=1e-12), 1.0)


@pytest.mark.parametrize(("successes", "trials"), [(1, 4), (3, 10), (17, 40), (250, 600)])
def test_clopper_pearson_bounds_put_alpha_over_two_in_each_tail(successes: int, trials: int) -> None:
    low, high = paired.clopper_pearson(successes, trials)
    assert 0 < low < successes / trials < high < 1
    assert binomial_tail(trials, successes, trials, low) == pytest.approx(0.025, abs=1e-9)
    assert binomial_tail(trials, 0, successes, high) == pytest.approx(0.025, abs=1e-9)


def test_the_accuracy_difference_maps_the_discordant_interval() -> None:
    b, c, n = 3, 1, 20  # 3 examples only the variant gets right, 1 only float32 does, 16 agree
    difference, low, high = paired.accuracy_difference(b, c, n)
    assert difference == pytest.approx(0.1)
    pi_low, pi_high = paired.clopper_pearson(3, 4)
    assert (low, high) == (pytest.approx(4 * (2 * pi_low - 1) / 20), pytest.approx(4 * (2 * pi_high - 1) / 20))
    assert binomial_tail(4, 3, 4, (low * 20 / 4 + 1) / 2) == pytest.approx(0.025, abs=1e-9)
    assert paired.accuracy_difference(0, 0, 10) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="b \\+ c <= n"):
        paired.accuracy_difference(6, 5, 10)


def test_the_bootstrap_is_the_documented_resampling() -> None:
    differences = np.array([0.3, -0.1, 0.05, 0.2, -0.4, 0.0, 0.15, 0.1], dtype=np.float32)
    mean, low, high = paired.bootstrap_interval(differences)
    rng = np.random.default_rng(0)  # docs/numerics.md: seed 0, 2000 rounds of n indices, linear quantiles
    values = differences.astype(np.float64)
    means = [values[rng.integers(0, len(values), size=len(values))].mean() for _ in range(2000)]
    assert mean == values.mean()
    assert (low, high) == (np.quantile(means, 0.025), np.quantile(means, 0.975))
    assert paired.bootstrap_interval(np.full(5, 0.25)) == (0.25, 0.25, 0.25)
    with pytest.raises(ValueError, match="at least one"):
        paired.bootstrap_interval(np.array([]))
