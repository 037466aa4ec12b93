"""A job's archived history: its step records, rollups and layer checks as Parquet files, written and read back.

An ended job's history moves out of Redis into `<ARTIFACTS_DIR>/<job id>/history/` (app/store/retention.py
decides when). Three files, each compressed with zstd:

    metrics.parquet  one row per step: a typed column per scalar StepRecord field (int64, float64, bool; null
                     where the record has None), so every value reads back exactly as it was stored; and (format
                     version 2) `record`, the record's JSON as the stream held it, which pages and streams
                     serve as it is (app/store/pages.py)
    rollups.parquet  one row per stored rollup: its index, steps, skips and each series' n/total/lo/hi
    layers.parquet   one row per layer check: its step and the LayerCheck JSON as it was stored

Each file is written to a temporary name, fsynced and renamed into place, then the folder is fsynced:
a file under its final name is always whole. The files count only once the job record says so
(`ArchiveInfo` in its ARCHIVED_FIELD); until then a retry simply writes them again.
"""

from __future__ import annotations

import bisect
import json
import os
import threading
import types
import typing
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, TypeAdapter

from app.store.rollup import SERIES
from mpjobs.contract.records import STEP_SCALARS, StepRecord

HISTORY_DIR = "history"
"""The archive's folder inside the job's folder."""
FORMAT_VERSION = 2
"""Bumped when the files change shape; a reader refuses a version newer than its own. Version 1 had no
`record` column: its pages are dumped from the typed columns instead, to the same bytes."""
RECORD_COLUMN = "record"
METRICS_FILE, ROLLUPS_FILE, LAYERS_FILE = "metrics.parquet", "rollups.parquet", "layers.parquet"
COMPRESSION = "zstd"
CACHED_HISTORIES = 4
"""Archives an API process keeps parsed, most recently read first: paging through a 100k-step run
reads its file once, not once per page. Each holds its steps and their records' JSON (measured for
100k steps of about 325 B of JSON each: 34 MB), its rollups once a view reads them (1.9 MB) and its
layer checks once read: about 36 MB per 100k steps, so up to about 145 MB for four such runs."""


class ArchiveInfo(BaseModel):
    """What the job record says about its archive (JSON in its ARCHIVED_FIELD)."""

    format: Literal["parquet"] = "parquet"
    version: int = FORMAT_VERSION
    dir: str
    """The archive's folder, relative to ARTIFACTS_DIR: `<job id>/history`."""
    steps: int
    rollups: int
    layer_checks: int
    archived_at: str


def history_dir(job_id: str) -> str:
    """The archive's folder relative to ARTIFACTS_DIR."""
    return f"{job_id}/{HISTORY_DIR}"


def _arrow_type(name: str, annotation: Any) -> tuple[pa.DataType, bool]:
    """(column type, nullable) of a StepRecord field."""
    args = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    kinds = [a for a in args if a is not type(None)]
    arrow = {int: pa.int64(), float: pa.float64(), bool: pa.bool_()}.get(kinds[0]) if len(kinds) == 1 else None
    if arrow is None:
        raise TypeError(f"Expected a StepRecord field of type int, float or bool (or None). Received: {name}: "
                        f"{annotation}")
    return arrow, len(kinds) < len(args)


STEP_SCHEMA = pa.schema([pa.field(name, *_arrow_type(name, StepRecord.model_fields[name].annotation))
                         for name in STEP_SCALARS]
                        + [pa.field(RECORD_COLUMN, pa.string(), nullable=False)])
ROLLUP_COUNTS = ("first_step", "last_step", "steps", "skipped")
SERIES_PARTS = {"n": pa.int64(), "total": pa.float64(), "lo": pa.float64(), "hi": pa.float64()}
"""A rollup's figures per series (`Rollup.to_json`); lo and hi are null when n is 0."""
ROLLUP_SCHEMA = pa.schema(
    [pa.field(name, pa.int64(), nullable=False) for name in ("index", *ROLLUP_COUNTS)]
    + [pa.field(f"{series}_{part}", kind, nullable=part in ("lo", "hi")) for series in SERIES
       for part, kind in SERIES_PARTS.items()])
