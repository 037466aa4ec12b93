"""Bring-your-own models and data, and the bad-input cases the engine must catch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

from app.core.config import Settings
from app.core.errors import JobFailed
from mpjobs.contract.jobs import FailureReason
from scripts.stack import ROOT
from tests.worker.conftest import Train, spec_of


def small_regressor() -> str:
    model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])
    return str(model.to_json())


def test_keras_json_model_trains_under_its_policy(train: Train) -> None:
    spec = spec_of(model={"keras_json": small_regressor(), "loss": "mean_squared_error"},
                   precision_policy="mixed_float16", training={"steps": 30, "learning_rate": 0.01},
                   dataset={"samples": 256})
    result, reporter = train(spec)
    losses = [r.loss for r in reporter.records]
    assert result.status == "succeeded" and len(losses) == 30
    assert losses[-1] is not None and losses[0] is not None and losses[-1] < losses[0]
    assert reporter.records[0].loss_scale == 32768.0


@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_transformer_trains_and_saves(train: Train, policy: str) -> None:
    model = {"name": "transformer", "seq_len": 16, "vocab_size": 50, "d_model": 16, "heads": 2, "layers": 1,
             "ffn_dim": 32, "dropout": 0.1}
    spec = spec_of(model=model, precision_policy=policy, training={"steps": 4, "batch_size": 8},
                   dataset={"samples": 64})
    result, reporter = train(spec)
    assert [r.step for r in reporter.records] == [1, 2, 3, 4]
    assert all(r.loss is not None for r in reporter.records)
    # Under float16 the first steps may overflow at 32768; dynamic scaling skips those.
    assert all(r.grads_finite or r.skipped for r in reporter.records)
    assert (policy == "mixed_float16") or all(r.grads_finite for r in reporter.records)
    assert result.model_path is not None
    loaded = keras.models.load_model(result.model_path, compile=False)
    assert loaded.output_shape == (None, 10)


def test_npz_dataset_is_read_from_the_data_root(train: Train, settings: Settings) -> None:
    rng = np.random.default_rng(1)
    settings.data_root.mkdir(parents=True)
    x = rng.standard_normal((128, 784)).astype(np.float32)
    np.savez(settings.data_root / "digits.npz", x=x, y=rng.integers(0, 10, 128))
    result, reporter = train(spec_of(dataset={"kind": "npz", "path": "digits.npz"}, training={"steps": 5}))
    assert [r.step for r in reporter.records] == [1, 2, 3, 4, 5]


def test_symlink_out_of_the_data_root_is_refused(train: Train, settings: Settings, tmp_path: Path) -> None:
    outside = tmp_path / "outside.npz"
    np.savez(outside, x=np.zeros((64, 784), np.float32), y=np.zeros(64, np.int32))
    settings.data_root.mkdir(parents=True)
    os.symlink(outside, settings.data_root / "link.npz")
    out = tmp_path / "never-written"
    with pytest.raises(JobFailed) as raised:
        train(spec_of(dataset={"kind": "npz", "path": "link.npz"}), out=out)
    assert raised.value.reason is FailureReason.INVALID_DATASET
    assert "dataset.path" in raised.value.message
    assert not out.exists()


def test_npz_with_wrong_shape_names_the_shapes(train: Train, settings: Settings, tmp_path: Path) -> None:
    settings.data_root.mkdir(parents=True)
    np.savez(settings.data_root / "bad.npz", x=np.zeros((64, 10), np.float32), y=np.zeros(64, np.int32))
    with pytest.raises(JobFailed) as raised:
        train(spec_of(dataset={"kind": "npz", "path": "bad.npz"}), out=tmp_path / "no")
    assert raised.value.reason is FailureReason.INVALID_DATASET
    assert "(10,)" in raised.value.message and "(784,)" in raised.value.message
    assert not (tmp_path / "no").exists()


def test_broken_keras_json_is_an_invalid_model(train: Train, tmp_path: Path) -> None:
    config = json.loads(small_regressor())
    config["config"]["layers"][1]["config"].update(units="many", name="hidden")
    spec = spec_of(model={"keras_json": json.dumps(config), "loss": "huber"})
    with pytest.raises(JobFailed) as raised:
        train(spec, out=tmp_path / "no")
    assert raised.value.reason is FailureReason.INVALID_MODEL
    # Keras's own message carries kilobytes of config ahead of its cause: the cause comes first, in one line.
    assert raised.value.message == ("model.keras_json could not be loaded: layer 'hidden' (Dense): Received an invalid "
                                    "value for `units`, expected a positive integer. Received: units=many")
    assert not (tmp_path / "no").exists()


def test_a_string_input_is_an_invalid_model_saying_what_is_allowed(train: Train, tmp_path: Path) -> None:
    config = json.loads(small_regressor())
    config["config"]["layers"][0]["config"].update(dtype="string", name="words")
    with pytest.raises(JobFailed) as raised:
        train(spec_of(model={"keras_json": json.dumps(config), "loss": "mse"}), out=tmp_path / "no")
    assert raised.value.reason is FailureReason.INVALID_MODEL
    assert raised.value.message.startswith("model.keras_json input 'words' has dtype 'string': mpjobs trains "
                                           "on numbers")
    assert "must be a float or an integer" in raised.value.message
    assert not (tmp_path / "no").exists()


def test_token_ids_are_sized_by_an_embedding_inside_a_nested_model(train: Train) -> None:
    encoder = keras.Sequential([keras.Input((6,), dtype="int32"), keras.layers.Embedding(40, 4),
                                keras.layers.GlobalAveragePooling1D()], name="encoder")
    inputs = keras.Input((6,), dtype="int32")
    model = keras.Model(inputs, keras.layers.Dense(2)(encoder(inputs)))
    # Synthetic ids: below 40, or the Embedding's lookup fails (on CPU); at 40 rows and 96 ids most rows are used.
    result, reporter = train(spec_of(model={"keras_json": model.to_json(), "loss": "mse"},
                                     training={"steps": 1, "batch_size": 16}, dataset={"samples": 16}))
    assert result.status == "succeeded" and reporter.records[0].grads_finite
    assert 0.0 < reporter.records[0].zero_grad_fraction < 0.5


@pytest.mark.parametrize("shape", [(3, 6), ()], ids=["three sequences of six ids", "one id"])
def test_token_ids_of_any_shape_are_sized_by_an_embedding_inside_a_wrapper(train: Train, shape: tuple[int, ...]
                                                                           ) -> None:
    """Ids of rank 1 or 3 made the synthetic labels fail (`internal`): they assumed (samples, sequence)."""
    inputs = keras.Input(shape, dtype="int32")
    embedded = keras.layers.TimeDistributed(keras.layers.Embedding(40, 4))(inputs) if shape else \
        keras.layers.Embedding(40, 4)(inputs)
    model = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Flatten()(embedded)))
    result, reporter = train(spec_of(model={"keras_json": model.to_json(), "loss": "mse"},
                                     training={"steps": 1, "batch_size": 16}, dataset={"samples": 16}))
    assert result.status == "succeeded" and reporter.records[0].grads_finite


def test_integer_inputs_without_an_embedding_train_on_an_npz(train: Train, settings: Settings) -> None:
    # Ids one-hot encoded, no Embedding: nothing sizes synthetic ids, and an .npz needs none.
    model = keras.Sequential([keras.Input((3,), dtype="int32"),
                              keras.layers.CategoryEncoding(num_tokens=5, output_mode="multi_hot"),
                              keras.layers.Dense(2)])
    settings.data_root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    np.savez(settings.data_root / "ids.npz", x=rng.integers(0, 5, (16, 3)).astype(np.int32),
             y=rng.standard_normal((16, 2)).astype(np.float32))
    result, reporter = train(spec_of(model={"keras_json": model.to_json(), "loss": "mse"},
                                     dataset={"kind": "npz", "path": "ids.npz"},
                                     training={"steps": 1, "batch_size": 16}))
    assert result.status == "succeeded" and reporter.records[0].grads_finite
    with pytest.raises(JobFailed) as raised:  # synthetic data has nothing to size its ids by
        train(spec_of(model={"keras_json": model.to_json(), "loss": "mse"}))
    assert raised.value.message == ("model has integer inputs but no Embedding layer to size the synthetic token ids: "
                                    "add one, or train on your own ids (dataset.kind 'npz').")


def test_a_model_of_two_inputs_is_an_invalid_model_naming_them(train: Train, tmp_path: Path) -> None:
    first, second = keras.Input((3,), name="first"), keras.Input((4,), name="second")
    joined = keras.layers.Concatenate()([keras.layers.Dense(2)(first), keras.layers.Dense(2)(second)])
    model = keras.Model([first, second], keras.layers.Dense(1, name="out")(joined))
    # The API refuses it first (tests/mpjobs/contract/test_schemas.py); the worker's own check covers what
    # reaches it anyway (a job queued before, a config shape the API does not read):
    # the spec is built past the API's validation.
    spec = spec_of(model={"keras_json": keras.Model(first, first).to_json(), "loss": "mse"})
    spec = spec.model_copy(update={"model": spec.model.model_copy(update={"keras_json": model.to_json()})})
    with pytest.raises(JobFailed) as raised:
        train(spec, out=tmp_path / "no")
    assert raised.value.reason is FailureReason.INVALID_MODEL
    assert raised.value.message == (
        "model.keras_json must have exactly one input and one output: mpjobs feeds each step one array x "
        "(generated, or the .npz's x) and compares the output with one y. Received: 2 inputs ('first', 'second') "
        "and 1 output ('out').")
    assert not (tmp_path / "no").exists()


def test_an_npz_of_strings_is_an_invalid_dataset_saying_what_is_allowed(train: Train, settings: Settings,
                                                                        tmp_path: Path) -> None:
    settings.data_root.mkdir(parents=True)
    np.savez(settings.data_root / "words.npz", x=np.array([["a"] * 784] * 64), y=np.zeros(64, np.int32))
    with pytest.raises(JobFailed) as raised:
        train(spec_of(dataset={"kind": "npz", "path": "words.npz"}), out=tmp_path / "no")
    assert raised.value.reason is FailureReason.INVALID_DATASET
    assert raised.value.message == ("dataset 'x' in 'words.npz' holds text: models train on numbers, so 'x' must be "
                                    "an array of floats, integers or booleans. Received: dtype='<U1'")
    assert not (tmp_path / "no").exists()


@pytest.mark.parametrize(("content", "what"), [
    pytest.param(b"x,y\n1,2\n", "starts with b'x,y\\n1,2\\n'", id="text"),
    pytest.param(b"", "is empty", id="empty"),
    pytest.param(None, "is a single .npy array", id="npy"),
])
def test_a_file_that_is_not_an_npz_is_called_so(train: Train, settings: Settings, tmp_path: Path,
                                                content: bytes | None, what: str) -> None:
    """NumPy reads an unknown file as a pickle, and would have the job say it holds pickled data."""
    settings.data_root.mkdir(parents=True)
    path = settings.data_root / "data.npz"
    if content is None:
        with open(path, "wb") as file:
            np.save(file, np.zeros((64, 784), np.float32))
    else:
        path.write_bytes(content)
    with pytest.raises(JobFailed) as raised:
        train(spec_of(dataset={"kind": "npz", "path": "data.npz"}), out=tmp_path / "no")
    assert raised.value.reason is FailureReason.INVALID_DATASET
    assert raised.value.message == (
        f"dataset.path 'data.npz' is not an .npz file: it {what}. Expected a zip archive of arrays 'x' and 'y', "
        "as numpy.savez(path, x=..., y=...) writes (it starts with b'PK').")


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "worker.train", *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)


@pytest.mark.processes
def test_cli_prints_one_line_per_step_then_the_summary(tmp_path: Path) -> None:
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"model": {"name": "mlp"}, "training": {"steps": 7, "checkpoint_every": 3}}))
    done = run_cli(str(spec), "--out", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert [line["step"] for line in lines[:-1]] == list(range(1, 8))
    assert set(lines[0]) == {"step", "loss", "loss_scale", "grad_norm", "grads_finite", "skipped",
                             "zero_grad_fraction", "regularization_loss", "excess_zero_fraction", "grad_rel_error",
                             "fp8", "learning_rate", "examples_per_sec", "step_time_ms", "time"}
    assert lines[-1]["status"] == "succeeded" and lines[-1]["summary"]["steps_done"] == 7
    assert (tmp_path / "out" / "model.keras").exists() and (tmp_path / "out" / "checkpoint-000000007.npz").exists()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "out" / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == list(range(1, 8))


@pytest.mark.processes
def test_cli_refuses_a_bad_spec_and_writes_nothing(tmp_path: Path) -> None:
    spec = tmp_path / "bad.json"
    spec.write_text(json.dumps({"model": {"name": "mlp"}, "precision_policy": "fp8",
                                "training": {"learning_rate": -1}}))
    done = run_cli(str(spec), "--out", str(tmp_path / "out"))
    assert done.returncode == 2
    error = json.loads(done.stdout)["error"]
    assert error["reason"] == "invalid_spec"
    assert {e["field"] for e in error["errors"]} == {"precision_policy", "training.learning_rate"}
    assert not (tmp_path / "out").exists()


def keras_job(model: keras.Model, loss: str = "mse", **fields: object) -> dict[str, object]:
    return {"model": {"keras_json": model.to_json(), "loss": loss}, "training": {"steps": 2, "batch_size": 8},
            "dataset": {"samples": 16}, **fields}


def named(train: Train, spec: dict[str, object]) -> JobFailed:
    with pytest.raises(JobFailed) as raised:
        train(spec_of(**spec))
    return raised.value


def test_a_class_loss_without_a_class_axis_and_an_empty_shape_are_invalid_models(train: Train) -> None:
    """Found by running many models from outside: each failed `internal` (an IndexError in the synthetic labels,
    Keras's rank check), or `diverged` on the NaN mean of no values."""
    inputs = keras.Input((8,))
    scalar = keras.Model(inputs, keras.layers.Reshape(())(keras.layers.Dense(1)(inputs)))
    one_class = keras.Model(inputs, keras.layers.Reshape((4, 1))(keras.layers.Dense(4)(inputs)))
    for model, loss, shape in [(scalar, "sparse_categorical_crossentropy", "(None,)"),
                               (scalar, "categorical_crossentropy", "(None,)"),
                               (one_class, "sparse_categorical_crossentropy", "(None, 4, 1)")]:
        failure = named(train, keras_job(model, loss))
        assert failure.reason is FailureReason.INVALID_MODEL, failure
        assert failure.message.startswith(f"model.keras_json output has shape {shape}: loss {loss!r} needs a last "
                                          "axis of at least 2 classes"), failure.message
    empty = keras.Input((0, 4))
    failure = named(train, keras_job(keras.Model(empty, keras.layers.Dense(2)(keras.layers.Flatten()(empty)))))
    assert failure.reason is FailureReason.INVALID_MODEL
    assert failure.message.startswith("model.keras_json input has shape (None, 0, 4): a dimension of size 0")


@pytest.mark.parametrize(("policy", "loss_scale"), [("float32", "none"), ("mixed_float16", "dynamic")])
def test_an_output_no_gradient_reaches_is_an_invalid_model_under_any_policy(train: Train, policy: str,
                                                                            loss_scale: str) -> None:
    """Before: `internal` (Keras's "No gradients provided") under float32, and under loss scaling every step
    "skipped" with non-finite gradients and the scale halving, explained as overflow."""
    inputs = keras.Input((8,))
    model = keras.Model(inputs, keras.ops.stop_gradient(keras.layers.Dense(2)(inputs)))
    failure = named(train, keras_job(model, precision_policy=policy, loss_scale=loss_scale))
    assert failure.reason is FailureReason.INVALID_MODEL
    assert failure.message.startswith("No gradient reaches any of the model's 2 trainable weights"), failure.message


def test_token_ids_fit_every_embedding_and_a_nested_layer_without_a_float16_kernel_runs_in_float32(
        train: Train) -> None:
    ids = keras.Input((6,), dtype="int32")  # two Embeddings read the same ids: the ids must fit the smaller one
    both = [keras.layers.Flatten()(keras.layers.Embedding(n, 4)(ids)) for n in (50, 5)]
    result, _ = train(spec_of(**keras_job(keras.Model(ids, keras.layers.Dense(2)(keras.layers.Concatenate()(both))))))
    assert result.status == "succeeded"
    volume = keras.Input((6, 6, 6, 1))  # MaxPooling3D has no float16 CPU kernel, nested as at the top level
    inner = keras.Sequential([keras.Input((6, 6, 6, 1)), keras.layers.Conv3D(2, 3), keras.layers.MaxPooling3D(),
                              keras.layers.Flatten()], name="inner")
    model = keras.Model(volume, keras.layers.Dense(2)(inner(volume)))
    result, reporter = train(spec_of(**keras_job(model, precision_policy="mixed_float16")))
    assert result.status == "succeeded" and len(reporter.records) == 2  # before: unsupported_precision_on_device
    assert [d.message for d in result.summary.diagnoses if d.code == "float32_fallback"] == [
        "This device has no float16 kernel for max_pooling3d, so those layers ran in float32 (pooling is exact in "
        "either precision); the rest of the model ran under mixed_float16."]


def test_a_keras_error_names_its_cause_not_its_heading(train: Train) -> None:
    """A stateful LSTM built for batches of 4, trained on 8: Keras's first line says only where it failed."""
    model = keras.Sequential([keras.Input((5, 3), batch_size=4), keras.layers.LSTM(4, stateful=True),
                              keras.layers.Dense(2)])
    failure = named(train, keras_job(model))
    assert failure.message.startswith("ValueError: If an RNN is stateful, the batch size of the input sequences "
                                      "must be the same as the batch size of the initial state."), failure.message
    assert "Expected batch size: 4 - Received batch size: 8 (in LSTM.call())" in failure.message


def test_synthetic_ids_hold_no_padding_for_an_embedding_that_masks_zero(train: Train) -> None:
    """Before: id 0 drawn too, so a whole row of two ids was often all padding; the masked mean of nothing is
    NaN, and the job failed `diverged` with advice about the learning rate."""
    ids = keras.Input((2,), dtype="int32")
    pooled = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(3, 4, mask_zero=True)(ids))
    result, reporter = train(spec_of(**keras_job(keras.Model(ids, keras.layers.Dense(2)(pooled)))))
    assert result.status == "succeeded"
    assert all(r.loss is not None and r.grads_finite for r in reporter.records)


@pytest.mark.parametrize("loss", ["kl_divergence", "hinge", "squared_hinge"])
def test_synthetic_labels_are_what_the_loss_takes(train: Train, loss: str) -> None:
    """Before: real-valued teacher scores for all three; a width-1 softmax under kl_divergence reported a negative
    loss (-0.23), which a divergence never is."""
    from worker.engine.data import synthetic

    _, y = synthetic((8,), (3,), loss, 64, 0)
    if loss == "kl_divergence":
        assert np.all(y > 0) and np.allclose(y.sum(axis=-1), 1.0, atol=1e-6)
    else:
        assert set(np.unique(y)) == {-1.0, 1.0}
    inputs = keras.Input((8,))
    head = keras.layers.Dense(3, activation="softmax" if loss == "kl_divergence" else "tanh")(inputs)
    result, reporter = train(spec_of(**keras_job(keras.Model(inputs, head), loss)))
    assert result.status == "succeeded" and all(r.loss is not None and r.loss >= 0 for r in reporter.records)
