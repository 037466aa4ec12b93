"""A model trained by the real worker, downloaded through the client, loads with plain Keras where mpjobs is not."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import mpjobs
from scripts.stack import Stack
from tests.processes.plain_keras import load_plainly, same_bytes
from worker.engine import checkpoint


@pytest.fixture
def mp(stack: Stack) -> Iterator[mpjobs.Client]:
    with mpjobs.Client(stack.base_url, api_key="") as c:
        yield c


def test_a_downloaded_model_loads_compiled_with_plain_keras(mp: mpjobs.Client, stack: Stack, tmp_path: Path) -> None:
    keras = pytest.importorskip("keras")
    # Built under mixed_float16, as docs/client.md shows, so the float32 head's pin is in the config.
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(3), keras.layers.Activation("softmax", dtype="float32")])
    finally:
        keras.mixed_precision.set_global_policy("float32")
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    job = mp.submit(model, policy="mixed_float16", loss_scale={"mode": "dynamic", "initial_scale": 128,
                    "growth_steps": 2}, steps=5, batch_size=8, learning_rate=0.05, name="takeaway")
    assert job.wait(progress=False, timeout=180).state.value == "succeeded", job.error

    path = job.download_model(tmp_path / "trained.keras")
    assert path == tmp_path / "trained.keras"
    assert path.read_bytes() == (stack.artifacts / job.id / "model.keras").read_bytes()

    report, loaded = load_plainly(path, tmp_path / "fresh")
    assert report["mpjobs_importable"] is False and report["compiled"] is True
    assert (report["optimizer"], report["inner"], report["loss"]) == (
        "LossScaleOptimizer", "Adam", "sparse_categorical_crossentropy")
    assert report["learning_rate"] == pytest.approx(0.05, rel=1e-7) and report["iterations"] == 5
    # Step 5 is the first good step after the doubling at step 4: the scale it used is still the one in force.
    last = next(iter(job.pages())).points[-1]
    assert report["dynamic_scale"] == report["initial_scale"] == last.loss_scale
    assert report["growth_steps"] == 2
    saved = checkpoint.load(stack.artifacts / job.id)
    assert saved is not None and saved.step == 5
    weights = [loaded[f"weight_{i}"] for i in range(sum(k.startswith("weight_") for k in loaded))]
    assert same_bytes(weights, saved.model_values)
    assert report["iterations_after_fit"] == 1


def test_a_job_with_no_model_yet_is_not_found_with_the_apis_message(mp: mpjobs.Client, tmp_path: Path) -> None:
    job = mp.submit({"model": {"name": "mlp", "input_dim": 8, "hidden_units": 8}}, policy="float32",
                    steps=100_000, name="no model")
    job.cancel().wait(progress=False, timeout=180)
    assert job.state.value == "canceled"
    with pytest.raises(mpjobs.NotFound) as caught:
        job.download_model(tmp_path / "m.keras")
    assert caught.value.detail == f"Job {job.id!r} has no model.keras yet; it is written when the job succeeds."
    assert list(tmp_path.iterdir()) == []
