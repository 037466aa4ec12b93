"""A valid spec that asks for something without effect is told so: loss scaling outside float16."""

from __future__ import annotations

import pytest

from app.core.notes import spec_notes
from mpjobs.contract.spec import JobSpec


def spec(policy: str, scale: object) -> JobSpec:
    return JobSpec.model_validate({"model": {"name": "mlp"}, "precision_policy": policy, "loss_scale": scale})


@pytest.mark.parametrize(("policy", "scale"), [
    ("float32", "dynamic"), ("float32", {"mode": "fixed", "scale": 1024}),
    ("mixed_bfloat16", "dynamic"), ("bfloat16", {"mode": "fixed", "scale": 8}),
])
def test_loss_scaling_outside_float16_gets_a_note(policy: str, scale: object) -> None:
    [note] = spec_notes(spec(policy, scale))
    assert note.startswith(f"Loss scaling has no effect under {policy}: ")
    assert "Use loss_scale 'none'" in note


@pytest.mark.parametrize(("policy", "scale"), [
    ("float32", "none"), ("float32", None), ("mixed_float16", "dynamic"), ("float16", {"mode": "fixed", "scale": 8}),
    ("mixed_float16", "none"), ("mixed_bfloat16", None),
])
def test_a_spec_that_does_what_it_says_gets_none(policy: str, scale: object) -> None:
    assert spec_notes(spec(policy, scale)) == []


@pytest.mark.parametrize(("model", "needs", "elsewhere"), [
    ({"name": "transformer"}, "the transformer's PositionEmbedding layer", "not even with compile=False"),
    ({"name": "conv3d_unet"}, "conv3d_unet's loss ScanVoxelSum", "only uncompiled, with compile=False"),
])
def test_a_model_needing_mpjobs_classes_to_load_gets_a_note(model: dict[str, str], needs: str,
                                                            elsewhere: str) -> None:
    [note] = spec_notes(JobSpec.model_validate({"model": model}))
    assert note.startswith(f"The trained model.keras uses {needs}, a class of the mpjobs worker")
    assert f"elsewhere {elsewhere}." in note
