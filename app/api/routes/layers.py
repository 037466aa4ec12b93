"""The routes of a job's layer checks, page by page, and of the precision plan the first flagged one proposed."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.concurrency import run_in_threadpool

from app.api import services
from app.api.deps import StoreDep, TenantDep
from app.api.params import AfterStep, JobIdDep, PageLimit
from app.api.resources import JOB_ERROR_RESPONSES
from mpjobs.contract.jobs import LayersPage
from mpjobs.contract.plan import PlanView

router = APIRouter(prefix="/jobs/{job_id}/layers", tags=["layers"], responses=JOB_ERROR_RESPONSES)
plan_router = APIRouter(prefix="/jobs/{job_id}/plan", tags=["layers"], responses=JOB_ERROR_RESPONSES)


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


@plan_router.get("", response_model=PlanView)
async def read_plan(job_id: JobIdDep, store: StoreDep, tenant: TenantDep) -> PlanView:
    """The precision plan: which layers to keep in float32, and what loss scale, so that the step of the first
    layer check that found underflow or overflow matches float32; with its search, as a spec fragment and as
    lines of Keras (docs/numerics.md, "Precision plan"). 404 with the reason when there is none."""
    return await run_in_threadpool(services.plan, store, job_id, tenant)
