"""An FP8 job's losses equal plain Keras `fit` with the same FP8 policy, seed and batches, under TensorFlow and JAX."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.stack import ROOT

pytestmark = pytest.mark.processes
"""Each backend runs in an interpreter of its own (KERAS_BACKEND is read once, at import)."""

SCRIPT = """
import json, sys, tempfile
from pathlib import Path
import keras, numpy as np
from keras import ops
from app.core.config import Settings
from mpjobs.contract.spec import JobSpec
from worker.engine.training import run_job
from worker.telemetry.reporters import ListReporter

given = json.loads(sys.stdin.read())
spec, data_root = JobSpec.model_validate(given["spec"]), Path(given["data_root"])
reporter = ListReporter()
result = run_job(spec, reporter=reporter, checkpoint_dir=Path(tempfile.mkdtemp()),
                 settings=Settings(data_root=data_root, speed_check_steps=0))

# Plain Keras: the same JSON under the same global policy, the float8 policy set on every Dense and
# EinsumDense layer (Keras quantizes a built layer when its policy becomes a quantized one), Adam, fit.
t = spec.training
keras.utils.set_random_seed(t.seed)
keras.config.set_dtype_policy(spec.precision_policy.value)
model = keras.models.model_from_json(spec.model.keras_json)
for layer in model._flatten_layers(include_self=False):
    if type(layer) in (keras.layers.Dense, keras.layers.EinsumDense):
        layer.dtype_policy = keras.dtype_policies.QuantizedFloat8DTypePolicy(
            "float8", spec.precision_policy.value, amax_history_length=spec.fp8.amax_history_length)
loss = keras.losses.MeanSquaredError()

class BatchLoss(keras.metrics.Metric):
    def __init__(self):
        super().__init__(name="batch_loss")
        self.value = self.add_variable(shape=(), initializer="zeros", name="value")
    def update_state(self, y_true, y_pred, sample_weight=None):
        self.value.assign(ops.cast(loss(y_true, y_pred), "float32"))
    def result(self):
        return ops.convert_to_tensor(self.value)

losses = []
class Keep(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        losses.append(float(logs["batch_loss"]))

data = np.load(data_root / spec.dataset.path)
order = np.random.default_rng([t.seed, 0]).permutation(len(data["x"]))  # the engine's first epoch
model.compile(optimizer=keras.optimizers.Adam(t.learning_rate), loss=loss, metrics=[BatchLoss()])
model.fit(data["x"][order], data["y"][order], batch_size=t.batch_size, epochs=1, shuffle=False, verbose=0,
          callbacks=[Keep()])
print(json.dumps({"backend": keras.backend.backend(), "engine": [r.loss for r in reporter.records],
                  "fp8_rows": len(reporter.records[-1].fp8), "plain": losses,
                  "counted": [f.underflow_fraction is not None for f in reporter.records[0].fp8]}))
"""


def _keras_json() -> str:
    import keras

    return keras.Sequential([
        keras.Input((8,)), keras.layers.Dense(16, activation="relu", name="hidden"),
        keras.layers.EinsumDense("ab,bc->ac", output_shape=12, bias_axes="c", activation="relu", name="mix"),
        keras.layers.Dense(4, name="out"),
    ]).to_json()


@pytest.mark.parametrize("backend", ["tensorflow", "jax"])
def test_an_fp8_run_has_the_losses_of_plain_keras_fit(backend: str, tmp_path: Path) -> None:
    import numpy as np

    steps, batch = 12, 16
    rng = np.random.default_rng(5)
    x = rng.standard_normal((steps * batch, 8)).astype(np.float32)
    y = (np.tanh(x @ rng.standard_normal((8, 4))) * 3).astype(np.float32)
    np.savez(tmp_path / "fp8.npz", x=x, y=y)
    spec = {"model": {"keras_json": _keras_json(), "loss": "mean_squared_error"},
            "precision_policy": "mixed_bfloat16", "fp8": {"amax_history_length": 4},
            "training": {"steps": steps, "batch_size": batch, "seed": 3},
            "dataset": {"kind": "npz", "path": "fp8.npz"}}
    env = {**os.environ, "KERAS_BACKEND": backend, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300, input=json.dumps({"spec": spec, "data_root": str(tmp_path)}))
    assert done.returncode == 0, done.stderr[-3000:]
    ran = json.loads(done.stdout.strip().splitlines()[-1])
    assert ran["backend"] == backend and ran["fp8_rows"] == 9  # three FP8 layers, three tensors each
    assert ran["counted"] == [True] * 9  # step 1 is checked: every tensor counted, on either backend
    assert len(ran["engine"]) == len(ran["plain"]) == steps
    assert ran["engine"] == pytest.approx(ran["plain"], rel=1e-6)
