"""Builds the FastAPI app. Run with `uvicorn app.main:app`."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import redis
import redis.asyncio
from fastapi import FastAPI, Request, status
from fastapi.responses import JSONResponse

from app.api.routes import health, jobs, metrics
from app.config import Settings, get_settings
from app.errors import JobNotFound, MpjobsError, ServiceUnavailable
from app.store import JobStore

log = logging.getLogger("mpjobs.api")

_STATUS: dict[type[MpjobsError], int] = {
    JobNotFound: status.HTTP_404_NOT_FOUND,
    ServiceUnavailable: status.HTTP_503_SERVICE_UNAVAILABLE,
}


def _status_of(exc: MpjobsError) -> int:
    for kind in type(exc).__mro__:
        if kind in _STATUS:
            return _STATUS[kind]
    return status.HTTP_500_INTERNAL_SERVER_ERROR


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.settings = settings
        app.state.redis = redis.Redis.from_url(settings.redis_url, decode_responses=True,
                                               socket_timeout=5, socket_connect_timeout=2)
        app.state.rq_redis = redis.Redis.from_url(settings.redis_url, socket_timeout=5, socket_connect_timeout=2)
        app.state.aredis = redis.asyncio.Redis.from_url(settings.redis_url, decode_responses=True,
                                                        socket_connect_timeout=2)
        app.state.store = JobStore(app.state.redis)
        yield
        app.state.redis.close()
        app.state.rq_redis.close()
        await app.state.aredis.aclose()

    app = FastAPI(title="mpjobs", version="0.1.0", lifespan=lifespan,
                  description="Mixed-precision training jobs, with every step's numerics visible.")
    app.include_router(health.router)
    app.include_router(jobs.router)
    app.include_router(metrics.router)

    @app.exception_handler(MpjobsError)
    async def domain_error(request: Request, exc: MpjobsError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=_status_of(exc))

    async def redis_down(request: Request, exc: Exception) -> JSONResponse:
        log.warning("redis unavailable: %s", exc)
        return await domain_error(request, ServiceUnavailable(str(exc) or type(exc).__name__))

    # Only an unreachable Redis is a 503; any other Redis error is our bug, a 500.
    app.add_exception_handler(redis.ConnectionError, redis_down)
    app.add_exception_handler(redis.TimeoutError, redis_down)

    return app


app = create_app()
