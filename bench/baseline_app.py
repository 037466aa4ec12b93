"""The API-throughput baselines: a bare FastAPI app whose routes do one Redis GET, and the metrics page as
the API served it before.

Like for like with `app.main:app`: the same redis-py client options, created in a lifespan and held on
`app.state`, and the same uvicorn options. `/aget` does its GET on redis.asyncio with no threadpool hop:
the real limit of FastAPI + Redis, and the baseline of `GET /jobs/{id}`. `/get` is its sync twin, through
Starlette's threadpool. `/page/{id}` is the validated metrics page, the baseline of today's pages. `/sink`
reads a request body as a stream and drops it: the floor of an upload (bench/upload.py).

    REDIS_URL=redis://127.0.0.1:6379/0 uvicorn bench.baseline_app:app --log-level warning --no-access-log
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import redis
import redis.asyncio
from fastapi import FastAPI, HTTPException, Request

from app.store import JobStore
from mpjobs.contract.jobs import MetricsPage

KEY = "bench:baseline"
"""The key `/get` reads; the bench sets it before loading."""


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    url = os.environ.get("REDIS_URL", "redis://localhost:6379/0")
    app.state.redis = redis.Redis.from_url(url, decode_responses=True, socket_timeout=5, socket_connect_timeout=2)
    app.state.aredis = redis.asyncio.Redis.from_url(url, decode_responses=True, socket_connect_timeout=2)
    app.state.store = JobStore(app.state.redis, Path(os.environ["ARTIFACTS_DIR"]))
    yield
    app.state.redis.close()
    await app.state.aredis.aclose()


app = FastAPI(lifespan=lifespan)


@app.get("/get")
def get(request: Request) -> dict[str, str | None]:
    return {"value": request.app.state.redis.get(KEY)}


@app.get("/page/{job_id}", response_model=MetricsPage)
def page(request: Request, job_id: str, after: int = 0, limit: int = 1000) -> MetricsPage:
    """A metrics page as the API served it before pages were assembled from the stored records: the job
    read and built, each record parsed and validated, the page dumped by the response model, in a thread."""
    store: JobStore = request.app.state.store
    if store.jobs.get(job_id) is None:
        raise HTTPException(404, f"No job with id {job_id!r}.")
    return store.history.read_metrics(job_id, after, limit)


@app.get("/aget")
async def aget(request: Request) -> dict[str, str | None]:
    return {"value": await request.app.state.aredis.get(KEY)}


@app.post("/sink")
async def sink(request: Request) -> dict[str, int]:
    """The upload benchmark's floor (bench/upload.py): the body read as a stream and dropped, nothing else."""
    received = 0
    async for chunk in request.stream():
        received += len(chunk)
    return {"bytes": received}
