"""What the API returns besides a job: pages, comparison reports, errors and health."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from mpjobs.contract.comparisons import ComparisonPage as ComparisonPage

# Defined in the core, where the Python client (mpjobs/) reads them too; named here with the API's other answers.
from mpjobs.contract.comparisons import ComparisonReport as ComparisonReport
from mpjobs.contract.comparisons import VariantResult as VariantResult
from mpjobs.contract.jobs import JobPage as JobPage


class ErrorBody(BaseModel):
    detail: str


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorBody, "description": "API keys are configured and this request has no valid one"},
    503: {"model": ErrorBody, "description": "Redis is unreachable"},
}


REDIS_FULL: dict[int | str, dict[str, Any]] = {
    503: {"model": ErrorBody, "description": "Redis is unreachable, or past its memory high-water mark "
                                             "(REDIS_MEMORY_HIGH_WATER): nothing was written"},
    415: {"model": ErrorBody, "description": "The body was not sent as JSON (Content-Type: application/json)"},
}
"""The answers of a route that queues work: besides a bad body's 422, a full Redis and a body not sent as JSON."""


JOB_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    **ERROR_RESPONSES,
    404: {"model": ErrorBody, "description": "No such job (or another tenant's)"},
}


class RedisMemory(BaseModel):
    """Redis's memory use (its INFO memory), and whether new jobs are taken at that use."""

    used_memory_bytes: int
    maxmemory_bytes: int
    """Redis's `maxmemory`; 0: no limit."""
    used_fraction: float | None
    """used_memory / maxmemory; null without a limit."""
    high_water: float
    """REDIS_MEMORY_HIGH_WATER: past this share of maxmemory, `POST /jobs` and `POST /comparisons` get 503."""
    accepting_jobs: bool


class Health(BaseModel):
    status: str
    redis: str | None = None
    workers: dict[str, int] | None = None
    redis_memory: RedisMemory | None = None
