"""An FP8 job's latest scaling state (its step records' `fp8` rows) as a table, for a terminal."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from mpjobs import Client
from mpjobs.cli.words import table
from mpjobs.contract.formats import num, number, percent
from mpjobs.contract.fp8 import Fp8Tensor
from mpjobs.contract.jobs import MetricsPage

FP8_HEADER = ["LAYER", "TENSOR", "SCALE", "AMAX", "RANGE USE", "LAG", "SATURATED", "LOST", ""]
SATURATING = "saturating"
UNDERFLOWING = "underflowing"


def fp8_marks(row: Fp8Tensor) -> list[str]:
    """"saturating": its largest |x| past what the format holds at the scale in force (range use above 1);
    "underflowing": even its largest |x| under the format's smallest normal at that scale.

    >>> fp8_marks(Fp8Tensor(layer="d", tensor="kernel", scale=1.0, amax=0.01, range_use=0.01 / 448,
    ...                     history_max=0.01, peak_age=0))
    ['underflowing']
    """
    if row.range_use is not None and row.range_use > 1:
        return [SATURATING]
    return [UNDERFLOWING] if row.underflowing else []


def latest_fp8(records: Iterable[dict[str, Any]]) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The latest step record with FP8 rows, and the latest whose rows carry the exact counts (a checked step)."""
    latest = checked = None
    for record in records:
        if record.get("fp8"):
            latest = record
            if any(row.get("saturated_fraction") is not None for row in record["fp8"]):
                checked = record
    return latest, checked


def _share(value: Any) -> str:
    return "-" if value is None else percent(value)


def fp8_rows(record: dict[str, Any], checked: dict[str, Any] | None) -> list[list[str]]:
    """One row per FP8 layer and tensor: the record's scaling state and, with a checked step, its exact shares
    (LAG is the row's own `Fp8Tensor.lag`; "-": no amax, or an amax of 0)."""
    exact = {(r["layer"], r["tensor"]): r for r in (checked or {}).get("fp8") or []}
    rows = []
    for row in map(Fp8Tensor.model_validate, record["fp8"]):
        counted = exact.get((row.layer, row.tensor), {})
        shares = [_share(counted.get("saturated_fraction")), _share(counted.get("underflow_fraction"))]
        rows.append([row.layer, row.tensor, num(row.scale), num(row.amax), num(row.range_use),
                     "-" if row.lag is None else number(row.lag), *(shares if checked else []),
                     ", ".join(fp8_marks(row))])
    return rows


def fp8_report(job_id: str, record: dict[str, Any], checked: dict[str, Any] | None = None) -> str:
    """A step record's FP8 rows as a table (`latest_fp8` finds the record and the checked one).

    RANGE USE: amax / (format max × scale), above 1 saturated; LAG: history max / amax, how far the step's
    largest value sits below the one its scale follows; SATURATED and LOST: the exact shares of the latest
    checked step, of values clipped and of non-zero values that became zero.
    """
    counted = ("" if checked is None else ", a checked step" if checked["step"] == record["step"] else
               f"; SATURATED and LOST counted at step {checked['step']}, the latest checked step")
    header = FP8_HEADER if checked else [c for c in FP8_HEADER if c not in ("SATURATED", "LOST")]
    return "\n".join([f"job {job_id}: FP8 scaling at step {record['step']}{counted}",
                      table(header, fp8_rows(record, checked)),
                      "range use: amax / (format max × scale), above 1 saturated; lag: history max / amax"])


def fp8_section(client: Client, job_id: str) -> str | None:
    """The FP8 table of an FP8 job's latest stored step, with the exact shares of its latest checked step (at
    step 1 and multiples of `training.underflow_check_every`); None for a job without FP8 or without steps.
    Two one-record reads, whatever the run's length."""
    job = client.job(job_id)
    every, step = job.resource.spec.training.underflow_check_every, job.resource.progress.step
    if job.resource.spec.fp8 is None or step < 1:
        return None

    def record(at: int) -> dict[str, Any] | None:
        page = job.metrics(after=at - 1, limit=1)
        points = page.points if isinstance(page, MetricsPage) else []
        return points[0].model_dump(mode="json") if points and points[0].step == at else None

    latest, checked_step = record(step), max(1, step // every * every) if every > 0 else None
    checked = record(checked_step) if checked_step is not None else None
    if latest is None or not latest.get("fp8"):
        return None
    return fp8_report(job_id, latest, checked if checked and checked.get("fp8") else None)
