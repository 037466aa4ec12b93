"""What a route depends on: the store, the RQ connection, settings, Redis's memory and the caller's tenant."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request
from redis import Redis

from app.api.auth import tenant_for
from app.api.redis_memory import MemoryGauge
from app.api.services import LiveWorkers
from app.core.config import Settings
from app.store import JobStore


async def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


async def get_rq_redis(request: Request) -> Redis:
    """RQ's connection: raw bytes (RQ stores pickles), unlike the store's decoded one."""
    redis: Redis = request.app.state.rq_redis
    return redis


async def get_live_workers(request: Request) -> LiveWorkers:
    workers: LiveWorkers = request.app.state.live_workers
    return workers


async def get_memory(request: Request) -> MemoryGauge:
    memory: MemoryGauge = request.app.state.memory
    return memory


async def get_store(request: Request) -> JobStore:
    store: JobStore = request.app.state.store
    return store


async def get_tenant(request: Request, authorization: Annotated[str | None, Header()] = None) -> str:
    """The caller's tenant from its Bearer key; the open tenant when no keys are set."""
    return tenant_for(request.app.state.api_keys, authorization)


SettingsDep = Annotated[Settings, Depends(get_settings)]
RQRedisDep = Annotated[Redis, Depends(get_rq_redis)]
StoreDep = Annotated[JobStore, Depends(get_store)]
WorkersDep = Annotated[LiveWorkers, Depends(get_live_workers)]
MemoryDep = Annotated[MemoryGauge, Depends(get_memory)]
TenantDep = Annotated[str, Depends(get_tenant)]
