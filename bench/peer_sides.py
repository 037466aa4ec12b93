"""The sides of `bench.peers`: bare `fit` with what users log per-step curves with instead, and the engine.

Each peer is `bench.engine_overhead.Bare` (the same model, optimizer, batches and clock) with one
callback added before the clock, so a step's end includes the callback's work on that step:

- `keras.callbacks.TensorBoard(update_freq=1)`;
- `ScaleLogger`: what a user writes to watch the loss scale, the loss and the scale into a list each step;
- MLflow's Keras callback at every step (`mlflow.keras.MlflowCallback(log_every_epoch=False,
  log_every_n_steps=1)`, the callback that `mlflow.keras.autolog(log_every_n_steps=1)` adds to every
  `fit`; added by hand here, so the other sides' `fit` stays unpatched), into a local SQLite store.

Every side says how many series it recorded per step, counted from what it wrote, not assumed.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402

from bench.engine_overhead import PIECES, Bare, Engine, session_kept  # noqa: E402
from mpjobs.contract.spec import JobSpec  # noqa: E402
from worker.telemetry.step_vector import TELEMETRY_FIELDS  # noqa: E402

ENGINE_SERIES = len(TELEMETRY_FIELDS)
"""What the engine measures in every compiled step (worker/telemetry/step_vector.py): loss, loss scale, gradient norm,
finite flag, skip flag, the zero count's two parts, the regularization loss."""


class ScaleLogger(keras.callbacks.Callback):
    """The hand-written way to watch the loss scale: each step's loss and scale into a list.

    Under float32 there is no LossScaleOptimizer, so it keeps the loss alone.
    """

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, float]] = []

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        row = {"loss": float((logs or {})["loss"])}
        optimizer = self.model.optimizer
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            row["loss_scale"] = float(optimizer.dynamic_scale.numpy())
        self.rows.append(row)


class Peer(Bare):
    """Bare `fit` plus one peer's callback; `series()` counts what it recorded per step."""

    def __init__(self, name: str, spec: JobSpec, callback: keras.callbacks.Callback | None, out: Path) -> None:
        super().__init__(spec, [] if callback is None else [callback])
        self.name, self.out = name, out
        self.steps = 0

    def fit(self, x: Any, y: Any) -> None:
        super().fit(x, y)
        self.steps += len(self.pieces[-1])

    def series(self) -> int:
        """Series with a value at every step trained."""
        return 0


class TensorBoardPeer(Peer):
    def __init__(self, spec: JobSpec, out: Path) -> None:
        super().__init__("TensorBoard(update_freq=1)", spec, keras.callbacks.TensorBoard(str(out), update_freq=1), out)

    def series(self) -> int:
        import tensorflow as tf

        counts: Counter[str] = Counter()
        for events in (self.out / "train").glob("events.out.tfevents.*"):
            for event in tf.compat.v1.train.summary_iterator(str(events)):
                counts.update(value.tag for value in event.summary.value)
        return sum(1 for n in counts.values() if n >= self.steps)


class ScaleLoggerPeer(Peer):
    def __init__(self, spec: JobSpec, out: Path) -> None:
        self.logger = ScaleLogger()
        super().__init__("hand-written scale logger", spec, self.logger, out)

    def series(self) -> int:
        assert len(self.logger.rows) == self.calls, (len(self.logger.rows), self.calls)
        return len(self.logger.rows[0]) if self.calls == self.steps else 0  # one row per call, not per step


class MlflowPeer(Peer):
    """Logs into the active MLflow run (`mlflow_run`); its series are read back from the store."""

    def __init__(self, spec: JobSpec, out: Path) -> None:
        import mlflow.keras

        active = mlflow.active_run()
        assert active is not None, "MlflowPeer logs into the active run: use mlflow_run()"
        self.run_id = active.info.run_id
        super().__init__("MLflow Keras callback at every step", spec,
                         mlflow.keras.MlflowCallback(log_every_epoch=False, log_every_n_steps=1), out)

    def fit(self, x: Any, y: Any) -> None:
        import mlflow

        super().fit(x, y)
        # Its thread writes the queued steps to SQLite after the step ends: done before the next side's turn,
        # so that no other side pays for them.
        mlflow.flush_async_logging()

    def series(self) -> int:
        import mlflow

        client = mlflow.MlflowClient()
        keys = client.get_run(self.run_id).data.metrics
        return sum(1 for key in keys if len(client.get_metric_history(self.run_id, key)) >= self.steps)


@contextlib.contextmanager
def mlflow_run(folder: Path) -> Iterator[None]:
    """An active MLflow run in a SQLite store in `folder` (created on first use, as a user's would be)."""
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{folder / 'mlflow.db'}")
    # Its artifacts (a model summary per run) go beside the store, never into ./mlruns of the working folder.
    if mlflow.get_experiment_by_name("bench-peers") is None:
        mlflow.create_experiment("bench-peers", artifact_location=(folder / "artifacts").as_uri())
    mlflow.set_experiment("bench-peers")
    with mlflow.start_run():
        yield


def engine_spec(spec: JobSpec, layer_every: int | None) -> JobSpec:
    training = spec.training.model_copy(update={"layer_check_every": layer_every})
    return spec.model_copy(update={"training": training})


def sides(spec: JobSpec, out: Path, layer_every: int, repeat: int, mlflow: bool = True
          ) -> tuple[list[Engine], list[Peer]]:
    """([engine, engine with layer checks every `layer_every`], [bare, its A/A twin, the peers]).

    The engines come first (the first clears the session; the second keeps it), then every Keras side, in an
    order shuffled by `repeat`: where a model is built among the others can change its speed by a few points.
    """
    engines = [Engine(engine_spec(spec, 0), out / "engine")]
    with session_kept():
        engines.append(Engine(engine_spec(spec, layer_every), out / "engine-layers"))
    makers: list[Callable[[], Peer]] = [
        lambda: Peer("bare model.fit", spec, None, out), lambda: Peer("bare model.fit again (A/A)", spec, None, out),
        lambda: TensorBoardPeer(spec, out / "tensorboard"), lambda: ScaleLoggerPeer(spec, out)]
    if mlflow:
        makers.append(lambda: MlflowPeer(spec, out))
    built = {i: makers[i]() for i in random.Random(repeat).sample(range(len(makers)), len(makers))}
    return engines, [built[i] for i in range(len(makers))]


def take_turns(sides: Sequence[Bare | Engine], x: Any, y: Any, repeat: int) -> None:
    """Every side trains the same `PIECES` pieces of (x, y) in turn, as `bench.engine_overhead.take_turns`
    does for two, in a fresh shuffled order each piece (seeded by `repeat`): no side always goes first, and
    none always follows the same other side (whose leftover work, a writer thread, would land on it)."""
    rows, rng = len(x) // PIECES, random.Random(1000 + repeat)
    for piece in range(PIECES):
        part = slice(piece * rows, len(x) if piece == PIECES - 1 else (piece + 1) * rows)
        for side in rng.sample(list(sides), len(sides)):
            side.fit(x[part], y[part])
