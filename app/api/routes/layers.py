"""The route of a job's layer checks: every layer's gradient and activation numerics, page by page."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.concurrency import run_in_threadpool

from app.api import services
from app.api.deps import StoreDep, TenantDep
from app.api.params import AfterStep, JobIdDep, PageLimit
from app.api.resources import JOB_ERROR_RESPONSES
from mpjobs.contract.jobs import LayersPage

router = APIRouter(prefix="/jobs/{job_id}/layers", tags=["layers"], responses=JOB_ERROR_RESPONSES)


@router.get("", response_model=LayersPage)
async def read_layers(
    job_id: JobIdDep,
    store: StoreDep,
    tenant: TenantDep,
    after: AfterStep = 0,
    limit: PageLimit = 1000,
) -> LayersPage:
    """Layer checks in step order, each once: every layer's gradient and activation numerics at a step.

    The live stream (`GET /jobs/{job_id}/metrics/stream`) carries them too, as `layers` events.
    """
    return await run_in_threadpool(services.layers, store, job_id, tenant, after, limit)
