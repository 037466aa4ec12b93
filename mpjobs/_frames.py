"""Step records as a pandas DataFrame; pandas is optional, imported only when a frame is asked for."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from mpjobs.contract.records import StepRecord

STEP_COLUMNS = list(StepRecord.model_fields)
"""A frame's columns, in the step record's order: step, loss, loss_scale, grad_norm, ..."""


def pandas() -> Any:
    try:
        import pandas as pd
    except ImportError as exc:
        raise ImportError("to_pandas() needs pandas, which mpjobs does not install: pip install pandas") from exc
    return pd


def step_frame(records: Iterable[StepRecord], first: dict[str, Any] | None = None) -> Any:
    """One row per step, a column per StepRecord field (null, a non-finite value, as NaN); `first` adds
    columns of constant values before them (a comparison's `variant` and `job_id`)."""
    pd = pandas()
    leading = first or {}
    rows = [{**leading, **record.model_dump()} for record in records]
    return pd.DataFrame(rows, columns=[*leading, *STEP_COLUMNS])
