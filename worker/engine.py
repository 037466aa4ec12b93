"""Run one training job: build, restore, train with telemetry, checkpoint, save.

>>> from app.schemas import JobSpec
>>> spec = JobSpec.model_validate({"model": {"name": "mlp"}, "training": {"steps": 5}})
>>> result = run_job(spec, reporter=ListReporter(), checkpoint_dir=Path(tempfile.mkdtemp()))
>>> result.status, result.summary.steps_done
('succeeded', 5)
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import keras
import numpy as np

from app.config import Settings, get_settings
from app.errors import Diverged, InvalidModel, JobFailed, MpjobsError, TimedOut
from app.schemas import (
    DynamicLossScale,
    FixedLossScale,
    JobSpec,
    LossScaleMode,
    PrecisionPolicy,
    PrecisionSpeed,
    Summary,
    VariantSpeed,
)
from worker import checkpoint
from worker.data import load_dataset
from worker.devices import DeviceInfo, detect_device, slow_precision_message
from worker.failures import missing_kernel
from worker.float32_check import Float32Check
from worker.models import BuiltModel, build_model
from worker.optimizer import TelemetryOptimizer
from worker.speed import measure_all, variant_spec
from worker.summary import RunContext, SummaryBuilder
from worker.telemetry import BatchLoss, ListReporter, Reporter, StepTelemetry, TelemetryCallback, compiled_loss

log = logging.getLogger(__name__)

MODEL_ARTIFACT = "model.keras"
_OPTIMIZERS = {
    "adam": keras.optimizers.Adam,
    "adamw": keras.optimizers.AdamW,
    "sgd": keras.optimizers.SGD,
    "rmsprop": keras.optimizers.RMSprop,
}

__all__ = ["ListReporter", "RunResult", "Training", "release_memory", "run_job", "spec_fingerprint"]


@dataclass(frozen=True)
class RunResult:
    status: str
    """"succeeded", or "stopped" when should_stop asked for it (checkpoint saved)."""
    summary: Summary
    checkpoint_path: Path
    model_path: Path | None
    device: DeviceInfo
    start_step: int


def never() -> bool:
    return False


def spec_fingerprint(spec: JobSpec) -> str:
    """What a checkpoint must match to be resumed (the step count may grow)."""
    data = spec.model_dump(mode="json", exclude={"name": True, "training": {"steps"}})
    return hashlib.sha256(repr(sorted(data.items())).encode()).hexdigest()[:16]


def make_optimizer(spec: JobSpec) -> TelemetryOptimizer:
    t, ls = spec.training, spec.loss_scale
    inner = _OPTIMIZERS[t.optimizer](learning_rate=t.learning_rate)
    if isinstance(ls, FixedLossScale):
        return TelemetryOptimizer(inner, mode="fixed", initial_scale=ls.scale)
    if isinstance(ls, DynamicLossScale):
        return TelemetryOptimizer(inner, mode="dynamic", initial_scale=ls.initial_scale, growth_steps=ls.growth_steps)
    return TelemetryOptimizer(inner, mode="none")


def _vocab(model: keras.Model) -> int | None:
    if "int" not in str(model.inputs[0].dtype):
        return None
    for layer in model.layers:
        if isinstance(layer, keras.layers.Embedding):
            return int(layer.input_dim)
    raise InvalidModel("model has integer inputs but no Embedding layer to size the synthetic tokens.")


def _map_failure(exc: Exception, spec: JobSpec, device: DeviceInfo) -> JobFailed:
    """The one place where TensorFlow/Keras errors become named failures."""
    missing = missing_kernel(exc, spec.precision_policy.compute_dtype, device.backend, device.kind)
    if missing is not None:
        return missing
    text = str(exc)
    first_line = text.strip().splitlines()[0] if text.strip() else ""
    return JobFailed(f"{type(exc).__name__}: {first_line[:500]}")


def run_job(
    spec: JobSpec,
    *,
    reporter: Reporter,
    checkpoint_dir: Path,
    should_stop: Callable[[], bool] = never,
    settings: Settings | None = None,
) -> RunResult:
    """Train `spec` to its last step, or until `should_stop()` is true.

    Resumes from `checkpoint_dir` when it holds a checkpoint of the same spec.
    Raises `JobFailed` (with a named reason) for every failure.
    """
    settings = settings or get_settings()
    device = detect_device()
    try:
        return Training(spec, reporter, Path(checkpoint_dir), should_stop, settings, device).run()
    except MpjobsError:
        raise
    except Exception as exc:
        log.exception("job failed")
        raise _map_failure(exc, spec, device) from exc


class Training:
    """One job's training, set up and ready: `fit` trains a segment, `finish` ends the job.

    `run_job` is `Training(...).run()`: set up (model, data, optimizer,
    restored checkpoint), every segment of `segments()` through `fit` until
    one says stop, then `finish`. The benchmark of the engine's overhead
    drives the same steps in smaller pieces, interleaved with a bare `model.fit`.
    """

    def __init__(
        self,
        spec: JobSpec,
        reporter: Reporter,
        out: Path,
        should_stop: Callable[[], bool],
        settings: Settings,
        device: DeviceInfo,
    ) -> None:
        t, policy = spec.training, spec.precision_policy
        self.spec, self.reporter, self.out, self.device, self.settings = spec, reporter, out, device, settings
        self.should_stop = should_stop
        # A worker runs many jobs in one process: drop the last job's graphs and layer names.
        keras.backend.clear_session()
        keras.utils.set_random_seed(t.seed)
        on_cpu_tf = device.kind == "cpu" and device.backend == "tensorflow"
        built: BuiltModel = build_model(spec, on_cpu_tf=on_cpu_tf)
        self.model = model = built.model
        if len(model.inputs) != 1 or len(model.outputs) != 1:
            raise InvalidModel("model must have exactly one input and one output.")
        self.dataset = load_dataset(
            spec, tuple(model.input_shape[1:]), tuple(model.output_shape[1:]), built.loss_name,
            settings.data_root, _vocab(model),
        )
        self.optimizer = optimizer = make_optimizer(spec)
        optimizer.penalties = list(built.penalties)
        # Stateful backends read the data loss and the statistics the optimizer stored in the step
        # through StepTelemetry; JAX metrics cannot see the optimizer's new state, so there the
        # BatchLoss metric computes the data loss and the callback reads the trainer's state.
        metrics: list[keras.metrics.Metric] = (
            [BatchLoss(built.loss)] if keras.backend.backend() == "jax" else [StepTelemetry(optimizer, built.loss)])
        model.compile(optimizer=optimizer, loss=built.loss, metrics=metrics, auto_scale_loss=False)
        optimizer.build(model.trainable_variables)

        self.fingerprint = spec_fingerprint(spec)
        context = RunContext(
            policy=policy.value,
            compute_dtype=policy.compute_dtype,
            loss_scale_mode=LossScaleMode(optimizer.mode),
            slow_precision_message=slow_precision_message(device, policy.compute_dtype, policy.value),
            float32_layers=built.float32_layers,
            output_dtype=built.output_dtype,
        )
        self.start, summary_state = 0, None
        saved = checkpoint.load(out)
        if saved is not None:
            if saved.fingerprint != self.fingerprint:
                raise JobFailed(f"{out} holds a checkpoint of a different spec; use a fresh folder.", None)
            _assign(model.variables, saved.model_values)
            _assign(optimizer.variables, saved.optimizer_values)
            self.start, summary_state = saved.step, saved.summary_state
        self.builder = SummaryBuilder(context, summary_state)
        self.writer = checkpoint.CheckpointWriter(out)
        self.check: Float32Check | None = None
        if policy.compute_dtype != "float32" and t.underflow_check_every > 0:
            twin_spec = spec.model_copy(update={"precision_policy": PrecisionPolicy.FLOAT32})
            self.check = Float32Check(
                build_twin=lambda: build_model(twin_spec, on_cpu_tf=on_cpu_tf).model, loss=compiled_loss(built.loss),
                every=t.underflow_check_every, start_step=self.start, batch_size=t.batch_size,
                compute_dtype=policy.compute_dtype, mode=optimizer.mode,
                need_advice=lambda: self.builder.underflow_advice is None, on_error=self.builder.set_check_error,
            )
        self.callback = TelemetryCallback(
            reporter=reporter, summary=self.builder, start_step=self.start, batch_size=t.batch_size,
            learning_rate=t.learning_rate, checkpoint_every=t.checkpoint_every,
            save_checkpoint=self.save_checkpoint, should_stop=should_stop,
            report_interval_s=settings.report_interval_s, report_max_records=settings.report_max_records,
            max_seconds=t.max_seconds, checks=None if self.check is None else self.check.results,
        )

    def run(self) -> RunResult:
        """Every segment through `fit` until one says stop, then `finish`: what `run_job` does."""
        try:
            for x, y in self.segments():
                if not self.fit(x, y):
                    break
        except BaseException:
            self.close()
            raise
        return self.finish()

    def segments(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """The (x, y) of every step still to train, in `fit`-sized pieces."""
        return self.dataset.segments(self.start, self.spec.training.steps)

    def fit(self, x: np.ndarray, y: np.ndarray) -> bool:
        """Train one step per batch of (x, y). False once the job must end (stopped, timed out, diverged)."""
        callbacks: list[keras.callbacks.Callback] = [self.callback]
        if self.check is not None:  # first, so that its time is not the step's
            self.check.segment = (x, y)
            callbacks.insert(0, self.check)
        self.model.fit(x, y, batch_size=self.spec.training.batch_size, epochs=1, shuffle=False, verbose=0,
                       callbacks=callbacks)
        c = self.callback
        return not (c.stopped or c.timed_out or c.failure is not None)

    def save_checkpoint(self, step: int) -> None:
        sync = getattr(self.model, "jax_state_sync", None)
        if sync is not None:
            sync()
        # Copies: the writer thread must not see the next step's in-place updates.
        self.writer.submit(checkpoint.Checkpoint(
            step, self.fingerprint,
            [np.array(keras.ops.convert_to_numpy(v.value), copy=True) for v in self.model.variables],
            [np.array(keras.ops.convert_to_numpy(v.value), copy=True) for v in self.optimizer.variables],
            self.builder.state(),
        ))

    def _check_speed(self) -> None:
        """Time policies against float32 in turns (worker.speed) for the summary.

        By default a CPU job in float16/bfloat16 times its own policy; a comparison's float32
        baseline times every other variant, on any device (`JobSpec.speed_check`).
        """
        spec, device, per_round = self.spec, self.device, self.settings.speed_check_steps
        trained = self.builder.steps_done - self.start
        if spec.speed_check is None:
            own = device.kind == "cpu" and spec.precision_policy.compute_dtype != "float32"
            specs = [spec] if own else []
        else:
            specs = [variant_spec(spec, v) for v in spec.speed_check]
        rounds = self.settings.speed_check_rounds
        if not specs or per_round <= 0 or rounds <= 0 or not trained:
            return
        # A short run gets a short check: each side trains at most about half as many steps as the run did.
        steps = min(per_round, max(1, trained // (2 * rounds)))
        parts = list(self.dataset.batches(0, steps))
        x, y = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
        try:
            timed = measure_all(specs, x, y, on_cpu_tf=device.kind == "cpu" and device.backend == "tensorflow",
                                rounds=rounds, max_seconds=self.settings.speed_check_max_seconds,
                                make_optimizer=make_optimizer, should_stop=self.should_stop)
        except Exception:  # the job itself succeeded: a failed measurement only leaves the figure out
            log.warning("speed check failed; the summary has no precision speed", exc_info=True)
            return
        if timed is None:
            log.info("speed check abandoned: the job was asked to stop after its last step")
            return
        if spec.speed_check is None:
            own_timed = timed[0]
            if own_timed.speed is None:
                log.warning("speed check failed; the summary has no precision speed: %s", own_timed.error)
                return
            self.builder.set_speed(own_timed.speed, self._slow_message(spec, own_timed.speed))
            return
        self.builder.set_variant_speeds([
            VariantSpeed(label=v.label, speed=t.speed, error=t.error,
                         slow_precision=self._slow_message(t.spec, t.speed) if t.speed else None)
            for v, t in zip(spec.speed_check, timed, strict=True)])

    def _slow_message(self, spec: JobSpec, speed: PrecisionSpeed) -> str | None:
        return slow_precision_message(self.device, spec.precision_policy.compute_dtype, spec.precision_policy.value,
                                      speed)

    def close(self) -> None:
        """Wait for the checkpoint writer (after a failure in `fit`)."""
        self.writer.close()

    def finish(self) -> RunResult:
        """Report the last steps, write the last checkpoint and the model; raise the job's failure if any."""
        callback, builder, t = self.callback, self.builder, self.spec.training
        try:
            callback.flush()
            unsaved = builder.steps_done != self.start and builder.steps_done % t.checkpoint_every
            if callback.failure is None and unsaved:
                self.save_checkpoint(builder.steps_done)
        finally:
            self.writer.close()
        if callback.failure is not None:
            self.reporter.summary(builder.summary())
            raise Diverged(callback.failure.message + _keep_last_good(self.model, self.out))
        if callback.timed_out:
            self.reporter.summary(builder.summary())
            raise TimedOut(
                f"training.max_seconds={t.max_seconds} ran out at step {builder.steps_done} of {t.steps}. "
                "The checkpoint of that step is kept: resubmit with a larger limit to continue from it."
            )
        model_path = None
        if not callback.stopped:
            model_path = _save_model(self.model, self.out)
            self._check_speed()
        self.reporter.summary(builder.summary())
        return RunResult(
            "stopped" if callback.stopped else "succeeded", builder.summary(), self.out / checkpoint.CHECKPOINT_NAME,
            model_path, self.device, self.start,
        )


def release_memory() -> None:
    """Drop every model and graph of the last job (host and device memory) from this process."""
    keras.backend.clear_session(free_memory=True)


def _keep_last_good(model: keras.Model, out: Path) -> str:
    """After divergence: write model.keras from the last checkpoint, never from NaN weights."""
    saved = checkpoint.load(out)
    if saved is None:
        return " No checkpoint was reached before it diverged."
    _assign(model.variables, saved.model_values)
    _save_model(model, out)
    return f" The last good checkpoint (step {saved.step}) is kept, and model.keras holds its weights."


def _assign(variables: list[keras.Variable], values: list[np.ndarray]) -> None:
    if len(variables) != len(values):
        raise JobFailed(f"checkpoint holds {len(values)} arrays but the model has {len(variables)} variables.")
    for var, value in zip(variables, values, strict=True):
        var.assign(value)


def _save_model(model: keras.Model, out: Path) -> Path:
    target = out / MODEL_ARTIFACT
    fd, tmp = tempfile.mkstemp(prefix=".model-", suffix=".keras", dir=out)
    os.close(fd)
    try:
        model.save(tmp)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target
