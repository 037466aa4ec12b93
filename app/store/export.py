"""A job's whole step history as CSV, streamed: `GET /jobs/{id}/metrics.csv` and `mpjobs metrics --csv`.

One header row of the StepRecord's scalar fields (an FP8 job's per-layer `fp8` state is in the JSON pages),
then one row per stored step in step order. A cell is the
value as Python writes it (`str`), a boolean `true`/`false`, and null (a non-finite value) empty: the
rows the CLI wrote when it paged through `GET /jobs/{id}/metrics` itself. The records are read a chunk at
a time as stored (app/store/pages.py), from Redis or the archive, and parsed in one `json.loads` per
chunk: never validated one by one.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from app.store.history import MetricHistory
from mpjobs.contract.records import STEP_SCALARS

FIELDS = STEP_SCALARS
EXPORT_CHUNK = 5000
"""Records read, parsed and written per round: about 2 MB of CSV."""


def csv_header() -> str:
    return ",".join(FIELDS) + "\n"


def csv_rows(records: list[dict[str, Any]]) -> str:
    """Rows of `records` (parsed step records), in FIELDS order; a field a record lacks is an empty cell.

    Each value is written by `str`, then None, True and False become "", "true" and "false" over the whole
    chunk at once: no number's `str` holds those words, and no value needs quoting (every field is a
    number, a boolean or null)."""
    text = "".join(",".join(map(str, map(record.get, FIELDS))) + "\n" for record in records)
    return text.replace("None", "").replace("True", "true").replace("False", "false")


def csv_chunks(history: MetricHistory, job_id: str, chunk: int = EXPORT_CHUNK) -> Iterator[str]:
    """The header, then the rows of every stored step, `chunk` records at a time. A page read while the
    job is archived comes from the archive: paging by step, nothing is read twice or missed."""
    yield csv_header()
    after: int | None = 0
    while after is not None:
        page = history.read_metrics_raw(job_id, after, chunk)
        if page.steps:
            yield csv_rows(json.loads(b"[" + page.body + b"]"))
        after = page.next_after
