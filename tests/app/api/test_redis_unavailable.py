"""Every error redis-py raises while Redis starts, loads or fails over is a 503 with Retry-After, on a sync route and an
async one, in the API's one place for it (app/main.py); any other Redis error is still a 500."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi import FastAPI
from redis import exceptions

from app.core.config import Settings
from app.main import create_app

UNAVAILABLE = {
    "closed": exceptions.ConnectionError("Connection closed by server."),
    "loading": exceptions.BusyLoadingError("Redis is loading the dataset in memory"),
    "watching-while-loading": exceptions.WatchError("A BusyLoadingError occurred while watching one or more keys"),
    "timeout": exceptions.TimeoutError("Timeout reading from socket"),
    "replica": exceptions.ReadOnlyError("You can't write against a read only replica."),
    "master-down": exceptions.MasterDownError("Link with MASTER is down and replica-serve-stale-data is set to 'no'."),
    "cluster-down": exceptions.ClusterDownError("The cluster is down"),
    "try-again": exceptions.TryAgainError("Multiple keys request during rehashing of slot"),
}



@pytest.fixture(scope="module")
def app() -> FastAPI:
    """The API's app (its handlers; no Redis is reached) with a sync and an async route that raise the error named."""
    api = create_app(Settings())
    raised = {**UNAVAILABLE, "script-bug": exceptions.ResponseError("ERR Error running script")}

    @api.get("/sync/{name}")
    def sync_route(name: str) -> None:
        raise raised[name]

    @api.get("/async/{name}")
    async def async_route(name: str) -> None:
        raise raised[name]

    return api


def get(app: FastAPI, path: str) -> httpx.Response:
    async def request() -> httpx.Response:
        transport = httpx.ASGITransport(app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
            return await client.get(path)
    return asyncio.run(request())


@pytest.mark.parametrize("route", ["sync", "async"])
@pytest.mark.parametrize("name", sorted(UNAVAILABLE))
def test_redis_unavailable_is_a_503_with_retry_after(app: FastAPI, route: str, name: str) -> None:
    response = get(app, f"/{route}/{name}")
    assert response.status_code == 503
    assert response.headers["retry-after"] == "1"
    assert response.json() == {"detail": "Redis is unreachable, so jobs cannot be read or queued right now: "
                                         f"{UNAVAILABLE[name]}"}


@pytest.mark.parametrize("route", ["sync", "async"])
def test_any_other_redis_error_is_still_a_500(app: FastAPI, route: str) -> None:
    assert get(app, f"/{route}/script-bug").status_code == 500
