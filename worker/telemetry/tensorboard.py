"""TensorBoard event files for every run: `tensorboard --logdir <artifacts>` shows each job.

Events are built and written on a thread of their own, so the training step
never pays for protobufs or disk. Only the `tensorboard` package is needed,
not TensorFlow: the same writer serves the TensorFlow and JAX backends.

A layer check adds, at its step, one scalar per layer and numeric field, tagged
`layers/<layer name>/<field>` (`layers/conv3d/excess_zero_fraction`); a null
field is left out. An evaluation adds `validation/loss` and `validation/<metric>` at its step.

An FP8 job's step adds, for each FP8 layer and tensor, one scalar per field of its scaling state, tagged
`fp8/<layer>/<tensor>/<field>` (`fp8/dense_1/outputs_grad/range_use`; the checked steps' exact shares
too); a null field is left out.

A resumed attempt starts its file with a `SessionLog.START` at the step after
its checkpoint; TensorBoard then drops the points the lost attempt wrote past
that step, so each step keeps one value per tag.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, get_args

from tensorboard.compat.proto.event_pb2 import Event, SessionLog
from tensorboard.compat.proto.summary_pb2 import Summary as TbSummary
from tensorboard.compat.proto.summary_pb2 import SummaryMetadata
from tensorboard.compat.proto.tensor_pb2 import TensorProto
from tensorboard.compat.proto.types_pb2 import DT_STRING
from tensorboard.summary.writer.event_file_writer import EventFileWriter

from mpjobs.contract.fp8 import Fp8Tensor
from mpjobs.contract.records import EvalRecord, LayerCheck, LayerNumerics, StepRecord, Summary

log = logging.getLogger("mpjobs.worker")

LOGDIR = "tensorboard"
"""The event files' folder under a job's artifacts folder."""
TAGS = ("loss", "loss_scale", "grad_norm", "zero_grad_fraction", "examples_per_sec", "skipped")
SOMETIMES = ("regularization_loss", "excess_zero_fraction", "grad_rel_error")
"""Tags of the values only some steps have (penalties; the float32 check's steps): written when present."""


def _is_number(annotation: Any) -> bool:
    """int or float, or either or None; a bool is a flag, a str a name: neither is a scalar."""
    return set(get_args(annotation) or (annotation,)) - {type(None)} <= {int, float}


LAYER_FIELDS = tuple(name for name, field in LayerNumerics.model_fields.items() if _is_number(field.annotation))
"""The numeric fields of a layer's numerics, each one tag per layer."""
LAYERS_TAG = "layers"
FP8_FIELDS = ("scale", "amax", "range_use", "history_max", "lag", "saturated_fraction", "underflow_fraction")
"""An FP8 row's values, each one tag per layer and tensor (`lag` is the row's own property; the shares are on
checked steps only)."""
FP8_TAG = "fp8"
FLUSH_SECS = 2


def _value(record: StepRecord, tag: str) -> float:
    value = getattr(record, tag)
    return math.nan if value is None else float(value)  # a non-finite loss is shown, not left out


def fp8_values(rows: Sequence[Fp8Tensor]) -> list[TbSummary.Value]:
    """Each row's fields as scalars; a null one (not finite, or not checked at this step) is left out."""
    return [TbSummary.Value(tag=f"{FP8_TAG}/{row.layer}/{row.tensor}/{field}", simple_value=float(value))
            for row in rows for field in FP8_FIELDS
            if (value := getattr(row, field)) is not None and math.isfinite(value)]


def step_event(record: StepRecord) -> Event:
    values = [TbSummary.Value(tag=tag, simple_value=_value(record, tag)) for tag in TAGS]
    values += [TbSummary.Value(tag=tag, simple_value=float(getattr(record, tag))) for tag in SOMETIMES
               if getattr(record, tag) is not None]
    values += fp8_values(record.fp8 or ())
    return Event(wall_time=record.time, step=record.step, summary=TbSummary(value=values))


def layers_event(check: LayerCheck) -> Event:
    values = [TbSummary.Value(tag=f"{LAYERS_TAG}/{layer.name}/{field}", simple_value=float(value))
              for layer in check.layers for field in LAYER_FIELDS if (value := getattr(layer, field)) is not None]
    return Event(wall_time=check.time, step=check.step, summary=TbSummary(value=values))


def evaluation_event(record: EvalRecord) -> Event:
    named = {"loss": record.loss, **record.metrics}
    values = [TbSummary.Value(tag=f"validation/{name}", simple_value=math.nan if value is None else float(value))
              for name, value in named.items()]
    return Event(wall_time=record.time, step=record.step, summary=TbSummary(value=values))


def text_event(tag: str, text: str) -> Event:
    """A Markdown note in TensorBoard's Text tab, at step 0."""
    value = TbSummary.Value(
        tag=tag, metadata=SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="text")),
        tensor=TensorProto(dtype=DT_STRING, string_val=[text.encode()], tensor_shape={"dim": [{"size": 1}]}),
    )
    return Event(step=0, summary=TbSummary(value=[value]))


