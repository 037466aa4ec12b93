"""Builds the FastAPI app. Run with `uvicorn app.main:app`."""

from __future__ import annotations

import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import redis
from fastapi import FastAPI, Request, status
from fastapi.concurrency import run_in_threadpool
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.api.auth import parse_api_keys
from app.api.job_views import JobViews
from app.api.limits import BodySizeLimit
from app.api.live_hub import LiveHub
from app.api.page_reads import PageReads
from app.api.redis_memory import MemoryGauge
from app.api.routes import (
    comparisons,
    dashboard,
    datasets,
    evaluations,
    health,
    jobs,
    layers,
    metrics,
    prometheus,
)
from app.api.services import LiveWorkers
from app.api.validation import validation_error
from app.core.config import Settings, get_settings
from app.core.errors import (
    DatasetInUse,
    DatasetNotFound,
    DatasetTooLarge,
    DeleteRefused,
    DomainError,
    IdempotencyConflict,
    JobAlreadyEnded,
    JobNotFound,
    NotAnNpzBody,
    NotAuthenticated,
    RedisFull,
    ServiceUnavailable,
    SpecRefused,
)
from app.store import JobStore
from app.store.connect import UNAVAILABLE, async_client, client

log = logging.getLogger("mpjobs.api")

_STATUS: dict[type[DomainError], int] = {
    JobNotFound: status.HTTP_404_NOT_FOUND,
    NotAuthenticated: status.HTTP_401_UNAUTHORIZED,
    IdempotencyConflict: status.HTTP_409_CONFLICT,
    DeleteRefused: status.HTTP_409_CONFLICT,
    JobAlreadyEnded: status.HTTP_409_CONFLICT,
    ServiceUnavailable: status.HTTP_503_SERVICE_UNAVAILABLE,
    DatasetNotFound: status.HTTP_404_NOT_FOUND,
    DatasetInUse: status.HTTP_409_CONFLICT,
    DatasetTooLarge: status.HTTP_413_CONTENT_TOO_LARGE,
    NotAnNpzBody: status.HTTP_415_UNSUPPORTED_MEDIA_TYPE,
}
REFUSED_WRITES = ("MISCONF", "NOREPLICAS")
"""The error replies of a Redis that refuses writes until its operator acts (disk, replicas)."""
RETRY_AFTER_S = 1
"""The Retry-After of a 503 that passes with time: Redis restarting, loading, failing over, or a key
contended. Not of a full Redis (RedisFull): waiting alone frees nothing there."""


