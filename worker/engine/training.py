"""Run one training job: build, restore, train with telemetry, checkpoint, save.

>>> import tempfile
>>> from mpjobs.contract.spec import JobSpec
>>> spec = JobSpec.model_validate({"model": {"name": "mlp"}, "training": {"steps": 5}})
>>> result = run_job(spec, reporter=ListReporter(), checkpoint_dir=Path(tempfile.mkdtemp()))
>>> result.status, result.summary.steps_done
('succeeded', 5)
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import keras
import numpy as np

from app.core.config import Settings, get_settings
from app.core.errors import Diverged, DomainError, JobFailed, TimedOut
from mpjobs.contract.records import Summary
from mpjobs.contract.spec import JobSpec, LossScaleMode
from worker.callbacks.checkpointer import Checkpointer
from worker.callbacks.divergence import DivergenceGuard
from worker.callbacks.evaluator import Evaluator
from worker.callbacks.recorder import StepRecorder
from worker.callbacks.stop_control import StopControl
from worker.engine import checkpoint
from worker.engine.checkpoint import spec_fingerprint
from worker.engine.checks import make_check
from worker.engine.data import FIRST_SEGMENT_BYTES, data_use, hold_out, load_dataset
from worker.engine.devices import DeviceInfo, detect_device, distribution, slow_precision_message
from worker.engine.failures import named_failure
from worker.engine.memory import check_fits, release
from worker.engine.models import BuiltModel, build_model, token_ids
from worker.engine.optimizers import make_optimizer
from worker.engine.planned import planned_spec
from worker.engine.stepper import Calls
from worker.engine.stopping import TimeLimit, phase, set_phase
from worker.numerics.speed import check_after_run
from worker.numerics.summary import RunContext, SummaryBuilder
from worker.telemetry.batch_loss import BatchLoss, StepTelemetry
from worker.telemetry.reporters import ListReporter, Reporter

log = logging.getLogger(__name__)

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


def run_job(
    spec: JobSpec,
    *,
    reporter: Reporter,
    checkpoint_dir: Path,
    should_stop: Callable[[], bool] = never,
    settings: Settings | None = None,
    limit: TimeLimit | None = None,
    resume: checkpoint.Resume | None = None,
) -> RunResult:
    """Train `spec` to its last step, or until `should_stop()` is true or `limit` runs out.

    Resumes from `checkpoint_dir`'s newest checkpoint of the same spec (at or below `resume.at_most`: the
    steps Redis holds). Raises `JobFailed` (with a named reason) for every failure. `limit`: by default
    the spec's `training.max_seconds`, at most the MAX_JOB_SECONDS setting, from now.
    """
    settings = settings or get_settings()
    limit = limit or TimeLimit.of(spec, settings)
    device = detect_device(settings.cpu_logical_devices)
    try:
        return Training(spec, reporter, Path(checkpoint_dir), should_stop, settings, device, limit, resume).run()
    except DomainError:
        raise
    except Exception as exc:
        log.exception("job failed")
        raise named_failure(exc, spec.precision_policy.compute_dtype, device.backend, device.kind) from exc


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
        limit: TimeLimit | None = None,
        resume: checkpoint.Resume | None = None,
    ) -> None:
        t, policy = spec.training, spec.precision_policy
        self.spec, self.reporter, self.out, self.device, self.settings = spec, reporter, out, device, settings
        self.should_stop, resume = should_stop, resume or checkpoint.Resume()
        self.limit = limit or TimeLimit.of(spec, settings)
        set_phase("building the model")
        # A worker runs many jobs in one process: drop the last job's graphs and layer names. Without
        # a full garbage collection (a quarter second in a process holding TensorFlow): the worker
        # already runs one when each job ends (release_memory), and nothing here needs it sooner.
        keras.backend.clear_session(free_memory=False)
        keras.utils.set_random_seed(t.seed)
        on_cpu_tf = device.kind == "cpu" and device.backend == "tensorflow"
        spec, plan = planned_spec(spec, on_cpu_tf, settings)  # plan: "auto" (worker/engine/planned.py)
        self.spec, t = spec, spec.training
        keras.utils.set_random_seed(t.seed)  # the planned model's initial weights are the policy job's
        # Several devices: model, optimizer and metrics are built in the strategy's scope, so every
        # variable is mirrored; no XLA, which merge calls cannot run inside (worker/telemetry/replicas.py).
        strategy = distribution(t.devices)
        with strategy.scope() if strategy is not None else contextlib.nullcontext():
            built: BuiltModel = build_model(spec, on_cpu_tf=on_cpu_tf)
            self.model = model = built.model  # one input and one output (worker.engine.models)
            self.optimizer = optimizer = make_optimizer(spec)
            optimizer.penalties = list(built.penalties)
            # Stateful backends read the data loss and the statistics the optimizer stored in the step
            # through StepTelemetry; JAX metrics cannot see the optimizer's new state, so there the
            # BatchLoss metric computes the data loss and the callback reads the trainer's state.
            metrics: list[keras.metrics.Metric] = ([BatchLoss(built.loss)] if keras.backend.backend() == "jax"
                                                   else [StepTelemetry(optimizer, built.loss)])
            model.compile(optimizer=optimizer, loss=built.loss, metrics=metrics, auto_scale_loss=False,
                          jit_compile="auto" if strategy is None else False)
            optimizer.build(model.trainable_variables)
        check_fits(model, optimizer, spec, device.kind)  # out_of_memory now, not deep in a step
        set_phase("preparing the data")
        self.dataset = load_dataset(
            spec, tuple(model.input_shape[1:]), tuple(model.output_shape[1:]), built.loss_name,
            settings.data_root, token_ids(model, spec), settings.datasets_dir(),
        )
        self.dataset, held = hold_out(spec, self.dataset, tuple(model.input_shape[1:]), settings.data_root,
                                      settings.datasets_dir())
        set_phase("restoring the checkpoint")

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
        saved = checkpoint.load(out, resume.at_most)
        if saved is not None:
            if saved.fingerprint != self.fingerprint:
                raise JobFailed(f"{out} holds a checkpoint of a different spec; use a fresh folder.", None)
            checkpoint.restore(model.variables, saved.model_values)
            checkpoint.restore(optimizer.variables, saved.optimizer_values)
            self.start, summary_state = saved.step, saved.summary_state
        self.builder = SummaryBuilder(context, summary_state)
        self.builder.plan = plan
        self.builder.data_use = lambda done: data_use(self.dataset, held, done)
        self.writer = checkpoint.CheckpointWriter(out, resume.durable)
        self.last_saved = self.start
        self.builder.fp8 = built.fp8
        self.check = make_check(spec, built, optimizer.mode, self.start, strategy is not None, on_cpu_tf, self.builder)
        self.recorder = StepRecorder(
            reporter=reporter, summary=self.builder, start_step=self.start, batch_size=t.batch_size,
            learning_rate=t.learning_rate, report_interval_s=settings.report_interval_s,
            report_max_records=settings.report_max_records, checks=None if self.check is None else self.check.results,
            layer_checks=None if self.check is None else self.check.layer_results,
            fp8_counts=None if self.check is None else self.check.fp8_counts,
        )
        self.divergence = DivergenceGuard(self.recorder, self.builder)
        self.evaluator: Evaluator | None = None
        if (v := spec.validation) is not None and held is not None:
            self.evaluator = Evaluator(held_out=held, loss=built.loss, loss_name=built.loss_name, metrics=v.metrics,
                                       every=v.eval_every, start_step=self.start, batch_size=t.batch_size,
                                       reporter=reporter, builder=self.builder, out=out)
            self.evaluator.set_model(model)
        self.stop = StopControl(should_stop, self.limit)
        # In this order: each step is recorded, judged, maybe checkpointed, then maybe stopped.
        saver = Checkpointer(self.recorder, t.checkpoint_every, self.save_checkpoint, settings.checkpoint_interval_s)
        self.callbacks: list[keras.callbacks.Callback] = [
            self.recorder, self.divergence, *([self.evaluator] if self.evaluator else []), saver, self.stop]
        # Several steps per compiled call (worker/engine/stepper.py); `fit`'s calls on other backends.
        self.calls = (Calls(model, t.batch_size, t.steps_per_execution, self._must_end, strategy)
                      if keras.backend.backend() in ("tensorflow", "jax") else None)
        self.builder.steps_per_call = lambda: 1 if self.calls is None else max(self.calls.sizes, default=None)

    def _must_end(self, step: int) -> bool:
        """Whether a call must end after `step`: a checkpoint, an evaluation, or a check at the next step."""
        every = self.spec.training.checkpoint_every
        evaluate = self.evaluator is not None and self.evaluator.every > 0 and step % self.evaluator.every == 0
        return step % every == 0 or evaluate or (self.check is not None and self.check.due(step + 1))

    def run(self) -> RunResult:
        """Every segment through `fit` until one says stop, then `finish`: what `run_job` does."""
        set_phase("training")
        try:
            for x, y in self.segments():
                if not self.fit(x, y):
                    break
        except BaseException:
            self.close()
            raise
        return self.finish()

    def segments(self, first_bytes: int = FIRST_SEGMENT_BYTES) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """The (x, y) of every step still to train, in `fit`-sized pieces, the first of `first_bytes`
        (SEGMENT_BYTES: one piece, where the run fits in one, as the benchmarks want)."""
        return self.dataset.segments(self.start, self.spec.training.steps, first_bytes)

    def fit(self, x: np.ndarray, y: np.ndarray) -> bool:
        """Train one step per batch of (x, y). False once the job must end (stopped, timed out, diverged)."""
        callbacks = list(self.callbacks)
        if self.check is not None:  # first, so that its time is not the step's
            self.check.segment = (x, y)
            callbacks.insert(0, self.check)
        if self.calls is not None:
            self.calls.fit(x, y, self.recorder.step, callbacks)
        else:
            self.model.fit(x, y, batch_size=self.spec.training.batch_size, epochs=1, shuffle=False, verbose=0,
                           callbacks=callbacks)
        return not (self.stop.stopped or self.stop.timed_out or self.divergence.failure is not None)

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
        self.last_saved = step

    def _check_speed(self) -> None:
        """Time policies against float32 in turns (worker.numerics.speed) into the summary."""
        with phase("measuring speed against float32"):  # out of time: abandoned, the job has trained
            # The run's steps, not this attempt's: one resumed at the last step (lost while timing) times again.
            check_after_run(self.spec, self.device, self.settings, self.dataset,
                            self.builder.steps_done, self.builder, make_optimizer,
                            lambda: self.should_stop() or self.limit.passed())

    def close(self) -> None:
        """Wait for the checkpoint writer (after a failure in `fit`)."""
        self.writer.close()

    def finish(self) -> RunResult:
        """Report the last steps, write the last checkpoint and the model; raise the job's failure if any."""
        builder, t, failure = self.builder, self.spec.training, self.divergence.failure
        set_phase("saving")
        try:
            self.recorder.publish()
            if failure is None and self.evaluator is not None and builder.steps_done:  # stopped, timed out, done
                self.evaluator.final(builder.steps_done)
            if failure is None and builder.steps_done != self.last_saved:
                self.save_checkpoint(builder.steps_done)
        finally:
            self.writer.close()
        error: DomainError | None = None
        model_path = None
        if failure is not None:
            error = Diverged(failure.message + checkpoint.keep_last_good(self.model, self.optimizer, self.out))
        elif self.stop.timed_out:
            error = TimedOut(self.limit.message(f"at step {builder.steps_done} of {t.steps}") + " The checkpoint "
                             "of that step is kept: resubmit with a larger limit to continue from it.")
        elif not self.stop.stopped:
            with phase("saving the model"):
                model_path = checkpoint.save_model(self.model, self.optimizer, self.out)
            self._check_speed()
        self.recorder.publish(final=True)
        if error is not None:
            raise error
        return RunResult(
            "stopped" if self.stop.stopped else "succeeded", builder.summary(),
            checkpoint.path_of(self.out, self.last_saved), model_path, self.device, self.start,
        )


def release_memory() -> None:
    """Drop every model and graph of the last job (host and device memory) from this process."""
    keras.backend.clear_session(free_memory=True)
    release()  # what clear_session leaves: TensorFlow's gradient registry, the C allocator's free memory
