"""The FP8 telemetry-cost benchmark runs in quick mode and reports its five rows, and its sides time the same work
(the goal is not checked here: 150 steps on a shared machine cannot hold a 5% line)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from bench import fp8_overhead
from bench.engine_overhead import Bare, Engine, session_kept
from mpjobs.contract.spec import JobSpec
from worker.engine.data import SEGMENT_BYTES
from worker.telemetry.fp8_state import is_state


def test_fp8_overhead_quick_sets_the_fp8_engine_beside_bare_fp8_fit() -> None:
    rows = fp8_overhead.run(quick=True)
    assert [r.benchmark for r in rows] == ["fp8 overhead"] * 5
    assert [r.baseline for r in rows] == [
        "bare model.fit of the FP8 model, same steps per call", "bare model.fit of the FP8 model, same steps per call",
        "bare model.fit, same steps per call", "the same engine without FP8 state (no fp8 rows)",
        "bare model.fit without fp8"]
    assert rows[0].case.startswith("mlp mixed_bfloat16 + fp8, no float32 or layer checks, 150 steps")
    assert rows[1].case.startswith("mlp mixed_bfloat16 + fp8, float32 check and layer checks every 100")
    assert rows[2].case.startswith("mlp mixed_bfloat16 (no fp8), no float32 or layer checks")
    for row in rows:
        assert row.unit == "ms/step" and row.baseline_value is not None and row.baseline_value > 0 and row.value > 0
        assert row.ratio is not None and 0.1 < row.ratio < 10.0, f"{row.case}: ratio {row.ratio}"
        quartiles = re.search(r"\(quartiles of piece ratios (\d+\.\d\d)–(\d+\.\d\d)\)$", row.case)
        assert quartiles, row.case
        assert float(quartiles[1]) - 0.005 <= row.ratio <= float(quartiles[2]) + 0.005
    for row in rows[:3]:
        assert row.goal == "ratio <= 1.05" and row.met is (row.ratio is not None and row.ratio <= 1.05)
    for row in rows[3:]:
        assert row.goal == "" and row.met is None
    assert rows[0].baseline_value == rows[1].baseline_value == rows[4].value  # one bare FP8 side
    assert rows[2].baseline_value == rows[4].baseline_value and rows[0].value == rows[3].value


def test_the_fp8_sides_train_the_same_weights_and_differ_only_in_the_fp8_rows(tmp_path: Path) -> None:
    """The FP8 engine, the one that reads no FP8 state and bare Keras on the FP8 model, fed the same pieces,
    end bit-identical (the FP8 scales and amax histories included): the benchmark times the same arithmetic."""
    spec = fp8_overhead.Fp8Case({"name": "mlp"}, 40, 1).spec(fp8=True).model_dump(mode="json")
    spec["training"] |= {"steps": 40, "checkpoint_every": 40}
    job = JobSpec.model_validate(spec)
    engine = Engine(job, tmp_path / "engine")
    with session_kept(), fp8_overhead.fp8_state_unread():
        unread = Engine(job, tmp_path / "unread")
    bare = Bare(job)
    assert engine.training.optimizer.fp8_slots and not unread.training.optimizer.fp8_slots
    (x, y), = engine.training.segments(SEGMENT_BYTES)
    for half in (slice(0, len(x) // 2), slice(len(x) // 2, len(x))):
        for side in (engine, unread, bare):
            side.fit(x[half], y[half])
    engine.finish()
    unread.finish()
    assert all(r.fp8 for r in engine.reporter.records) and not any(r.fp8 for r in unread.reporter.records)
    assert {t.layer for t in engine.reporter.records[-1].fp8 or ()} == {"dense", "dense_1"}
    weights = engine.training.model.get_weights()
    assert sum(is_state(v) for v in engine.training.model.variables) == 12  # compared too: 6 per FP8 layer
    for other in (unread.training.model, bare.model):
        for ours, theirs in zip(weights, other.get_weights(), strict=True):
            np.testing.assert_array_equal(ours, theirs)