def _status_of(exc: DomainError) -> int:
    for kind in type(exc).__mro__:
        if kind in _STATUS:
            return _STATUS[kind]
    return status.HTTP_500_INTERNAL_SERVER_ERROR


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.settings = settings
        if not app.state.api_keys:
            log.warning("API_KEYS is not set: the API is open to anyone who can reach it. "
                        "Bind it to 127.0.0.1 (the default of `make run`) or set API_KEYS.")
        app.state.redis = client(settings.redis_url, socket_timeout=5)
        app.state.rq_redis = client(settings.redis_url, decode_responses=False, socket_timeout=5)
        app.state.aredis = async_client(settings.redis_url)
        app.state.store = JobStore(app.state.redis, settings.artifacts_dir)
        app.state.live_workers = LiveWorkers(app.state.rq_redis)
        app.state.job_views = JobViews(app.state.aredis, app.state.store, app.state.live_workers)
        app.state.page_reads = PageReads(app.state.aredis, app.state.store)
        app.state.memory = MemoryGauge(app.state.redis, settings.redis_memory_high_water)
        app.state.live = LiveHub(settings.redis_url, settings.stream_queue_events, settings.max_streams,
                                 settings.stream_read_connections)
        # Everything imported and built so far lives as long as the process: keep it out of
        # the collector's generations, so a full collection does not walk it mid-request.
        gc.freeze()
        yield
        app.state.redis.close()
        app.state.rq_redis.close()
        await app.state.aredis.aclose()
        await app.state.live.aclose()

    app = FastAPI(title="mpjobs", version="0.1.0", lifespan=lifespan,
                  description="Mixed-precision training jobs, with every step's numerics visible.")
    app.state.api_keys = parse_api_keys(settings.api_keys)
    app.add_middleware(BodySizeLimit, streamed=frozenset({datasets.UPLOAD_PATH}))
    app.include_router(health.router)
    app.include_router(jobs.router)
    app.include_router(metrics.router)
    app.include_router(metrics.export_router)
    app.include_router(layers.router)
    app.include_router(layers.plan_router)
    app.include_router(evaluations.router)
    app.include_router(comparisons.router)
    app.include_router(datasets.router)
    app.include_router(prometheus.router)
    app.include_router(dashboard.router)
    app.mount("/static", dashboard.static_files, name="static")

    @app.exception_handler(DomainError)
    async def domain_error(request: Request, exc: DomainError) -> JSONResponse:
        code = _status_of(exc)
        headers = {"WWW-Authenticate": "Bearer"} if code == status.HTTP_401_UNAUTHORIZED else None
        if isinstance(exc, ServiceUnavailable) and not isinstance(exc, RedisFull):
            headers = {"Retry-After": str(getattr(exc, "retry_after_s", RETRY_AFTER_S))}
        body = {"detail": str(exc), **({"state": exc.state} if isinstance(exc, JobAlreadyEnded) else {})}
        return JSONResponse(body, status_code=code, headers=headers)

    @app.exception_handler(SpecRefused)
    async def refused(request: Request, exc: SpecRefused) -> JSONResponse:
        # The shape of a validation error: a client handles a deployment limit like a bad field.
        detail = [{"type": exc.error_type, "loc": ["body", *exc.loc], "msg": exc.message}]
        return JSONResponse({"detail": detail}, status_code=status.HTTP_422_UNPROCESSABLE_CONTENT)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        # FastAPI answers 400 when the JSON parser itself fails (nesting too deep for it);
        # to a client that is malformed JSON like any other: 422.
        if exc.status_code == status.HTTP_400_BAD_REQUEST and exc.detail == "There was an error parsing the body":
            detail = [{"type": "json_invalid", "loc": ["body"], "msg": "The body is not JSON that can be parsed."}]
            return JSONResponse({"detail": detail}, status_code=status.HTTP_422_UNPROCESSABLE_CONTENT)
        return await http_exception_handler(request, exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        # What a body, query or header failed on, echoed in strict JSON even when it held NaN or "\ud800".
        return validation_error(exc, request.headers.get("content-type"))

    async def redis_down(request: Request, exc: Exception) -> JSONResponse:
        log.warning("redis unavailable: %s", exc)
        return await domain_error(request, ServiceUnavailable(str(exc) or type(exc).__name__))

    async def redis_refused(request: Request, exc: Exception) -> JSONResponse:
        # MISCONF (Redis cannot write its snapshot or AOF to disk) and NOREPLICAS (too few replicas acknowledge)
        # refuse every write until an operator acts: a 503 that says so, with no Retry-After, as for a full
        # Redis. Any other error reply is our bug, raised on to be a 500.
        if not str(exc).startswith(REFUSED_WRITES):
            raise exc
        log.error("redis refuses writes: %s", exc)
        return JSONResponse({"detail": f"Redis refuses writes until its operator acts: {exc}"},
                            status_code=status.HTTP_503_SERVICE_UNAVAILABLE)

    async def redis_full(request: Request, exc: Exception) -> JSONResponse:
        log.warning("redis refused a write as out of memory: %s", exc)
        return await domain_error(request, await run_in_threadpool(request.app.state.memory.refused))

    # A Redis starting, loading, failing over (UNAVAILABLE: app/store/connect.py) or full is a 503, an answer
    # that keeps the client's connection open; any other Redis error is our bug, a 500. A WatchError that
    # gets here is redis-py's wrapping of one of those met inside a WATCH ("A BusyLoadingError occurred
    # while watching one or more keys"): an EXEC's real race is retried by the store (idempotency.py).
    # A full Redis refuses a MULTI/EXEC whole (EXECABORT), so a create it refuses has written nothing.
    for unavailable in (*UNAVAILABLE, redis.WatchError):
        app.add_exception_handler(unavailable, redis_down)
    app.add_exception_handler(redis.exceptions.OutOfMemoryError, redis_full)
    app.add_exception_handler(redis.ResponseError, redis_refused)

    return app


app = create_app()
