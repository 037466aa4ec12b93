from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from redis import Redis

from app.config import Settings
from app.store import JobStore


def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def get_rq_redis(request: Request) -> Redis:
    """RQ's connection: raw bytes (RQ stores pickles), unlike the store's decoded one."""
    redis: Redis = request.app.state.rq_redis
    return redis


def get_store(request: Request) -> JobStore:
    store: JobStore = request.app.state.store
    return store


SettingsDep = Annotated[Settings, Depends(get_settings)]
RQRedisDep = Annotated[Redis, Depends(get_rq_redis)]
StoreDep = Annotated[JobStore, Depends(get_store)]
