"""The engine-overhead benchmark still runs and compares like with like (quick mode; the goal is
not checked here: CI machines are too noisy for a 5% line on a 200-step run)."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import numpy as np
import pytest

from bench import engine_overhead
from worker.engine.data import SEGMENT_BYTES


def test_engine_overhead_sets_each_float32_case_beside_bare_fit() -> None:
    rows = engine_overhead.run(quick=True, repeats=1)
    assert [r.case.split(",")[0].split(":")[0] for r in rows] == ["mlp float32"] * 2 + ["cnn float32"] * 2
    for row in rows:
        assert row.unit == "ms/step" and row.baseline_value is not None and row.baseline_value > 0 and row.value > 0
        assert row.ratio is not None and 0.1 < row.ratio < 2.0, f"{row.case}: ratio {row.ratio}"
    for row in rows[::2]:  # against bare fit at the steps per call the engine chose
        assert row.baseline == "bare model.fit, same steps per call"
        assert row.goal == "ratio <= 1.05" and row.met is (row.ratio is not None and row.ratio <= 1.05)
        spread = re.search(r"at (\d+)(–\d+)? steps per call \(automatic\), 1 repeats of 5 pieces "
                           r"\(quartiles of piece ratios (\d\.\d\d)–(\d\.\d\d)\)", row.case)
        assert spread, row.case
        assert int(spread[1]) >= 1
        assert float(spread[3]) - 0.005 <= row.ratio <= float(spread[4]) + 0.005
    for row in rows[1::2]:  # against the engine through fit, one step per call
        assert row.baseline == "the engine at one step per call (fit)"
    assert rows[1].goal == "ratio <= 0.6" and rows[1].met is (rows[1].ratio is not None and rows[1].ratio <= 0.6)
    assert rows[3].goal == "" and rows[3].met is None  # the goal is the MLP's


def test_the_sides_train_the_same_weights(tmp_path: Path) -> None:
    """Bare Keras and the engine, fed the same pieces, end bit-identical: the benchmark times the same work."""
    case = engine_overhead.Case({"name": "mlp"}, "float32", 40, 1)
    engine = engine_overhead.Engine(case.spec(40), tmp_path / "engine")
    bare = engine_overhead.Bare(case.spec(40))  # after the engine, which starts from a clear session
    (x, y), = engine.training.segments(SEGMENT_BYTES)
    for half in (slice(0, len(x) // 2), slice(len(x) // 2, len(x))):
        engine.fit(x[half], y[half])
        bare.fit(x[half], y[half])
    pieces = engine.finish()
    assert [len(p) for p in pieces] == [20, 20] and [len(p) for p in bare.pieces] == [20, 20]
    for ours, theirs in zip(engine.training.model.get_weights(), bare.model.get_weights(), strict=True):
        np.testing.assert_array_equal(ours, theirs)


def test_float32_check_cost_sets_the_check_beside_the_same_engine_without_it() -> None:
    from bench import float32_check

    rows = float32_check.run(quick=True, repeats=1)
    assert [r.baseline for r in rows] == ["same engine, check off", "one training step", "one training step",
                                          "same engine, layer checks off", "one training step", "one training step",
                                          "one training step"]
    assert [r.benchmark for r in rows] == ["float32 check"] * 3 + ["layer checks"] * 4
    for row in rows:
        assert row.baseline_value is not None and row.baseline_value > 0 and row.value > 0
        assert row.ratio is not None and row.ratio == pytest.approx(row.value / row.baseline_value, rel=0.5)
    for first in (rows[0], rows[3]):
        assert first.goal == "ratio <= 1.05" and first.met is (first.ratio is not None and first.ratio <= 1.05)
    assert rows[2].value > rows[1].value and rows[5].value > rows[4].value  # the first check builds and traces
    assert rows[6].goal == "ratio <= 1.05" and rows[6].met is (rows[6].ratio is not None and rows[6].ratio <= 1.05)
    # The sides differ in what they say they differ in: the layer-check side records layer checks.
    with tempfile.TemporaryDirectory() as out:
        off, on = float32_check.sides(2, Path(out), layers=True)
        (x, y), = on.training.segments(SEGMENT_BYTES)
        for side in (off, on):
            side.fit(x, y)
            side.finish()
        assert [len(side.reporter.layer_checks) for side in (off, on)] == [0, 1]
        assert off.reporter.records[0].excess_zero_fraction is not None  # the float32 check ran on both


def test_speed_check_bench_gives_the_aa_noise_and_each_variants_call() -> None:
    from bench import speed_check

    job = speed_check.spec({"name": "mlp", "input_dim": 64, "hidden_units": 32})
    repeat = speed_check.measure(job, steps=1, rounds=5)
    rows = speed_check.rows([speed_check.Series("mlp", "quiet", 5, 1, [repeat])])
    assert len(rows) == 1 + len(speed_check.VARIANTS)
    noise, *variants = rows
    assert noise.baseline == "no difference" and noise.value == repeat.noise_high and not noise.goal
    assert repeat.noise_low <= repeat.noise_high and repeat.seconds > 0
    for row, variant in zip(variants, speed_check.VARIANTS, strict=True):
        timing = repeat.timings[variant.label]
        assert isinstance(timing, speed_check.Timing), timing
        assert timing.low <= timing.slowdown <= timing.high and row.ratio == timing.slowdown
        assert row.value == timing.policy_ms and row.baseline_value == timing.float32_ms
        assert f"calls {timing.difference} 1" in row.case
        # One repeat always agrees with itself; the A/A side is right only when it calls "none".
        assert row.met is (timing.difference == "none" if variant is speed_check.AA else True)
    table = speed_check.details([speed_check.Series("mlp", "quiet", 5, 1, [repeat])])
    assert table.count("\n| mlp | quiet |") == 1 + len(speed_check.VARIANTS)
