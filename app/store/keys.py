"""Where everything lives in Redis: every key, and the format of a step entry in a metrics stream.

Keys (prefix `mpjobs:`):
    job:{id}            hash   the job record (state, spec, times, summary, error...)
    job:{id}:events     stream one entry per state transition (also feeds SSE)
    job:{id}:metrics    stream one entry per step, entry id `{step}-0`
    job:{id}:rollup     stream one entry per ROLLUP_STEPS steps, entry id `{index}-0`
    job:{id}:layers     stream one entry per layer check, entry id `{step}-0`, field `l` (LayerCheck JSON)
    job:{id}:evaluations stream one entry per evaluation, entry id `{step}-0`, field `e` (EvalRecord JSON)
    jobs:{tenant}       zset   the tenant's job ids, scored by creation sequence
    jobs:{tenant}:{state} zset the tenant's job ids in that state, same scores
    idem:{tenant}:{sha} string Idempotency-Key of POST /jobs -> {fingerprint, job_id}, kept IDEMPOTENCY_TTL_S
    idem-cmp:{tenant}:{sha} string Idempotency-Key of POST /comparisons -> {fingerprint, comparison_id}, the same
    job:{id}:lease      string the running attempt's lease, renewed while it lives
    job:{id}:archiving  string a worker's claim on archiving the job's history, kept ARCHIVE_CLAIM_S
    job:{id}:view:{n}   string the `max_points=n` view as JSON (n = 500 or 1000), kept VIEW_TTL_S;
                               `...:fresh` marks it current (an ended job's: a day; a running one's: 1 s)
    running             set    ids of running jobs, for the reaper
    ended               zset   ended jobs whose history is still in Redis, scored by when they ended (Unix s)
    seq                 string creation sequence counter
    tenants             set    every tenant that has created a job (for /metrics)
    stats               hash   counters since the database began: steps, skipped_steps, diagnoses:{code}
    cmp:{id}            hash   a precision comparison: its spec and its variants' job ids
    cmps:{tenant}       zset   the tenant's comparison ids, scored by creation sequence
    dataset:{tenant}:{id}      hash the tenant's uploaded dataset: its arrays, bytes and time (id: its SHA-256)
    dataset:{tenant}:{id}:jobs set  ids of the tenant's jobs that train on it
    datasets:{tenant}   zset   the tenant's dataset ids, scored by upload time (Unix s)
    dataset-owners:{id} set    tenants holding a record of the file `<ARTIFACTS_DIR>/datasets/{id}.npz`

A step is one entry of `job:{id}:metrics`, id `{step}-0`, field `r` holding the StepRecord as JSON;
a rollup one entry of `job:{id}:rollup`, id `{index}-0`, field `a`. Only this module spells them; the
Lua scripts get them as arguments, except the per-state indexes, which the transition and reap
scripts extend from JOB_INDEX_PREFIX with the job's tenant and state.

Every `{id}` is a record id (app/store/ids.py), or a dataset's SHA-256 in 64 lowercase hex digits, checked
by its route: no other text is put into a key.

Once a job's history is archived (app/store/archive.py), its record holds ARCHIVED_FIELD and its
metrics, rollup and layers streams are gone: readers take the history from the files then.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

from mpjobs.contract.jobs import JobState
from mpjobs.contract.records import EvalRecord, LayerCheck, StepRecord

PREFIX = "mpjobs:"
RUNNING = f"{PREFIX}running"
ENDED = f"{PREFIX}ended"
SEQ = f"{PREFIX}seq"
TENANTS = f"{PREFIX}tenants"
STATS = f"{PREFIX}stats"
JOB_INDEX_PREFIX = f"{PREFIX}jobs:"
"""`jobs:{tenant}` and `jobs:{tenant}:{state}`: the Lua scripts append the tenant and state themselves."""
COMPARISON_PREFIX = f"{PREFIX}cmp:"
"""`cmp:{id}`: the purge script appends a job's comparison id to see whether the comparison still exists."""


def job_key(job_id: str) -> str:
    return f"{PREFIX}job:{job_id}"


def events_key(job_id: str) -> str:
    return f"{PREFIX}job:{job_id}:events"


def metrics_key(job_id: str) -> str:
    return f"{PREFIX}job:{job_id}:metrics"


def rollup_key(job_id: str) -> str:
    return f"{PREFIX}job:{job_id}:rollup"


def layers_key(job_id: str) -> str:
    return f"{PREFIX}job:{job_id}:layers"