LAYERS_SCHEMA = pa.schema([pa.field("step", pa.int64(), nullable=False), pa.field("check", pa.string(), False)])
_STEP_RECORDS = TypeAdapter(list[StepRecord])
"""Validates a page of records in one call: faster than a call per record."""


# -- writing --------------------------------------------------------------------------------------


def write_history(folder: Path, steps: Sequence[dict[str, Any]], step_json: Sequence[str],
                  rollups: Sequence[tuple[int, dict[str, Any]]], layers: Sequence[tuple[int, str]]) -> None:
    """Write the three files into `folder`, each whole or not at all, then make the folder durable.

    `steps` are StepRecords as dicts, in step order, and `step_json` each one's JSON as stored; `rollups`
    (index, `Rollup.to_json()` form); `layers` (step, LayerCheck JSON as stored).
    """
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob(".*.tmp"):  # left by a writer that died mid-file
        stale.unlink(missing_ok=True)
    rollup_rows = [{"index": index, **{name: rollup[name] for name in ROLLUP_COUNTS},
                    **{f"{s}_{part}": rollup["series"][s][part] for s in SERIES for part in SERIES_PARTS}}
                   for index, rollup in rollups]
    metrics = pa.Table.from_pylist(list(steps), schema=STEP_SCHEMA.remove(STEP_SCHEMA.get_field_index(RECORD_COLUMN)))
    metrics = metrics.append_column(STEP_SCHEMA.field(RECORD_COLUMN), pa.array(step_json, pa.string()))
    tables = {METRICS_FILE: metrics,
              ROLLUPS_FILE: pa.Table.from_pylist(rollup_rows, schema=ROLLUP_SCHEMA),
              LAYERS_FILE: pa.Table.from_pylist([{"step": step, "check": check} for step, check in layers],
                                                schema=LAYERS_SCHEMA)}
    for name, table in tables.items():
        _write_durably(folder / name, table)
    _fsync_dir(folder)
    _fsync_dir(folder.parent)  # the history folder itself may be new


def _write_durably(target: Path, table: pa.Table) -> None:
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        pq.write_table(table, tmp, compression=COMPRESSION)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- reading --------------------------------------------------------------------------------------


