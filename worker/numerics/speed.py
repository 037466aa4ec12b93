"""How fast a model trains in a policy against float32, on the device the job ran on.

On a CPU nothing general can be said: half-precision speed depends on the
processor's vector units and on which of the backend's kernels have a float16
or bfloat16 path. Measured with TensorFlow on our 2-core VMs, the same MLP step
under `mixed_float16` was about float32's speed on one machine and 40x slower
on another. And the machine is shared: two runs of one spec, timed one after
the other, have differed by 2x. So a speed is only ever measured here, in one
process, by taking turns (the method of bench/engine_overhead.py):

- fresh copies of the model, one per policy, one in float32 (the reference)
  and a second float32 copy (the A/A side), built and compiled alike;
- one warm-up step each (tracing), then `rounds` rounds; in each, every side
  trains `steps` steps on the same batches, in an order rotated every round,
  so no side always follows the same neighbour;
- each step timed from its start until its loss is on the host; a side's
  piece is the median of its steps in that round;
- per round and side, the ratio of its piece to the reference's piece. A
  slowdown is the median of a side's ratios; its interval the order statistics
  that hold that median with 95% confidence (`median_interval`).

Drift of the machine that hits a whole round cancels in its ratios. The A/A
side's ratios show what two identical sides differ by on this machine now:
a policy is called slower or faster only when its whole interval lies beyond
both 1 and that noise (`mpjobs.contract.records.speed_difference`). The copies are
discarded: the job's weights are untouched.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np

from app.core.config import MIN_SPEED_ROUNDS, Settings
from app.core.errors import JobFailed
from mpjobs.contract.records import PrecisionSpeed, VariantSpeed, speed_difference
from mpjobs.contract.spec import JobSpec, NoLossScale, PrecisionPolicy, Variant
from worker.engine.data import Dataset
from worker.engine.devices import DeviceInfo, slow_precision_message
from worker.engine.models import build_model
from worker.numerics.summary import SummaryBuilder

log = logging.getLogger(__name__)

ROUNDS = 9
"""Rounds of turns: with 9, the median's 95% interval is the 2nd to the 8th smallest ratio."""
CONFIDENCE = 0.95
"""Of each interval: a call of slower or faster is wrong about 1 time in 40 on each side at most."""


def float32_twin(spec: JobSpec) -> JobSpec:
    """The same job in float32, without loss scaling."""
    return spec.model_copy(update={"precision_policy": PrecisionPolicy.FLOAT32, "loss_scale": NoLossScale(),
                                   "layer_policies": {}, "fp8": None})


def variant_spec(spec: JobSpec, variant: Variant) -> JobSpec:
    """`spec` with `variant`'s policy and loss scaling: what that variant's job trains."""
    pins = spec.layer_policies if variant.layer_policies is None else variant.layer_policies
    return spec.model_copy(update={"precision_policy": variant.precision_policy, "loss_scale": variant.loss_scale,
                                   "layer_policies": pins, "fp8": variant.fp8})


class _StepClock(keras.callbacks.Callback):
    """Each step's seconds, from `on_train_batch_begin` until its loss is a host number."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds: list[float] = []
        self._start = 0.0

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if logs and "loss" in logs:
            float(keras.ops.convert_to_numpy(logs["loss"]))  # waits for the step under async dispatch
        self.seconds.append(time.perf_counter() - self._start)


class _Side:
    """One fresh copy of the model under one spec, and its per-round pieces."""

    def __init__(self, spec: JobSpec, on_cpu_tf: bool, make_optimizer: Callable[[JobSpec], Any]) -> None:
        keras.utils.set_random_seed(spec.training.seed)
        built = build_model(spec, on_cpu_tf=on_cpu_tf)
        self.spec = spec
        self.model, self.batch_size = built.model, spec.training.batch_size
        self.model.compile(optimizer=make_optimizer(spec), loss=built.loss, auto_scale_loss=False)
        self.clock = _StepClock()
        self.callbacks: list[keras.callbacks.Callback] = [self.clock]
        """Called in order; the clock last, so that a step ends when every callback has seen it."""
        self.pieces: list[float] = []
        """Per round: the median of that round's step times."""

    def warm_up(self, x: np.ndarray, y: np.ndarray) -> None:
        self.model.fit(x[:self.batch_size], y[:self.batch_size], batch_size=self.batch_size, epochs=1,
                       shuffle=False, verbose=0)

    def piece(self, x: np.ndarray, y: np.ndarray) -> None:
        self.clock.seconds = []
        self.model.fit(x, y, batch_size=self.batch_size, epochs=1, shuffle=False, verbose=0,
                       callbacks=self.callbacks)
        self.pieces.append(statistics.median(self.clock.seconds))


