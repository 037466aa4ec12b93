"""The API-throughput baseline: a bare FastAPI app whose one route does one Redis GET.

Like for like with `app.main:app`: the same redis-py client options, created in
a lifespan and held on `app.state`, and a sync route, so a request takes the
same path through Starlette's threadpool as `GET /jobs/{id}`. `/aget` is the
async variant (redis.asyncio, no threadpool), reported beside it for scale.

    REDIS_URL=redis://127.0.0.1:6379/0 uvicorn bench.baseline_app:app --log-level warning --no-access-log
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import redis
import redis.asyncio
from fastapi import FastAPI, Request

KEY = "bench:baseline"
"""The key `/get` reads; the bench sets it before loading."""


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    url = os.environ.get("REDIS_URL", "redis://localhost:6379/0")
    app.state.redis = redis.Redis.from_url(url, decode_responses=True, socket_timeout=5, socket_connect_timeout=2)
    app.state.aredis = redis.asyncio.Redis.from_url(url, decode_responses=True, socket_connect_timeout=2)
    yield
    app.state.redis.close()
    await app.state.aredis.aclose()


app = FastAPI(lifespan=lifespan)


@app.get("/get")
def get(request: Request) -> dict[str, str | None]:
    return {"value": request.app.state.redis.get(KEY)}


@app.get("/aget")
async def aget(request: Request) -> dict[str, str | None]:
    return {"value": await request.app.state.aredis.get(KEY)}
