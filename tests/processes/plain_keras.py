"""Load a model.keras with plain Keras in a fresh interpreter that cannot import mpjobs, and report what it holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import numpy as np

LOAD_PLAINLY = r'''
import json, sys
sys.path.extend(sys.argv[3:])  # site-packages alone: -S skipped its .pth files, mpjobs's editable install too
try:
    import mpjobs
except ImportError:
    mpjobs_importable = False
else:
    mpjobs_importable = True
import keras
import numpy as np

path, out = sys.argv[1], sys.argv[2]
model = keras.models.load_model(path)
opt = model.optimizer
inner = getattr(opt, "inner_optimizer", opt)
report = {
    "mpjobs_importable": mpjobs_importable, "compiled": model.compiled, "optimizer": type(opt).__name__,
    "inner": type(inner).__name__, "learning_rate": float(inner.learning_rate.numpy()),
    "loss_scale_factor": inner.loss_scale_factor, "iterations": int(opt.iterations.numpy()),
    "loss": model.loss if isinstance(model.loss, str) else type(model.loss).__name__,
}
arrays = {f"weight_{i}": w.numpy() for i, w in enumerate(model.weights)}  # as loaded, before fit changes them
arrays.update({f"inner_{i}": v.numpy() for i, v in enumerate(inner.variables)})
if isinstance(opt, keras.optimizers.LossScaleOptimizer):
    report.update(initial_scale=opt.initial_scale, dynamic_scale=float(opt.dynamic_scale.numpy()),
                  growth_steps=opt.dynamic_growth_steps)
rng = np.random.default_rng(0)
shape = (4, *model.input_shape[1:])
x = rng.normal(size=shape).astype("float32")
classes = model.output_shape[-1]
y = rng.integers(0, classes, size=(4,)) if report["loss"] == "sparse_categorical_crossentropy" else \
    rng.normal(size=(4, *model.output_shape[1:])).astype("float32")
report["evaluate"] = float(model.evaluate(x, y, verbose=0))
pred = model.predict(x, verbose=0)
before = int(opt.iterations.numpy())
history = model.fit(x, y, epochs=1, batch_size=4, verbose=0)
report["fit_loss"] = float(history.history["loss"][0])
report["iterations_after_fit"] = int(opt.iterations.numpy()) - before
np.savez(out, pred=pred, x=x, y=y, **arrays)
json.dump(report, open(out + ".json", "w"))
'''


def load_plainly(model_path: Path, workdir: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Load `model_path` with `python -I -S` run from an empty folder, given site-packages without its .pth files:
    no checkout, no mpjobs (an editable install is a .pth file) on sys.path. Returns (report, arrays)."""
    workdir.mkdir()
    site = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    out = workdir / "loaded.npz"
    command = [sys.executable, "-I", "-S", "-c", LOAD_PLAINLY, str(model_path), str(out), *site]
    done = subprocess.run(command, cwd=workdir, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert done.returncode == 0, done.stderr[-3000:]
    with np.load(out) as arrays:
        return json.loads((workdir / "loaded.npz.json").read_text()), dict(arrays)


def expected_loss(loss: str, pred: np.ndarray, y: np.ndarray) -> float:
    """The loss of `pred` against `y`, in NumPy (float64)."""
    p = pred.astype(np.float64)
    if loss == "sparse_categorical_crossentropy":
        return float(-np.mean(np.log(np.clip(p[np.arange(len(y)), y.astype(int)], 1e-7, 1.0))))
    assert loss == "mean_squared_error"
    return float(np.mean((p - y.astype(np.float64)) ** 2))


def same_bytes(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    """Same arrays, dtype and bytes."""
    return len(a) == len(b) and all(x.dtype == y.dtype and x.tobytes() == y.tobytes()
                                    for x, y in zip(a, b, strict=True))


TRY_LOADS = r'''
import json, sys
sys.path.extend(sys.argv[2:])
import keras

answers = {}
for compile in (True, False):
    try:
        keras.models.load_model(sys.argv[1], compile=compile)
    except Exception as exc:
        answers[str(compile)] = f"{type(exc).__name__}: {exc}"
    else:
        answers[str(compile)] = "loaded"
print(json.dumps(answers))
'''


def try_loads(model_path: Path, workdir: Path) -> dict[str, str]:
    """What plain `load_model` does with `model_path`, compiled ("True") and not ("False"), in the same fresh
    interpreter as `load_plainly`: "loaded", or the error's type and message."""
    workdir.mkdir()
    site = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    done = subprocess.run([sys.executable, "-I", "-S", "-c", TRY_LOADS, str(model_path), *site], cwd=workdir,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert done.returncode == 0, done.stderr[-3000:]
    answers: dict[str, str] = json.loads(done.stdout.strip().splitlines()[-1])
    return answers
