"""A dynamic scale's skips are told apart: coming down from the initial scale, probing upward, or gradient spikes.

Reported: skips at steps 222, 475 and 875 were explained as "a few skips at the start are normal".
The expected counts here come from the step records alone, by the rule docs/numerics.md states:
a skip before the scale ever grew is the descent; one while the scale's last change was a doubling
is a probe; the rest happened at a scale that had held since it last halved.
"""

from __future__ import annotations

from mpjobs.cli.words import loss_scale_words, power_of_two
from mpjobs.contract.records import DiagnosisCode, StepRecord
from tests.worker.conftest import Train, spec_of


def expected_kinds(records: list[StepRecord]) -> dict[str, tuple[int, int]]:
    kinds: dict[str, list[int]] = {"descent": [], "probe": [], "spike": []}
    grew, rose_last = False, False
    for before, r in zip([None, *records], records, strict=False):
        if before is not None and r.loss_scale != before.loss_scale:
            rose_last = r.loss_scale > before.loss_scale
            grew = grew or rose_last
        if r.skipped:
            kinds["descent" if not grew else "probe" if rose_last else "spike"].append(r.step)
    return {kind: (len(steps), steps[0]) for kind, steps in kinds.items() if steps}


def test_skips_are_explained_by_what_the_dynamic_scale_was_doing(train: Train) -> None:
    spec = spec_of(model={"name": "mlp", "input_dim": 32, "hidden_units": 16}, precision_policy="mixed_float16",
                   loss_scale={"mode": "dynamic", "initial_scale": 2.0**32, "growth_steps": 20},
                   training={"steps": 120, "batch_size": 16}, dataset={"samples": 256})
    result, reporter = train(spec)
    kinds = expected_kinds(reporter.records)
    assert set(kinds) >= {"descent", "probe"}, kinds  # this run starts far too high, then probes every 20 steps
    [skips] = [d for d in result.summary.diagnoses if d.code is DiagnosisCode.OVERFLOW_SKIPS]
    assert "a few skips at the start are normal" not in skips.message
    descent, first = kinds["descent"]
    assert (f"{descent} while the scale came down from its initial 2^32 to one the gradients fit, halving after "
            f"each (from step {first})") in skips.message
    probes, first = kinds["probe"]
    assert f"{probes} when the scale probed upward (first at step {first})" in skips.message
    if "spike" in kinds:
        spikes, first = kinds["spike"]
        assert f"{spikes} at a scale that had held (first at step {first})" in skips.message
    else:
        assert "at a scale that had held" not in skips.message
    total = sum(count for count, _ in kinds.values())
    assert skips.message.startswith(f"{total} of 120 steps were skipped")


def test_loss_scales_are_written_as_powers_of_two() -> None:
    assert power_of_two(2.0**32) == "2^32" and power_of_two(32768.0) == "32768" and power_of_two(1000.0) == "1000"
    assert loss_scale_words({"mode": "dynamic", "initial_scale": 2.0**32, "growth_steps": 2000}) == (
        "dynamic loss scale from 2^32, doubling after 2000 finite steps")
