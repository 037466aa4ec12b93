"""Routes of /healthz and /readyz: the process is up; Redis and workers are reachable."""

from __future__ import annotations

from fastapi import APIRouter, Response, status
from fastapi.concurrency import run_in_threadpool

from app.api import services
from app.api.deps import MemoryDep, RQRedisDep, TenantDep, WorkersDep
from app.api.resources import ERROR_RESPONSES, ErrorBody, Health

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health)
async def healthz() -> Health:
    """Liveness: the API process answers."""
    return Health(status="ok")


@router.get("/readyz", response_model=Health, responses={
    **ERROR_RESPONSES, 503: {"model": Health | ErrorBody, "description": "No workers, or Redis unreachable"},
})
async def readyz(redis: RQRedisDep, workers: WorkersDep, memory: MemoryDep, response: Response,
                 tenant: TenantDep) -> Health:
    """Readiness: Redis answers, and live workers per queue. `redis_memory` reports Redis's memory use
    against its maxmemory, and whether new jobs are taken at it."""
    health = await run_in_threadpool(services.readiness, redis, workers, memory)
    if health.status != "ok":
        response.status_code = status.HTTP_503_SERVICE_UNAVAILABLE
    return health
