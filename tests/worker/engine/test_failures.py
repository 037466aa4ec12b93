"""Named failures: divergence keeps the last good checkpoint; a time limit fails with `timeout`.

Divergence fails "within a bounded number of steps" (docs/reliability.md): the runs below put
non-finite values at steps the test chooses, so the step each rule must fire at is known
before the run.
"""

from __future__ import annotations

from pathlib import Path

import keras
import numpy as np
import pytest

from app.core.config import Settings
from app.core.errors import JobFailed
from mpjobs.contract.jobs import FailureReason
from mpjobs.contract.spec import JobSpec
from tests.worker.conftest import Train, spec_of
from worker.engine import checkpoint
from worker.engine.training import run_job
from worker.telemetry.reporters import ListReporter

FEATURES = 4
PATIENCE = 10
"""docs/numerics.md: a scaled run fails once its loss was non-finite 10 steps in a row."""
FLOAT16_MAX = 65504.0


def linear_model() -> str:
    """One Dense unit and mean squared error: a NaN input makes the loss NaN, nothing clips it."""
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(1)])
    return model.to_json()


def sample_of_step(step: int, samples: int, seed: int = 0) -> int:
    """The sample a batch_size-1 run trains on at `step` of its first epoch: epoch e's order is
    the permutation drawn from default_rng([seed, e]) (worker/engine/data.py's documented rule)."""
    return int(np.random.default_rng([seed, 0]).permutation(samples)[step - 1])


def write_dataset(settings: Settings, name: str, samples: int, poison: dict[int, tuple[float, float]]) -> str:
    """A learnable linear set, except that the sample of each step in `poison` gets (input, label)."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((samples, FEATURES)).astype(np.float32)
    y = (x @ rng.standard_normal((FEATURES, 1)) * 0.5).astype(np.float32)
    for step, (value, label) in poison.items():
        index = sample_of_step(step, samples)
        x[index], y[index] = value, label
    settings.data_root.mkdir(parents=True, exist_ok=True)
    np.savez(settings.data_root / name, x=x, y=y)
    return name


def run_to_failure(spec: JobSpec, settings: Settings, out: Path) -> tuple[JobFailed, ListReporter]:
    reporter = ListReporter()
    with pytest.raises(JobFailed) as raised:
        run_job(spec, reporter=reporter, checkpoint_dir=out, settings=settings)
    return raised.value, reporter


def saved_model_values(out: Path) -> list[np.ndarray]:
    model = keras.models.load_model(out / "model.keras", compile=False)
    return [keras.ops.convert_to_numpy(v.value) for v in model.variables]


def assert_model_file_is_the_checkpoint(out: Path, step: int) -> None:
    """model.keras holds exactly the weights of the checkpoint of `step`, which are finite."""
    saved = checkpoint.load(out)
    assert saved is not None and saved.step == step
    model_values = saved_model_values(out)
    assert len(model_values) == len(saved.model_values)
    for written, kept in zip(model_values, saved.model_values, strict=True):
        assert np.isfinite(kept).all()
        np.testing.assert_array_equal(written, kept)


# (input, label) of a poisoned sample
NAN_INPUT = (float("nan"), 0.0)
LABEL_PAST_FLOAT16 = (1.0, 50_000.0)
"""A finite loss (about 2.5e9 in float32) whose gradient at the output, 2 * (prediction - 5e4), is past
float16's 65504: under mixed_float16 with no scaling the gradients are inf, the loss is not."""


