"""Routes of /jobs: submit (idempotent), list, read, cancel, download the trained model."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Header, Query, Response, status
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse

from app.api import services
from app.api.admission import admit
from app.api.deps import RQRedisDep, SettingsDep, StoreDep, TenantDep, WorkersDep
from app.api.examples import SPEC_EXAMPLES
from app.api.resources import JOB_ERROR_RESPONSES, JobPage
from app.core.job import Job, JobState
from app.core.spec import JobSpec

router = APIRouter(prefix="/jobs", tags=["jobs"], responses=JOB_ERROR_RESPONSES)


@router.post("", status_code=status.HTTP_201_CREATED, response_model=Job,
             responses={200: {"model": Job, "description": "The job an earlier request with this Idempotency-Key "
                                                          "created"},
                        409: {"description": "Idempotency-Key reused with a different spec"}})
async def submit_job(
    spec: Annotated[JobSpec, Body(openapi_examples=SPEC_EXAMPLES)], store: StoreDep, redis: RQRedisDep,
    tenant: TenantDep, settings: SettingsDep, response: Response,
    idempotency_key: Annotated[str | None, Header(min_length=1, max_length=200)] = None,
) -> Job:
    """Queue a training job. Defaults are filled in; a bad spec, or one over this deployment's limits
    (MAX_JOB_SECONDS, MAX_MODEL_BYTES), gets 422 naming the field."""
    admit(spec, settings)
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
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    cursor: Annotated[int | None, Query(ge=0, description="next_cursor of the previous page")] = None,
) -> JobPage:
    return await run_in_threadpool(services.list_jobs, store, tenant, state, limit, cursor)


@router.get("/{job_id}", response_model=Job)
async def get_job(job_id: str, store: StoreDep, tenant: TenantDep, workers: WorkersDep) -> Job:
    return await run_in_threadpool(services.get, store, job_id, tenant, workers)


@router.delete("/{job_id}", status_code=status.HTTP_202_ACCEPTED, response_model=Job)
async def cancel_job(job_id: str, store: StoreDep, redis: RQRedisDep, tenant: TenantDep) -> Job:
    return await run_in_threadpool(services.cancel, store, redis, job_id, tenant)


@router.get("/{job_id}/artifacts/model.keras", response_class=FileResponse)
async def model_artifact(job_id: str, store: StoreDep, settings: SettingsDep, tenant: TenantDep) -> FileResponse:
    path = await run_in_threadpool(services.artifact, store, settings, job_id, tenant)
    return FileResponse(path, media_type="application/octet-stream", filename=f"{job_id}.keras")
