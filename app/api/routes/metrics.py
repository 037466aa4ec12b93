"""Routes of a job's metrics: pages of steps, bucketed views, and the live Server-Sent Events stream."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse

from app.api import services
from app.api.deps import StoreDep, TenantDep
from app.api.live_hub import LiveHub
from app.api.params import AfterStep, JobIdDep, LastEventId, PageLimit, ResumeAfterStep, whole_number
from app.api.resources import JOB_ERROR_RESPONSES
from app.api.sse import LiveStream, stream_job
from app.core.errors import JobNotFound, TooManyStreams
from app.store.archive import ArchivedHistory, ArchiveInfo
from app.store.export import csv_chunks
from app.store.live_reads import job_head
from mpjobs.contract.jobs import MetricsBuckets, MetricsPage

router = APIRouter(prefix="/jobs/{job_id}/metrics", tags=["metrics"], responses=JOB_ERROR_RESPONSES)
export_router = APIRouter(prefix="/jobs/{job_id}", tags=["metrics"], responses=JOB_ERROR_RESPONSES)
MAX_POINTS = 10_000
"""The most buckets a `max_points` view has."""


@router.get("", response_model=MetricsPage | MetricsBuckets)
async def read_metrics(
    job_id: JobIdDep,
    request: Request,
    store: StoreDep,
    tenant: TenantDep,
    after: AfterStep = 0,
    limit: PageLimit = 1000,
    max_points: Annotated[int | None, Query(ge=1, le=MAX_POINTS, description="bucket the whole run"),
                          whole_number("max_points", 1, MAX_POINTS)] = None,
) -> MetricsPage | Response:
    """Step records in step order, each once; or, with `max_points`, min/mean/max buckets over the whole run."""
    if max_points is not None:
        body = await run_in_threadpool(services.buckets_json, store, job_id, tenant, max_points)
        return Response(body, media_type="application/json")  # already a MetricsBuckets, as JSON
    page = await request.app.state.page_reads.page(job_id, tenant, after, min(limit, services.MAX_PAGE))
    return Response(page.json(job_id), media_type="application/json")  # a MetricsPage, from the stored records


@export_router.get("/metrics.csv", response_class=StreamingResponse,
                   responses={200: {"content": {"text/csv": {}}, "description": "A header row, then a row per step"}})
async def export_metrics(job_id: JobIdDep, store: StoreDep, tenant: TenantDep) -> StreamingResponse:
    """Every stored step record as CSV, in one streamed response: a header row of the record's fields, then
    a row per step in step order (null is an empty cell, booleans true/false). A running job's export holds
    the steps stored when each chunk was read."""
    await run_in_threadpool(services.get, store, job_id, tenant)
    return StreamingResponse(csv_chunks(store.history, job_id), media_type="text/csv; charset=utf-8",
                             headers={"Content-Disposition": f'attachment; filename="{job_id}-metrics.csv"'})


@router.get("/stream", response_class=StreamingResponse)
async def stream_metrics(
    job_id: JobIdDep,
    request: Request,
    store: StoreDep,
    tenant: TenantDep,
    after: ResumeAfterStep = None,
    last_event_id: LastEventId = None,
) -> StreamingResponse:
    """Server-Sent Events: `metrics` (id = step), `layers`, `state`, and `end` once the job is terminal.

    `layers` carries a layer check (as in `GET /jobs/{job_id}/layers`) and has no id: ids are steps, for
    `Last-Event-ID`. A check comes just before the `metrics` event of its step, so a resume after step N
    (`Last-Event-ID: N`, or `after=N`) sends the checks after step N and misses none; a connection cut
    between a check and its step's `metrics` event sends that check again (tell them apart by `step`).
    `Last-Event-ID` and `after` are steps, 0 to 10,000,000: anything else is a 422 naming it.

    A stream that cannot go on ends with an `error` event, `{"reason", "detail"}`: `too_slow` (this client fell
    STREAM_QUEUE_EVENTS behind), `redis_unavailable` or `internal_error`; resume with
    `Last-Event-ID`. Past MAX_STREAMS open streams in this process: 503 with Retry-After, before any body.
    """
    live: LiveHub = request.app.state.live
    if not live.admit():
        raise TooManyStreams(live.max_streams)
    try:
        head = await job_head(live.lane, job_id)
        if head.state is None or head.tenant != tenant:
            raise JobNotFound(job_id)
    except BaseException:
        live.release()
        raise
    start = last_event_id if last_event_id is not None else (after or 0)

    async def archives(info: ArchiveInfo) -> ArchivedHistory:
        return await run_in_threadpool(store.history.open_archive, job_id, info)

    return LiveStream(stream_job(live, archives, job_id, start, head), live.release)