@pytest.mark.parametrize(("policy", "poison", "what"), [
    pytest.param("float32", NAN_INPUT, "loss", id="nan-loss"),
    pytest.param("mixed_float16", LABEL_PAST_FLOAT16, "gradients", id="inf-gradients"),
])
@pytest.mark.parametrize("per_call", [1, 8])
def test_an_unscaled_run_fails_at_the_step_of_its_first_non_finite_update(
        settings: Settings, tmp_path: Path, policy: str, poison: tuple[float, float], what: str, per_call: int) -> None:
    """At 8 steps per call, the calls are 1-8, 9-10 (ended by the checkpoint), 11-18: step 15 lies inside
    one, which trains on past it; the run still fails at 15, with no record and no checkpoint after it."""
    bad_step, every = 15, 10  # steps 11-14 train past the checkpoint of step 10; 15's is never written
    spec = spec_of(model={"keras_json": linear_model(), "loss": "mean_squared_error"}, precision_policy=policy,
                   loss_scale="none", dataset={"kind": "npz", "path": write_dataset(settings, "d.npz", 64,
                                                                                     {bad_step: poison})},
                   training={"steps": 40, "batch_size": 1, "optimizer": "sgd", "learning_rate": 0.01,
                             "checkpoint_every": every, "underflow_check_every": 0, "steps_per_execution": per_call})
    out = tmp_path / "run"
    failure, reporter = run_to_failure(spec, settings, out)
    assert failure.reason is FailureReason.DIVERGED
    assert failure.message.startswith(f"At step {bad_step} the {what} became inf or NaN with no loss scaling")
    assert failure.message.endswith(f"The last good checkpoint (step {every}) is kept, "
                                    "and model.keras holds its weights.")
    records = reporter.records
    assert [r.step for r in records] == list(range(1, bad_step + 1)), "no step after the failure"
    assert all(r.loss is not None and r.grads_finite for r in records[:-1])
    assert not records[-1].grads_finite and (records[-1].loss is None) == (what == "loss")
    assert not records[-1].skipped, "no loss scaling: the update was applied"
    assert [(d.first_step, d.message) for d in reporter.summaries[-1].diagnoses if d.code == "diverged"] == [
        (bad_step, failure.message.split(" The last good")[0])]
    assert reporter.summaries[-1].steps_done == bad_step
    assert_model_file_is_the_checkpoint(out, every)


@pytest.mark.parametrize("per_call", [1, 8])
def test_a_scaled_run_fails_on_its_tenth_non_finite_loss_in_a_row(
        settings: Settings, tmp_path: Path, per_call: int) -> None:
    """At 8 steps per call the skips at steps 3-11 and the failure at 22 fall inside calls (1-8, 9-16, 17-24)."""
    # Nine NaN losses in a row (steps 3-11), a good step, then NaN losses from step 13 on.
    first_run, second_run = range(3, 3 + PATIENCE - 1), range(13, 31)
    poison = {step: NAN_INPUT for step in [*first_run, *second_run]}
    spec = spec_of(model={"keras_json": linear_model(), "loss": "mean_squared_error"},
                   precision_policy="mixed_float16", loss_scale={"mode": "fixed", "scale": 8},
                   dataset={"kind": "npz", "path": write_dataset(settings, "nan.npz", 64, poison)},
                   training={"steps": 40, "batch_size": 1, "optimizer": "sgd", "learning_rate": 0.01,
                             "underflow_check_every": 0, "steps_per_execution": per_call})
    failure, reporter = run_to_failure(spec, settings, tmp_path / "run")
    fails_at = second_run[0] + PATIENCE - 1  # 22
    assert failure.reason is FailureReason.DIVERGED
    assert failure.message.startswith(f"The loss itself was inf or NaN for {PATIENCE} steps in a row up to step "
                                      f"{fails_at}.")
    records = reporter.records
    assert [r.step for r in records] == list(range(1, fails_at + 1)), "no step after the failure"
    non_finite = [r.step for r in records if r.loss is None]
    assert non_finite == [*first_run, *range(second_run[0], fails_at + 1)]
    assert all(r.skipped == (r.step in non_finite) for r in records), "a scaled run skips each of them"
    assert {r.loss_scale for r in records} == {8.0}


