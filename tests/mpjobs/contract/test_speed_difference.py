"""The speed call (`speed_difference`) at and around each of its thresholds, every expected call written by hand.

A policy is `slower` only when its whole slowdown interval lies above both 1 and the A/A noise, `faster` only when
it lies below both (docs/numerics.md); an interval that touches a threshold is no measurable difference.
"""

from __future__ import annotations

import pytest

from mpjobs.contract.records import speed_difference

NOISE = (0.96, 1.04)
"""A quiet machine's A/A interval: inside 1 on both sides, so the thresholds are the noise itself."""


@pytest.mark.parametrize(("low", "high", "noise", "call"), [
    # equal speed, and intervals around 1
    (1.0, 1.0, NOISE, "none"),
    (0.98, 1.02, NOISE, "none"),
    (0.5, 1.5, NOISE, "none"),  # straddles 1: its median says nothing
    # slower: the interval's low end against max(1, noise_high)
    (1.3, 1.5, NOISE, "slower"),
    (1.04, 1.2, NOISE, "none"),  # low exactly at noise_high: touching is not beyond
    (1.0401, 1.2, NOISE, "slower"),  # just past it
    (1.02, 1.2, NOISE, "none"),  # above 1 but inside the noise
    (1.0, 1.2, (0.9, 0.99), "none"),  # noise below 1: the threshold is 1 itself, and 1 is not beyond it
    (1.0001, 1.2, (0.9, 0.99), "slower"),
    (1.6, 2.0, (0.5, 2.1), "none"),  # a noisy machine: well above 1, inside its noise
    # faster: the interval's high end against min(1, noise_low)
    (0.45, 0.55, NOISE, "faster"),
    (0.8, 0.96, NOISE, "none"),  # high exactly at noise_low
    (0.8, 0.9599, NOISE, "faster"),
    (0.8, 0.98, NOISE, "none"),  # below 1 but inside the noise
    (0.8, 1.0, (1.01, 1.1), "none"),  # noise above 1: the threshold is 1 itself
    (0.8, 0.9999, (1.01, 1.1), "faster"),
    (0.6, 0.8, (0.55, 1.6), "none"),  # a noisy machine: well below 1, inside its noise
])
def test_the_call_at_each_threshold(low: float, high: float, noise: tuple[float, float], call: str) -> None:
    assert speed_difference(low, high, *noise) == call


def test_the_call_reads_the_interval_not_the_ratio_inverted() -> None:
    """A step time above float32's is slower, below it faster: the same figures mirrored give the opposite call."""
    assert (speed_difference(2.0, 2.5, *NOISE), speed_difference(0.4, 0.5, *NOISE)) == ("slower", "faster")
