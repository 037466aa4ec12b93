"""The evaluation-cost benchmark in quick mode: it runs one job end to end and sets an evaluation beside a step."""

from __future__ import annotations

from bench import evaluation_cost


def test_an_evaluation_is_measured_beside_a_training_step_of_the_same_job() -> None:
    one, added = evaluation_cost.run(quick=True)
    assert one.unit == "ms" and one.value > 0 and one.baseline_value and one.baseline_value > 0
    assert one.ratio is not None and abs(one.ratio - one.value / one.baseline_value) < 0.5 * one.ratio
    assert one.case.startswith("one evaluation, 819 held-out rows")  # 4,096 rows, split 0.2: floor(819.2 + 0.5)
    assert added.unit == "x" and added.ratio == added.value
    assert added.value == 1.0 + one.ratio / evaluation_cost.DEFAULT_EVERY
    assert one.met == (one.ratio <= 26)  # 819 rows in batches of 32
    assert added.met is None