@pytest.mark.parametrize("initial_scale", [1, 4])
def test_a_dynamic_scale_at_1_that_still_overflows_diverges(
        settings: Settings, tmp_path: Path, initial_scale: int) -> None:
    """Every sample's gradient is past float16's range unscaled: the scale halves each step to 1, then it fails."""
    samples = 8
    data = {step: LABEL_PAST_FLOAT16 for step in range(1, samples + 1)}
    spec = spec_of(model={"keras_json": linear_model(), "loss": "mean_squared_error"},
                   precision_policy="mixed_float16", loss_scale={"mode": "dynamic", "initial_scale": initial_scale},
                   dataset={"kind": "npz", "path": write_dataset(settings, "big.npz", samples, data)},
                   training={"steps": samples, "batch_size": 1, "optimizer": "sgd", "underflow_check_every": 0})
    out = tmp_path / "run"
    failure, reporter = run_to_failure(spec, settings, out)
    scales = [float(initial_scale)]
    while scales[-1] > 1:
        scales.append(scales[-1] / 2)
    fails_at = len(scales)  # 1 for a scale of 1; 3 for 4 -> 2 -> 1
    assert failure.reason is FailureReason.DIVERGED
    assert failure.message.startswith(f"At step {fails_at} the gradients overflowed even at loss scale 1: there is "
                                      "nothing left to back off.")
    assert failure.message.endswith("No checkpoint was reached before it diverged.")
    records = reporter.records
    assert [r.step for r in records] == list(range(1, fails_at + 1)), "no step after the failure"
    assert [r.loss_scale for r in records] == scales
    assert all(r.skipped and not r.grads_finite and r.grad_norm is None for r in records)
    # The loss is finite (neither of the other rules), and its gradient at the output, 2 * sqrt(loss)
    # for one sample's squared error, is past float16's largest value unscaled.
    assert all(r.loss is not None and 2 * r.loss**0.5 > FLOAT16_MAX for r in records)
    assert not (out / "model.keras").exists()


def test_a_diverging_learning_rate_fails_at_its_first_non_finite_step(settings: Settings, tmp_path: Path) -> None:
    """The unscaled rule on a run that diverges by itself: it fails on the first step it records non-finite."""
    spec = spec_of(training={"steps": 200, "optimizer": "sgd", "learning_rate": 10.0, "checkpoint_every": 5},
                   dataset={"samples": 512})
    out = tmp_path / "diverging"
    failure, reporter = run_to_failure(spec, settings, out)
    assert failure.reason is FailureReason.DIVERGED
    records = reporter.records
    bad = next(r.step for r in records if r.loss is None or not r.grads_finite)
    assert [r.step for r in records] == list(range(1, bad + 1)), "no step after the failure"
    assert failure.message.startswith(f"At step {bad} the ")
    last_good = (bad - 1) // 5 * 5
    assert failure.message.endswith(f"The last good checkpoint (step {last_good}) is kept, "
                                    "and model.keras holds its weights.")
    assert_model_file_is_the_checkpoint(out, last_good)


def test_dynamic_scaling_that_cannot_absorb_a_non_finite_loss_diverges(settings: Settings, tmp_path: Path) -> None:
    spec = spec_of(precision_policy="mixed_float16", loss_scale="dynamic",
                   training={"steps": 200, "optimizer": "sgd", "learning_rate": 10.0, "checkpoint_every": 5},
                   dataset={"samples": 512})
    failure, reporter = run_to_failure(spec, settings, tmp_path / "run")
    assert failure.reason is FailureReason.DIVERGED
    records = reporter.records
    last = records[-1].step
    assert [r.step for r in records] == list(range(1, last + 1))
    # The loss went non-finite PATIENCE steps before the end and stayed so; the scale never reached 1.
    assert all(r.loss is None for r in records[-PATIENCE:])
    assert last == PATIENCE or records[-PATIENCE - 1].loss is not None
    assert all(r.loss_scale > 1 for r in records)
    assert failure.message.startswith(f"The loss itself was inf or NaN for {PATIENCE} steps in a row up to step "
                                      f"{last}.")


