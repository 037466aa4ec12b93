"""Routes of a job's metrics: pages of steps, bucketed views, and the live Server-Sent Events stream."""

from __future__ import annotations

from functools import partial
from typing import Annotated

from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse

from app.api import services
from app.api.deps import StoreDep, TenantDep
from app.api.resources import JOB_ERROR_RESPONSES
from app.api.sse import stream_job
from app.core.job import MetricsBuckets, MetricsPage

router = APIRouter(prefix="/jobs/{job_id}/metrics", tags=["metrics"], responses=JOB_ERROR_RESPONSES)


@router.get("", response_model=MetricsPage | MetricsBuckets)
async def read_metrics(
    job_id: str,
    store: StoreDep,
    tenant: TenantDep,
    after: Annotated[int, Query(ge=0, description="return steps after this one")] = 0,
    limit: Annotated[int, Query(ge=1, description=f"capped at {services.MAX_PAGE}")] = 1000,
    max_points: Annotated[int | None, Query(ge=1, le=10_000, description="bucket the whole run")] = None,
) -> MetricsPage | Response:
    """Step records in step order, each once; or, with `max_points`, min/mean/max buckets over the whole run."""
    if max_points is not None:
        body = await run_in_threadpool(services.buckets_json, store, job_id, tenant, max_points)
        return Response(body, media_type="application/json")  # already a MetricsBuckets, as JSON
    return await run_in_threadpool(services.metrics, store, job_id, tenant, after, limit)


@router.get("/stream", response_class=StreamingResponse)
async def stream_metrics(
    job_id: str,
    request: Request,
    store: StoreDep,
    tenant: TenantDep,
    after: Annotated[int | None, Query(ge=0)] = None,
    last_event_id: Annotated[str | None, Header()] = None,
) -> StreamingResponse:
    """Server-Sent Events: `metrics` (id = step), `layers`, `state`, and `end` once the job is terminal.

    `layers` carries a layer check (as in `GET /jobs/{job_id}/layers`) and has no id: ids are steps, for
    `Last-Event-ID`. A check comes just before the `metrics` event of its step, so a resume after step N
    (`Last-Event-ID: N`, or `after=N`) sends the checks after step N and misses none; a connection cut
    between a check and its step's `metrics` event sends that check again (tell them apart by `step`).
    """
    await run_in_threadpool(services.get, store, job_id, tenant)
    start = int(last_event_id) if last_event_id and last_event_id.isdigit() else (after or 0)
    return StreamingResponse(
        stream_job(request.app.state.aredis, job_id, start, request.is_disconnected,
                   archived=partial(run_in_threadpool, store.archived_history, job_id)),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
