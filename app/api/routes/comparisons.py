"""Routes of /comparisons: create, list, read with its verdict, cancel."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Query, Response, status
from fastapi.concurrency import run_in_threadpool

from app.api import services
from app.api.admission import admit_comparison
from app.api.deps import RQRedisDep, SettingsDep, StoreDep, TenantDep
from app.api.resources import ERROR_RESPONSES, Comparison, ComparisonPage, ErrorBody
from app.core.spec import ComparisonSpec

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


@router.post("", status_code=status.HTTP_201_CREATED, response_model=Comparison)
async def submit_comparison(spec: Annotated[ComparisonSpec, Body(openapi_examples=EXAMPLES)], store: StoreDep,
                      redis: RQRedisDep, tenant: TenantDep, settings: SettingsDep,
                      response: Response) -> Comparison:
    """Run the spec once per precision variant, same seed and data, and compare each with float32.
    A variant over this deployment's limits (MAX_JOB_SECONDS, MAX_MODEL_BYTES) refuses it whole: 422."""
    admit_comparison(spec, settings)
    comparison = await run_in_threadpool(services.submit_comparison, store, redis, spec, tenant)
    response.headers["Location"] = f"/comparisons/{comparison.id}"
    return comparison


@router.get("", response_model=ComparisonPage)
async def list_comparisons(
    store: StoreDep, tenant: TenantDep, limit: Annotated[int, Query(ge=1, le=100)] = 20,
    cursor: Annotated[int | None, Query(ge=0, description="next_cursor of the previous page")] = None,
) -> ComparisonPage:
    return await run_in_threadpool(services.list_comparisons, store, tenant, limit, cursor)


@router.get("/{comparison_id}", response_model=Comparison, responses=NOT_FOUND)
async def get_comparison(comparison_id: str, store: StoreDep, tenant: TenantDep) -> Comparison:
    """Per variant: final loss and its gap to float32, its run's throughput, its step time against
    float32's (all variants timed in turns by the baseline job, with quartiles), skips, zero gradients,
    diagnoses; then the verdict in words."""
    return await run_in_threadpool(services.get_comparison, store, comparison_id, tenant)


@router.delete("/{comparison_id}", status_code=status.HTTP_202_ACCEPTED, response_model=Comparison,
               responses=NOT_FOUND)
async def cancel_comparison(comparison_id: str, store: StoreDep, redis: RQRedisDep, tenant: TenantDep) -> Comparison:
    return await run_in_threadpool(services.cancel_comparison, store, redis, comparison_id, tenant)