def test_max_seconds_fails_with_timeout_and_keeps_a_checkpoint(train: Train, tmp_path: Path) -> None:
    spec = spec_of(precision_policy="mixed_float16", training={"steps": 100_000, "max_seconds": 2})
    out = tmp_path / "slow"
    with pytest.raises(JobFailed) as raised:
        train(spec, out=out)
    assert raised.value.reason is FailureReason.TIMEOUT
    saved = checkpoint.load(out)
    assert saved is not None and 0 < saved.step < 100_000
    assert f"step {saved.step}" in raised.value.message


def test_xla_precision_refusal_is_a_named_unsupported_precision() -> None:
    """JAX's CPU backend refuses float16 attention with float32 accumulation (seen with a
    transformer under mixed_float16): a named failure with its fix, not `internal`."""
    from worker.engine.devices import detect_device
    from worker.engine.failures import named_failure

    device = detect_device()

    error = RuntimeError("INVALID_ARGUMENT: The precision 'F16_F16_F32' is not supported by dot_general on CPU.")
    failure = named_failure(error, "float16", device.backend, device.kind)
    assert failure.reason is FailureReason.UNSUPPORTED_PRECISION_ON_DEVICE
    assert "float16 kernel for op dot_general" in failure.message and "mixed_bfloat16 or float32" in failure.message


OOM_ADVICE = "Fix: a smaller training.batch_size or model, or a worker with more memory."


@pytest.mark.slow  # allocates until TensorFlow runs out: about 20 s
def test_tensorflow_out_of_memory_is_named_with_the_tensor_shape_and_size() -> None:
    """A real ResourceExhaustedError, eagerly and from a graph (where its first line says only
    "Graph execution error:"): 2**44 float32 values are 64 TiB."""
    import tensorflow as tf

    from worker.engine.failures import named_failure

    @tf.function
    def in_a_graph(n: tf.Tensor) -> tf.Tensor:
        return tf.reduce_sum(tf.ones((n, 2**22)))

    for allocate, shape in ((lambda: tf.zeros((2**44,)), "[17592186044416]"),
                            (lambda: in_a_graph(tf.constant(2**22)), "[4194304,4194304]")):
        with pytest.raises(tf.errors.ResourceExhaustedError) as raised:
            allocate()
        failure = named_failure(raised.value, "float32", "tensorflow", "cpu")
        assert failure.reason is FailureReason.OUT_OF_MEMORY
        assert failure.message.startswith(f"Out of memory: a float tensor of shape {shape} (64 TiB) could not be "
                                          "allocated on /job:localhost/replica:0/task:0/device:CPU:0."), failure.message
        assert failure.message.endswith(OOM_ADVICE)


def test_numpy_out_of_memory_is_named_with_the_array_shape_and_size() -> None:
    from worker.engine.failures import named_failure

    with pytest.raises(MemoryError) as raised:
        np.empty((2**50,))
    failure = named_failure(raised.value, "float32", "tensorflow", "cpu")
    assert failure.reason is FailureReason.OUT_OF_MEMORY
    assert failure.message == ("Out of memory: a float64 array of shape (1125899906842624,) (8.00 PiB) could not be "
                               f"allocated in RAM. {OOM_ADVICE}")


@pytest.mark.processes
def test_xla_resource_exhausted_is_named_out_of_memory_with_its_size() -> None:
    """JAX's own error (XLA's RESOURCE_EXHAUSTED), raised in a process of its own: 2**40 float32 values."""
    import subprocess
    import sys

    pytest.importorskip("jax")
    code = ("import jax.numpy as jnp\ntry:\n    jnp.zeros((2**40,)).block_until_ready()\n"
            "except Exception as e:\n    print(type(e).__name__, e)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={"JAX_PLATFORMS": "cpu", "PATH": ""})
    name, _, text = done.stdout.strip().partition(" ")
    assert "RESOURCE_EXHAUSTED" in text, done.stdout + done.stderr
    from worker.engine.failures import named_failure

    failure = named_failure(RuntimeError(text), "float32", "jax", "cpu")
    assert failure.reason is FailureReason.OUT_OF_MEMORY
    assert failure.message == f"Out of memory: XLA could not allocate 4 TiB on this device. {OOM_ADVICE}"
