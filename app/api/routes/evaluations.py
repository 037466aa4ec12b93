"""The route of a job's evaluations: the trained model on its held-out rows, every `eval_every` steps, page by page."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.concurrency import run_in_threadpool

from app.api import services
from app.api.deps import StoreDep, TenantDep
from app.api.params import AfterStep, JobIdDep, PageLimit
from app.api.resources import JOB_ERROR_RESPONSES
from mpjobs.contract.jobs import EvaluationsPage

router = APIRouter(prefix="/jobs/{job_id}/evaluations", tags=["evaluations"], responses=JOB_ERROR_RESPONSES)


@router.get("", response_model=EvaluationsPage)
async def read_evaluations(
    job_id: JobIdDep,
    store: StoreDep,
    tenant: TenantDep,
    after: AfterStep = 0,
    limit: PageLimit = 1000,
) -> EvaluationsPage:
    """Evaluations on the held-out rows in step order, each once: loss and `validation.metrics` at a step.

    Empty for a job without `validation`. The final one is also the summary's `validation`.
    """
    return await run_in_threadpool(services.evaluations, store, job_id, tenant, after, limit)
