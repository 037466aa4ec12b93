"""Routes of /comparisons: create, list, read with its verdict, cancel or delete with its jobs."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Header, Query, Response, status
from fastapi.concurrency import run_in_threadpool

from app.api import services
from app.api.admission import admit_comparison
from app.api.dataset_fit import check_comparison
from app.api.deletion import purge_comparison
from app.api.deps import MemoryDep, RQRedisDep, SettingsDep, StoreDep, TenantDep
from app.api.params import ComparisonIdDep, ComparisonPageLimit, Cursor
from app.api.resources import ERROR_RESPONSES, REDIS_FULL, ComparisonPage, ComparisonReport, ErrorBody
from mpjobs.contract.spec import ComparisonSpec

router = APIRouter(prefix="/comparisons", tags=["comparisons"], responses=ERROR_RESPONSES)
NOT_FOUND: dict[int | str, dict[str, Any]] = {
    404: {"model": ErrorBody, "description": "No such comparison (or another tenant's)"},
}

EXAMPLES = {
    "default": {
        "summary": "mlp: float32, mixed_float16 + dynamic, mixed_float16 + none, mixed_bfloat16",
        "value": {"spec": {"model": {"name": "mlp"}, "training": {"steps": 200}}},
    },
    "underflow": {
        "summary": "The zero-gradient model: does float16 need loss scaling?",
        "value": {"name": "unet underflow", "spec": {"model": {"name": "conv3d_unet"}, "training": {"steps": 20}},
                  "variants": [{"precision_policy": "float32"},
                               {"precision_policy": "mixed_float16", "loss_scale": "none"},
                               {"precision_policy": "mixed_float16", "loss_scale": {"mode": "fixed", "scale": 1024}},
                               {"precision_policy": "mixed_float16", "loss_scale": "dynamic"}]},
    },
}


@router.post("", status_code=status.HTTP_201_CREATED, response_model=ComparisonReport,
             responses={**REDIS_FULL,
                        200: {"model": ComparisonReport, "description": "The comparison an earlier request with this "
                                                                 "Idempotency-Key created"},
                        409: {"model": ErrorBody, "description": "Idempotency-Key reused with a different spec"}})
async def submit_comparison(
    spec: Annotated[ComparisonSpec, Body(openapi_examples=EXAMPLES)], store: StoreDep, redis: RQRedisDep,
    tenant: TenantDep, memory: MemoryDep, settings: SettingsDep, response: Response,
    idempotency_key: Annotated[str | None, Header(min_length=1, max_length=200)] = None,
) -> ComparisonReport:
    """Run the spec once per precision variant, same seed and data, and compare each with float32.
    A variant over this deployment's limits (MAX_JOB_SECONDS, MAX_MODEL_BYTES) refuses it whole: 422."""
    admit_comparison(spec, settings)
    await run_in_threadpool(check_comparison, spec, store, settings, tenant)
    await run_in_threadpool(memory.require_room)
    comparison, created = await run_in_threadpool(services.submit_comparison, store, redis, spec, tenant,
                                                  idempotency_key)
    response.headers["Location"] = f"/comparisons/{comparison.id}"
    if not created:
        response.status_code = status.HTTP_200_OK
    return comparison


@router.get("", response_model=ComparisonPage)
async def list_comparisons(
    store: StoreDep, tenant: TenantDep, limit: ComparisonPageLimit = 20, cursor: Cursor = None,
) -> ComparisonPage:
    return await run_in_threadpool(services.list_comparisons, store, tenant, limit, cursor)


@router.get("/{comparison_id}", response_model=ComparisonReport, responses=NOT_FOUND)
async def get_comparison(comparison_id: ComparisonIdDep, store: StoreDep, tenant: TenantDep) -> ComparisonReport:
    """Per variant: final loss and its gap to float32, its run's throughput, its step time against
    float32's (all variants timed in turns by the baseline job, with 95% intervals), skips, zero gradients,
    diagnoses; then the verdict in words."""
    return await run_in_threadpool(services.get_comparison, store, comparison_id, tenant)


@router.delete("/{comparison_id}", status_code=status.HTTP_202_ACCEPTED, response_model=ComparisonReport, responses={
    **NOT_FOUND, 204: {"description": "purge=true: the comparison and all its jobs are deleted for good"},
    409: {"model": ErrorBody, "description": "purge=true while a job of it has not ended: nothing was deleted"},
})
async def cancel_comparison(
    comparison_id: ComparisonIdDep, store: StoreDep, redis: RQRedisDep, tenant: TenantDep, settings: SettingsDep,
    purge: Annotated[bool, Query(description="Delete the comparison and all its jobs for good "
                                  "instead of canceling; every job must have ended (204)")] = False,
) -> ComparisonReport | Response:
    """Cancel every job of the comparison (202). With `purge=true`, delete it and its jobs for good (204)."""
    if purge:
        await run_in_threadpool(purge_comparison, store, redis, settings, comparison_id, tenant)
        return Response(status_code=status.HTTP_204_NO_CONTENT)
    return await run_in_threadpool(services.cancel_comparison, store, redis, comparison_id, tenant)
