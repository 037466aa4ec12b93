"""Paired statistics of two models on the same held-out examples: McNemar's exact test and intervals.

Computed in the API with NumPy (already an API dependency, app/core/npz.py), never TensorFlow; the
methods are stated exactly in docs/numerics.md so that anyone can recompute them.
"""

from __future__ import annotations

import math

import numpy as np

CONFIDENCE = 0.95
"""Every interval's confidence level."""
RESAMPLES = 2000
"""Bootstrap resamples: see `bootstrap_interval`."""
SEED = 0
"""The bootstrap's seed: `numpy.random.default_rng(SEED)`."""
_BISECTIONS = 100


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value for the discordant counts `b` and `c`.

    Under the null each of the d = b + c discordant examples goes either way with probability 1/2:
    p = min(1, 2 · sum_{k=0}^{min(b, c)} C(d, k) / 2^d), computed in exact integers; 1.0 when d = 0.
    """
    if b < 0 or c < 0:
        raise ValueError(f"Expected discordant counts b >= 0 and c >= 0. Received: b={b}, c={c}")
    d = b + c
    if d == 0:
        return 1.0
    tail = sum(math.comb(d, k) for k in range(min(b, c) + 1))
    return min(1.0, float(2 * tail / 2**d))


def _binomial_cdf(k: int, n: int, p: float, log_comb: np.ndarray) -> float:
    """P(X <= k) for X ~ Binomial(n, p), summed in log space (n may be large)."""
    if p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 1.0 if k >= n else 0.0
    ks = np.arange(k + 1)
    terms = log_comb[: k + 1] + ks * math.log(p) + (n - ks) * math.log1p(-p)
    return float(min(1.0, np.exp(terms).sum()))


def clopper_pearson(successes: int, trials: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """The exact (Clopper–Pearson) interval for a binomial proportion, found by bisection.

    low solves P(X >= successes | low) = α/2 (0 when successes = 0); high solves
    P(X <= successes | high) = α/2 (1 when successes = trials); α = 1 − confidence.
    """
    if trials <= 0 or not 0 <= successes <= trials:
        raise ValueError(f"Expected 0 <= successes <= trials and trials > 0. "
                         f"Received: successes={successes}, trials={trials}")
    alpha = 1.0 - confidence
    logs = np.concatenate(([0.0], np.cumsum(np.log(np.arange(1, trials + 1, dtype=np.float64)))))
    log_comb = logs[trials] - logs[: trials + 1] - logs[trials::-1]

    def solve(below: bool) -> float:  # the p where the tail equals α/2; the tail is monotone in p
        lo, hi = 0.0, 1.0
        for _ in range(_BISECTIONS):
            mid = (lo + hi) / 2
            if below:  # P(X <= successes | mid) falls as mid grows
                lo, hi = (mid, hi) if _binomial_cdf(successes, trials, mid, log_comb) > alpha / 2 else (lo, mid)
            else:  # P(X >= successes | mid) = 1 - P(X <= successes - 1 | mid) grows with mid
                upper_tail = 1.0 - _binomial_cdf(successes - 1, trials, mid, log_comb)
                lo, hi = (lo, mid) if upper_tail > alpha / 2 else (mid, hi)
        return (lo + hi) / 2

    low = 0.0 if successes == 0 else solve(below=False)
    high = 1.0 if successes == trials else solve(below=True)
    return low, high


def accuracy_difference(b: int, c: int, n: int, confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """(difference, low, high) of accuracy (variant − float32) over `n` paired 0/1 decisions.

    `b`: examples the variant gets right and float32 wrong; `c`: the reverse. The difference is
    (b − c) / n. Its interval is exact conditional on the d = b + c discordant examples: the
    Clopper–Pearson interval (πL, πH) of b out of d, mapped by π ↦ d(2π − 1)/n. With d = 0 both
    models decided every example alike and the interval is (0, 0).
    """
    if n <= 0 or b + c > n:
        raise ValueError(f"Expected n > 0 examples and b + c <= n. Received: b={b}, c={c}, n={n}")
    d = b + c
    if d == 0:
        return 0.0, 0.0, 0.0
    low, high = clopper_pearson(b, d, confidence)
    return (b - c) / n, d * (2 * low - 1) / n, d * (2 * high - 1) / n


def bootstrap_interval(differences: np.ndarray, confidence: float = CONFIDENCE, resamples: int = RESAMPLES,
                       seed: int = SEED) -> tuple[float, float, float]:
    """(mean, low, high) of paired per-example differences by a percentile bootstrap.

    rng = numpy.random.default_rng(seed); for each of `resamples` rounds, in order,
    idx = rng.integers(0, n, size=n) and the round's mean is differences[idx].mean() (float64);
    low and high are numpy.quantile(means, [α/2, 1 − α/2]) (its default, linear, method).
    """
    values = np.asarray(differences, dtype=np.float64).reshape(-1)
    n = len(values)
    if n == 0:
        raise ValueError("Expected at least one paired difference. Received: 0 examples")
    rng = np.random.default_rng(seed)
    means = np.empty(resamples, dtype=np.float64)
    for i in range(resamples):
        means[i] = values[rng.integers(0, n, size=n)].mean()
    alpha = 1.0 - confidence
    low, high = np.quantile(means, [alpha / 2, 1 - alpha / 2])
    return float(values.mean()), float(low), float(high)