def evaluations_key(job_id: str) -> str:
    return f"{PREFIX}job:{job_id}:evaluations"


def view_key(job_id: str, max_points: int) -> str:
    return f"{PREFIX}job:{job_id}:view:{max_points}"


def lease_key(job_id: str) -> str:
    return f"{PREFIX}job:{job_id}:lease"


def archive_claim_key(job_id: str) -> str:
    return f"{PREFIX}job:{job_id}:archiving"


def view_fresh_key(job_id: str, max_points: int) -> str:
    """Present while the cached view of that size is current."""
    return f"{view_key(job_id, max_points)}:fresh"


def job_keys(job_id: str, view_sizes: Iterable[int]) -> list[str]:
    """Every key one job owns (its cached views for each of `view_sizes`): the record first and its
    lease second, where the purge script reads them. A new per-job key belongs here, or a purge leaves it."""
    views = [key for n in sorted(view_sizes) for key in (view_key(job_id, n), view_fresh_key(job_id, n))]
    return [job_key(job_id), lease_key(job_id), events_key(job_id), metrics_key(job_id), rollup_key(job_id),
            layers_key(job_id), archive_claim_key(job_id), *views, evaluations_key(job_id)]


def comparison_key(comparison_id: str) -> str:
    return f"{COMPARISON_PREFIX}{comparison_id}"


def comparison_index_key(tenant: str) -> str:
    return f"{PREFIX}cmps:{tenant}"


def index_key(tenant: str, state: JobState | None = None) -> str:
    return f"{JOB_INDEX_PREFIX}{tenant}" + (f":{state.value}" if state else "")


def idempotency_key(tenant: str, key: str) -> str:
    return f"{PREFIX}idem:{tenant}:{hashlib.sha256(key.encode()).hexdigest()}"


def comparison_idempotency_key(tenant: str, key: str) -> str:
    """Apart from the keys of POST /jobs: one Idempotency-Key string may name a job and a comparison."""
    return f"{PREFIX}idem-cmp:{tenant}:{hashlib.sha256(key.encode()).hexdigest()}"


ARCHIVED_FIELD = "archived"
"""The job record's field that says its history is archived: the archive's JSON description
(app/store/archive.py `ArchiveInfo`). Absent while the history is in Redis."""


# -- stream entries ------------------------------------------------------------

STEP_FIELD = "r"
"""The field of a metrics entry that holds its StepRecord as JSON."""
ROLLUP_FIELD = "a"
"""The field of a rollup entry that holds its Rollup as JSON."""
LAYERS_FIELD = "l"
"""The field of a layers entry that holds its LayerCheck as JSON."""


def dataset_key(tenant: str, dataset_id: str) -> str:
    return f"{PREFIX}dataset:{tenant}:{dataset_id}"


def dataset_jobs_key(tenant: str, dataset_id: str) -> str:
    return f"{PREFIX}dataset:{tenant}:{dataset_id}:jobs"


def dataset_index_key(tenant: str) -> str:
    return f"{PREFIX}datasets:{tenant}"


def dataset_owners_key(dataset_id: str) -> str:
    return f"{PREFIX}dataset-owners:{dataset_id}"


def entry_id(number: int) -> str:
    """The stream id of step `number` (or rollup `number`): `{number}-0`."""
    return f"{number}-0"


def after(number: int) -> str:
    """An XRANGE bound that starts just past step `number`."""
    return f"({number}-0"


def number_of(stream_id: str) -> int:
    """The step (or rollup index) of a stream id: `"42-0"` -> 42."""
    return int(stream_id.split("-")[0])


def step_fields(record: StepRecord) -> dict[str, str]:
    return {STEP_FIELD: record.model_dump_json()}


def step_record(fields: dict[str, Any]) -> StepRecord:
    return StepRecord.model_validate_json(fields[STEP_FIELD])


def layers_fields(check: LayerCheck) -> dict[str, str]:
    return {LAYERS_FIELD: check.model_dump_json()}


def layer_check(fields: dict[str, Any]) -> LayerCheck:
    return LayerCheck.model_validate_json(fields[LAYERS_FIELD])


EVALUATION_FIELD = "e"
"""The field of an evaluations entry that holds its EvalRecord as JSON."""


def evaluation_fields(record: EvalRecord) -> dict[str, str]:
    return {EVALUATION_FIELD: record.model_dump_json()}


def evaluation_record(fields: dict[str, Any]) -> EvalRecord:
    return EvalRecord.model_validate_json(fields[EVALUATION_FIELD])
