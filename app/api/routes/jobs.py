"""Routes of /jobs: submit (idempotent), list, read, cancel or delete, download the trained model."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Header, Path, Query, Request, Response, status
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse

from app.api import services
from app.api.admission import admit
from app.api.auth import tenant_for
from app.api.dataset_fit import check_dataset
from app.api.deletion import purge_job
from app.api.deps import MemoryDep, RQRedisDep, SettingsDep, StoreDep, TenantDep
from app.api.examples import SPEC_EXAMPLES
from app.api.params import ID_DESCRIPTION, Cursor, JobIdDep, JobPageLimit
from app.api.resources import JOB_ERROR_RESPONSES, REDIS_FULL, ErrorBody, JobPage
from app.core.errors import JobNotFound
from app.store.ids import is_record_id
from mpjobs.contract.jobs import JobRecord, JobState
from mpjobs.contract.spec import JobSpec

router = APIRouter(prefix="/jobs", tags=["jobs"], responses=JOB_ERROR_RESPONSES)


@router.post("", status_code=status.HTTP_201_CREATED, response_model=JobRecord,
             responses={200: {"model": JobRecord, "description": "The job an earlier request with this Idempotency-Key "
                                                          "created"},
                        409: {"description": "Idempotency-Key reused with a different spec"}, **REDIS_FULL})
async def submit_job(
    spec: Annotated[JobSpec, Body(openapi_examples=SPEC_EXAMPLES)], store: StoreDep, redis: RQRedisDep,
    tenant: TenantDep, memory: MemoryDep, settings: SettingsDep, response: Response,
    idempotency_key: Annotated[str | None, Header(min_length=1, max_length=200)] = None,
) -> JobRecord:
    """Queue a training job. Defaults are filled in; a bad spec, or one over this deployment's limits
    (MAX_JOB_SECONDS, MAX_MODEL_BYTES), or a dataset that is missing or does not fit the model, gets 422
    naming the field. Redis past its memory high-water mark
    gets 503. Either way nothing is written."""
    admit(spec, settings)
    await run_in_threadpool(check_dataset, spec, store, settings, tenant)
    await run_in_threadpool(memory.require_room)
    job, created = await run_in_threadpool(services.submit, store, redis, spec, tenant, idempotency_key)
    response.headers["Location"] = f"/jobs/{job.id}"
    if not created:
        response.status_code = status.HTTP_200_OK
    return job


@router.get("", response_model=JobPage)
async def list_jobs(
    store: StoreDep,
    tenant: TenantDep,
    state: JobState | None = None,
    limit: JobPageLimit = 50,
    cursor: Cursor = None,
) -> JobPage:
    return await run_in_threadpool(services.list_jobs, store, tenant, state, limit, cursor)


@router.get("/{job_id}", response_model=JobRecord)
async def get_job(job_id: Annotated[str, Path(description=ID_DESCRIPTION)], request: Request,
                  authorization: Annotated[str | None, Header()] = None) -> Response:
    """The job: its state, progress, transitions, summary and diagnoses. Read on the async Redis client, with
    no threadpool hop (app/api/job_views.py). The most polled route: the tenant and the id are checked here
    as JobIdDep checks them (401 first, then a malformed id is the 404 of a missing job), without the cost
    of resolving dependencies."""
    tenant = tenant_for(request.app.state.api_keys, authorization)
    if not is_record_id(job_id):
        raise JobNotFound(job_id)
    return Response(await request.app.state.job_views.json(job_id, tenant), media_type="application/json")


@router.delete("/{job_id}", status_code=status.HTTP_202_ACCEPTED, response_model=JobRecord, responses={
    204: {"description": "purge=true: the ended job is deleted, with every trace of it"},
    409: {"model": ErrorBody, "description": "The job has already ended (nothing to cancel); or purge=true on a "
                                             "job that has not ended, or that belongs to a comparison: nothing "
                                             "was deleted"},
})
async def cancel_job(
    job_id: JobIdDep, store: StoreDep, redis: RQRedisDep, tenant: TenantDep, settings: SettingsDep,
    purge: Annotated[bool, Query(description="Delete the ended job for good instead of "
                                  "canceling: its record, metrics, files and queue entries (204)")] = False,
) -> JobRecord | Response:
    """Cancel the job (202 with the job). Queued: canceled at once. Running: its worker stops after its current
    step; a worker that does not answer within 3 s (or whose lease is gone) is presumed dead, and the job is
    canceled at once. Ended: 409 with its state. With `purge=true`, delete an ended job for good (204)."""
    if purge:
        await run_in_threadpool(purge_job, store, redis, settings, job_id, tenant)
        return Response(status_code=status.HTTP_204_NO_CONTENT)
    return await run_in_threadpool(services.cancel, store, redis, job_id, tenant)


@router.get("/{job_id}/artifacts/model.keras", response_class=FileResponse)
async def model_artifact(job_id: JobIdDep, store: StoreDep, settings: SettingsDep, tenant: TenantDep) -> FileResponse:
    path = await run_in_threadpool(services.artifact, store, settings, job_id, tenant)
    return FileResponse(path, media_type="application/octet-stream", filename=f"{job_id}.keras")