class ArchivedHistory:
    """One job's archive, parsed: its steps and records' JSON in memory (format 1: its typed columns), read by
    step as the Redis streams are.

    The step records are read when it is opened; the rollups and layer checks on first use.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        # Format 2: the step and each record's JSON are all that reads need (parsed as the streams' reads parse
        # it), so the typed columns stay on disk. Format 1 has only those.
        stored = pq.read_schema(folder / METRICS_FILE).names
        self.metrics: pa.Table = pq.read_table(folder / METRICS_FILE,
                                               columns=["step", RECORD_COLUMN] if RECORD_COLUMN in stored else None)
        column = self.metrics.column("step")
        steps = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
        # The steps in order, searched in place (a list of Python ints would take 45 B a step).
        self.steps: Sequence[int] = memoryview(steps.buffers()[1]).cast("q")[steps.offset:steps.offset + len(steps)] \
            if len(steps) else []
        self._rollups: list[dict[str, Any]] | None = None
        self._layers: tuple[list[int], pa.ChunkedArray] | None = None

    @property
    def last_step(self) -> int:
        return self.steps[-1] if self.steps else 0

    def records(self, after_step: int, limit: int | None = None, fields: Sequence[str] | None = None
                ) -> list[dict[str, Any]]:
        """Step records after `after_step` as dicts, in step order, at most `limit`; only `fields` if given.
        A field that the record (or a file of an older StepRecord) lacks is left out (its default applies)."""
        start = bisect.bisect_right(self.steps, after_step)
        table = self.metrics.slice(start, limit)
        if RECORD_COLUMN in table.column_names:
            rows: list[dict[str, Any]] = json.loads(f"[{','.join(table.column(RECORD_COLUMN).to_pylist())}]")
            return rows if fields is None else [{name: row[name] for name in fields if name in row} for row in rows]
        table = table.select([name for name in (STEP_SCALARS if fields is None else fields)
                              if name in table.column_names])
        rows = table.to_pylist()
        return rows

    def step_records(self, after_step: int, limit: int | None = None) -> list[StepRecord]:
        if RECORD_COLUMN in self.metrics.column_names:  # validated from the JSON, as a page from Redis is
            records = self.metrics.column(RECORD_COLUMN).slice(bisect.bisect_right(self.steps, after_step), limit)
            return _STEP_RECORDS.validate_json(f"[{','.join(records.to_pylist())}]")
        return _STEP_RECORDS.validate_python(self.records(after_step, limit))

    def step_jsons(self, after_step: int, limit: int | None = None) -> list[tuple[int, str]]:
        """(step, StepRecord JSON) after `after_step`: the JSON the metrics stream held, byte for byte."""
        if RECORD_COLUMN not in self.metrics.column_names:  # format version 1: dumped again, to the same JSON
            return [(record.step, record.model_dump_json()) for record in self.step_records(after_step, limit)]
        start = bisect.bisect_right(self.steps, after_step)
        stop = len(self.steps) if limit is None else min(len(self.steps), start + limit)
        return list(zip(self.steps[start:stop], self.metrics.column(RECORD_COLUMN).slice(start, stop - start)
                        .to_pylist(), strict=True))

    def rollups(self) -> list[dict[str, Any]]:
        """The stored rollups in `Rollup.to_json()` form, as the rollup stream held them."""
        if self._rollups is None:
            table = pq.read_table(self.folder / ROLLUPS_FILE).to_pydict()
            self._rollups = [
                {**{name: table[name][i] for name in ROLLUP_COUNTS},
                 "series": {s: {part: table[f"{s}_{part}"][i] for part in SERIES_PARTS} for s in SERIES}}
                for i in range(len(table["index"]))]
        return self._rollups

    def layer_checks(self, after_step: int, limit: int | None = None) -> list[tuple[int, str]]:
        """(step, LayerCheck JSON as stored) after `after_step`, in step order, at most `limit`."""
        if self._layers is None:
            table = pq.read_table(self.folder / LAYERS_FILE)
            self._layers = (table.column("step").to_pylist(), table.column("check"))
        steps, checks = self._layers
        start = bisect.bisect_right(steps, after_step)
        stop = len(steps) if limit is None else start + limit
        return list(zip(steps[start:stop], checks.slice(start, stop - start).to_pylist(), strict=True))


class HistoryCache:
    """The last CACHED_HISTORIES archives opened, by folder; a file rewritten since (a new inode or
    modification time) is opened afresh. Safe across the API's threads."""

    def __init__(self, size: int = CACHED_HISTORIES) -> None:
        self.size = size
        self._held: OrderedDict[Path, tuple[tuple[int, int], ArchivedHistory]] = OrderedDict()
        self._lock = threading.Lock()

    def open(self, folder: Path) -> ArchivedHistory:
        stat = (folder / METRICS_FILE).stat()
        version = (stat.st_ino, stat.st_mtime_ns)
        with self._lock:
            held = self._held.get(folder)
            if held is not None and held[0] == version:
                self._held.move_to_end(folder)
                return held[1]
        history = ArchivedHistory(folder)  # parsed outside the lock: other readers go on meanwhile
        with self._lock:
            self._held[folder] = (version, history)
            self._held.move_to_end(folder)
            while len(self._held) > self.size:
                self._held.popitem(last=False)
        return history
