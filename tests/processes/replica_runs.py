"""The runs tests/processes/test_replicas.py compares, in a process whose CPU is split into two devices.

TensorFlow fixes its devices when it first uses them, and the test process has
long since used one; so this runs apart (`python -m tests.processes.replica_runs OUT`)
and writes every run's step records, and the plain-tape reference, as JSON to OUT.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from worker.engine.data import SEGMENT_BYTES

SPECS: dict[str, dict[str, Any]] = {
    # float32 with a growing dynamic scale: the scale trajectory is compared too.
    "float32": {"precision_policy": "float32", "loss_scale": {"mode": "dynamic", "initial_scale": 256,
                                                              "growth_steps": 2}},
    # No loss scale: the inner optimizer applies every step without a skip decision.
    "plain": {"precision_policy": "float32", "loss_scale": {"mode": "none"}},
    # mixed_float16 at 2**28: the first steps overflow and are skipped, halving the scale each time.
    "overflow": {"precision_policy": "mixed_float16",
                 "loss_scale": {"mode": "dynamic", "initial_scale": 2.0**28, "growth_steps": 3}},
}
STEPS = 30
SHORT = {"plain": 10}
"""Runs shorter than STEPS: no scale to follow, so fewer steps show it."""
TRAINING = {"steps": STEPS, "batch_size": 16, "optimizer": "adam", "learning_rate": 0.01, "checkpoint_every": 10}


def spec(name: str, devices: int, steps: int = STEPS, per_call: int = 1) -> Any:
    from mpjobs.contract.spec import JobSpec

    return JobSpec.model_validate({"model": {"name": "mlp"}, "dataset": {"samples": 64}, **SPECS[name],
                                   "training": {**TRAINING, "steps": steps, "devices": devices,
                                                "steps_per_execution": per_call}})


def tape_grad_norm(settings: Any) -> float:
    """Step 1's gradient norm from a plain GradientTape on the engine's initial weights and first batch."""
    import tensorflow as tf

    from worker.engine.devices import detect_device
    from worker.engine.training import ListReporter, Training, never

    training = Training(spec("float32", 1), ListReporter(), Path(tempfile.mkdtemp()), never, settings,
                        detect_device(2))
    x, y = next(iter(training.segments(SEGMENT_BYTES)))
    batch = TRAINING["batch_size"]
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.keras.losses.get(training.model.loss)(y[:batch], training.model(x[:batch])))
    grads = tape.gradient(loss, training.model.trainable_variables)
    training.close()
    return float(tf.sqrt(sum(tf.reduce_sum(tf.square(tf.cast(g, tf.float64))) for g in grads)))


def main(out: Path) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from worker.engine.devices import detect_device

    device = detect_device(2)  # before TensorFlow's first use of a device
    import tensorflow as tf

    from app.core.config import Settings
    from worker.engine.training import ListReporter, run_job

    tf.config.experimental.enable_op_determinism()
    work = Path(tempfile.mkdtemp())
    settings = Settings(data_root=work / "data", artifacts_dir=work / "artifacts", speed_check_steps=0,
                        cpu_logical_devices=2)
    results: dict[str, Any] = {"devices": device.count, "tape_grad_norm": tape_grad_norm(settings)}
    for name in SPECS:
        for devices in (1, 2):
            reporter = ListReporter()
            run_job(spec(name, devices, SHORT.get(name, STEPS)), reporter=reporter,
                    checkpoint_dir=work / f"{name}{devices}", settings=settings)
            results[f"{name}/{devices}"] = [r.model_dump(mode="json") for r in reporter.records]
    # Resumed on two devices: 10 steps, then the rest from the checkpoint of step 10.
    resumed, records = work / "resumed", []
    for steps in (10, STEPS):
        reporter = ListReporter()
        run_job(spec("overflow", 2, steps), reporter=reporter, checkpoint_dir=resumed, settings=settings)
        records += [r.model_dump(mode="json") for r in reporter.records]
    results["overflow/2/resumed"] = records
    # Eight steps per call on two replicas: the skips fall inside calls (1-8, 9-10, 11-18, ...).
    reporter = ListReporter()
    run_job(spec("overflow", 2, per_call=8), reporter=reporter, checkpoint_dir=work / "per_call", settings=settings)
    results["overflow/2/per_call_8"] = [r.model_dump(mode="json") for r in reporter.records]
    out.write_text(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