@dataclass(frozen=True)
class Timed:
    """One policy's result: its speed, or why it could not be timed."""

    spec: JobSpec
    speed: PrecisionSpeed | None
    error: str | None = None


def median_interval(values: Sequence[float]) -> tuple[float, float]:
    """The distribution-free interval for the median of `values`: their k-th smallest and k-th largest, with
    k the largest that holds the median with at least 95% confidence (1 - 2·P(Binomial(n, 1/2) < k)).
    Under 6 values no k does: the whole range (93.75% with 5).

    >>> median_interval([5, 1, 4, 2, 3, 9, 8, 7, 6]), median_interval([3, 1, 2, 5, 4]), median_interval([2.0])
    ((2, 8), (1, 5), (2.0, 2.0))
    """
    ordered, n = sorted(values), len(values)
    k = 1
    while k < (n + 1) // 2 and 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n <= 1 - CONFIDENCE:
        k += 1
    return ordered[k - 1], ordered[n - k]


def measure_all(
    specs: Sequence[JobSpec],
    x: np.ndarray,
    y: np.ndarray,
    *,
    on_cpu_tf: bool,
    make_optimizer: Callable[[JobSpec], Any],
    rounds: int = ROUNDS,
    max_seconds: float = math.inf,
    should_stop: Callable[[], bool] = lambda: False,
) -> list[Timed] | None:
    """Each of `specs` against float32 (the first spec's twin), all in turns on batches `x`, `y`.

    A spec that cannot be built or trained here gets its error, and the rest are timed
    without it. When the first round shows that `rounds` would take longer than
    `max_seconds`, later pieces train one batch; past `max_seconds`, the measurement ends
    after the current round, once it has MIN_SPEED_ROUNDS (the result says how many).
    None when `should_stop()` turns true between two pieces (a cancel after the run's
    last step).
    """
    reference = _Side(float32_twin(specs[0]), on_cpu_tf, make_optimizer)
    twin = _Side(float32_twin(specs[0]), on_cpu_tf, make_optimizer)
    sides: list[_Side] = [reference, twin]
    errors: dict[int, str] = {}
    policy_sides: dict[int, _Side] = {}
    for index, spec in enumerate(specs):
        try:
            side = _Side(spec, on_cpu_tf, make_optimizer)
            side.warm_up(x, y)
        except Exception as exc:  # an unsupported policy is a finding about it, not the end of the others
            errors[index] = str(exc) if isinstance(exc, JobFailed) else f"{type(exc).__name__}: {exc}"
            continue
        policy_sides[index] = side
        sides.append(side)
    for side in (reference, twin):
        side.warm_up(x, y)
    start, done, steps = time.perf_counter(), 0, 0
    for r in range(rounds):
        elapsed = time.perf_counter() - start
        if r >= MIN_SPEED_ROUNDS and elapsed > max_seconds:
            break
        if r == 1 and elapsed * rounds > max_seconds:
            x, y = x[:reference.batch_size], y[:reference.batch_size]
        turn = r % len(sides)
        for side in sides[turn:] + sides[:turn]:
            if should_stop():
                return None
            side.piece(x, y)
        done, steps = done + 1, steps + -(-len(x) // reference.batch_size)
    noise = [t / f for t, f in zip(twin.pieces, reference.pieces, strict=True)]
    noise_low, noise_high = median_interval(noise)
    float32_ms = statistics.median(reference.pieces) * 1e3
    results = []
    for index, spec in enumerate(specs):
        timed = policy_sides.get(index)
        if timed is None:
            results.append(Timed(spec, None, errors[index]))
            continue
        ratios = [p / f for p, f in zip(timed.pieces, reference.pieces, strict=True)]
        low, high = median_interval(ratios)
        results.append(Timed(spec, PrecisionSpeed(
            policy_ms=statistics.median(timed.pieces) * 1e3, float32_ms=float32_ms,
            slowdown=statistics.median(ratios), steps=steps, low=low, high=high,
            noise_low=noise_low, noise_high=noise_high, rounds=done,
            difference=speed_difference(low, high, noise_low, noise_high),
        )))
    return results


def measure(
    spec: JobSpec,
    x: np.ndarray,
    y: np.ndarray,
    *,
    on_cpu_tf: bool,
    make_optimizer: Callable[[JobSpec], Any],
    rounds: int = ROUNDS,
    should_stop: Callable[[], bool] = lambda: False,
) -> PrecisionSpeed | None:
    """`spec`'s policy against float32 (`measure_all` with one policy); its failure to train is raised."""
    timed = measure_all([spec], x, y, on_cpu_tf=on_cpu_tf, make_optimizer=make_optimizer, rounds=rounds,
                        should_stop=should_stop)
    if timed is None:
        return None
    if timed[0].error is not None:
        raise RuntimeError(timed[0].error)
    return timed[0].speed


def check_after_run(spec: JobSpec, device: DeviceInfo, settings: Settings, dataset: Dataset, trained: int,
                    builder: SummaryBuilder, make_optimizer: Callable[[JobSpec], Any],
                    should_stop: Callable[[], bool]) -> None:
    """After a run that trained `trained` steps: time what `spec.speed_check` asks for into `builder`.

    By default a CPU job in float16/bfloat16 times its own policy; a comparison's float32
    baseline times every other variant, on any device. A failed measurement only leaves
    the figures out: the job itself succeeded.
    """
    if spec.speed_check is None:  # a plan variant times its planned model on any device: pins cost speed
        own = (device.kind == "cpu" or spec.plan == "auto") and (spec.precision_policy.compute_dtype != "float32"
                                                                 or spec.fp8 is not None)
        specs = [spec] if own else []
    else:
        specs = [variant_spec(spec, v) for v in spec.speed_check]
    per_round, rounds = settings.speed_check_steps, settings.speed_check_rounds
    if not specs or per_round <= 0 or rounds <= 0 or not trained:
        return
    # A short run gets a short check: each side trains at most about half as many steps as the run did.
    parts = list(dataset.batches(0, min(per_round, max(1, trained // (2 * rounds)))))
    x, y = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    try:
        timed = measure_all(specs, x, y, on_cpu_tf=device.kind == "cpu" and device.backend == "tensorflow",
                            rounds=rounds, max_seconds=settings.speed_check_max_seconds,
                            make_optimizer=make_optimizer, should_stop=should_stop)
    except Exception:
        log.warning("speed check failed; the summary has no precision speed", exc_info=True)
        return
    if timed is None:
        log.info("speed check abandoned: the job was asked to stop after its last step")
        return

    def slow(t: Timed) -> str | None:
        policy = t.spec.precision_policy
        return slow_precision_message(device, policy.compute_dtype, policy.value, t.speed) if t.speed else None

    if spec.speed_check is None:
        if timed[0].speed is None:
            log.warning("speed check failed; the summary has no precision speed: %s", timed[0].error)
            return
        builder.set_speed(timed[0].speed, slow(timed[0]))
        return
    builder.set_variant_speeds([VariantSpeed(label=v.label, speed=t.speed, error=t.error, slow_precision=slow(t))
                                for v, t in zip(spec.speed_check, timed, strict=True)])
