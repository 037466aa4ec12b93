"""The speed check's interval: the order statistics that hold the median per-round ratio with 95% confidence."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from mpjobs.contract.spec import PrecisionPolicy, Variant
from tests.worker.conftest import spec_of
from worker.engine.optimizers import make_optimizer
from worker.numerics import speed as speed_module
from worker.numerics.speed import ROUNDS, measure_all, median_interval, variant_spec


@pytest.mark.parametrize(("n", "k"), [(1, 1), (5, 1), (6, 1), (8, 1), (9, 2), (11, 2), (12, 3), (20, 6)])
def test_the_interval_is_the_kth_smallest_to_the_kth_largest(n: int, k: int) -> None:
    """k from a table of the binomial distribution (Conover, Practical Nonparametric Statistics, table A3):
    the largest k with P(Binomial(n, 1/2) < k) at most 2.5%."""
    values = list(np.random.default_rng(n).permutation(np.arange(1.0, n + 1)))
    assert median_interval(values) == (float(k), float(n + 1 - k))


def test_the_interval_holds_the_median_at_least_95_in_100_times() -> None:
    """Simulated: samples of 9 from a skewed distribution whose median is known (exponential: ln 2)."""
    samples = np.random.default_rng(0).exponential(size=(20_000, ROUNDS))
    held = [low <= np.log(2) <= high for low, high in (median_interval(list(row)) for row in samples)]
    assert 0.95 <= np.mean(held) <= 0.975  # 1 - 2·10/512 = 0.961 exactly


@pytest.mark.slow
def test_a_measurement_reports_those_order_statistics_of_its_own_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    sides: list[Any] = []
    original = speed_module._Side.__init__

    def recorded(self: Any, *args: Any) -> None:
        original(self, *args)
        sides.append(self)

    monkeypatch.setattr(speed_module._Side, "__init__", recorded)
    base = spec_of(training={"steps": 4})
    spec = variant_spec(base, Variant(precision_policy=PrecisionPolicy.MIXED_BFLOAT16))
    x = np.random.default_rng(0).standard_normal((2 * base.training.batch_size, 784)).astype("float32")
    timed = measure_all([spec], x, np.zeros(len(x), dtype="int64"), on_cpu_tf=True, make_optimizer=make_optimizer)
    assert timed is not None and (speed := timed[0].speed) is not None
    reference, twin, policy = sides  # built in this order
    ratios = np.sort(np.array(policy.pieces) / np.array(reference.pieces))
    noise = np.sort(np.array(twin.pieces) / np.array(reference.pieces))
    assert len(ratios) == ROUNDS == speed.rounds
    assert (speed.low, speed.high) == pytest.approx((ratios[1], ratios[-2]))
    assert (speed.noise_low, speed.noise_high) == pytest.approx((noise[1], noise[-2]))
    assert speed.slowdown == pytest.approx(float(np.median(ratios)))