class TensorBoardReporter:
    """A Reporter: each step record becomes one event holding every tag's scalar, each layer check one
    holding every layer's.

    `description` (the job's name, precision and loss scaling) goes in the Text tab, so runs
    named by job id can still be told apart, a comparison's variants among them.
    """

    def __init__(self, logdir: Path, resume_step: int = 0, description: str | None = None) -> None:
        self.logdir = logdir
        self.failures = 0
        """Batches whose events could not be written: the first is logged with its error, the rest counted."""
        self._queue: queue.SimpleQueue[Sequence[StepRecord | LayerCheck | EvalRecord] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._write, name="tensorboard-writer", daemon=True)
        self._writer: EventFileWriter | None = None
        try:
            logdir.mkdir(parents=True, exist_ok=True)
            writer = EventFileWriter(str(logdir), flush_secs=FLUSH_SECS, filename_suffix=".mpjobs")
            if resume_step:
                writer.add_event(Event(step=resume_step + 1, session_log=SessionLog(status=SessionLog.START)))
            elif description:
                writer.add_event(text_event("run", description))
        except Exception:  # a full disk or a bad folder at the start must not fail the job either
            log.exception("TensorBoard events cannot be written to %s; the job trains without them", logdir)
            return
        self._writer = writer
        self._thread.start()

    def _write(self) -> None:
        assert self._writer is not None
        while (items := self._queue.get()) is not None:
            try:
                for item in items:
                    self._writer.add_event(step_event(item) if isinstance(item, StepRecord) else
                                           layers_event(item) if isinstance(item, LayerCheck) else
                                           evaluation_event(item))
            except Exception:  # a full disk must not fail training; the metrics are also in Redis
                self.failures += 1
                if self.failures == 1:  # once: a full disk would fail every batch from here on
                    log.exception("writing TensorBoard events to %s failed", self.logdir)

    def steps(self, records: Sequence[StepRecord]) -> None:
        if self._writer is not None:
            self._queue.put(list(records))

    def layers(self, checks: Sequence[LayerCheck]) -> None:
        if self._writer is not None:
            self._queue.put(list(checks))

    def evaluations(self, records: Sequence[EvalRecord]) -> None:
        if self._writer is not None:
            self._queue.put(list(records))

    def summary(self, summary: Summary) -> None:
        """The summary is in the job record; TensorBoard gets the per-step scalars."""

    def close(self) -> None:
        """Write what is queued, then flush and close the file."""
        if self._writer is None:
            return
        self._queue.put(None)
        self._thread.join()
        self._writer.close()
        if self.failures > 1:
            log.error("writing TensorBoard events to %s failed for %d more batches; their steps are in Redis only",
                      self.logdir, self.failures - 1)

