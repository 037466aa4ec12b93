"""What a route reads from its path, query and headers, each checked before any Redis key or command is built of it.

A path id that is not a record id as the store makes them (app/store/ids.py: a uuid4 hex) is answered 404
like a missing job or another tenant's: `job:{id}` with id `x:events` would name another record's key. An
integer parameter is decimal ASCII digits inside its declared range, or a 422 naming it and the range: a
step up to TrainingSpec's most steps, a Redis integer (a creation sequence) up to 2**63 - 1. A page `limit` is
bounded the same way; a page holds at most MAX_PAGE whatever the limit asks.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from fastapi import Depends, Header, Path, Query
from pydantic import BeforeValidator

from app.api.deps import TenantDep
from app.api.services import MAX_PAGE
from app.core.errors import ComparisonNotFound, JobNotFound
from app.store.ids import is_record_id
from mpjobs.contract.training_spec import MAX_STEPS

MAX_INT64 = 2**63 - 1
"""Redis's largest integer: the most a creation sequence (`cursor`) can reach, and the largest `limit`."""
_DECIMAL = re.compile(r"-?[0-9]{1,20}")
"""At most 20 ASCII digits: int() also takes '١' and '1_0', and more than 4,300 digits makes it raise."""

ID_DESCRIPTION = "32 lowercase hex digits; any other id is answered 404, like an unknown one"


def whole_number(name: str, low: int, high: int) -> BeforeValidator:
    """The check of an integer parameter, run on its text before pydantic parses it; its `Query` or
    `Header` states the same range (`ge`, `le`) for OpenAPI."""

    def check(value: Any) -> Any:
        text = value.strip() if isinstance(value, str) else None
        if text is not None and (not _DECIMAL.fullmatch(text) or not low <= int(text) <= high):
            shown = value if len(value) <= 40 else f"{value[:40]}... ({len(value)} characters)"
            raise ValueError(f"Expected {name} to be a whole number from {low} to {high}. Received: {name}={shown!r}")
        return value

    return BeforeValidator(check)


async def get_job_id(job_id: Annotated[str, Path(description=ID_DESCRIPTION)], tenant: TenantDep) -> str:
    """The job id in the path. It depends on the tenant so that a request without a valid key is 401 first."""
    if not is_record_id(job_id):
        raise JobNotFound(job_id)
    return job_id


async def get_comparison_id(comparison_id: Annotated[str, Path(description=ID_DESCRIPTION)],
                            tenant: TenantDep) -> str:
    if not is_record_id(comparison_id):
        raise ComparisonNotFound(comparison_id)
    return comparison_id


JobIdDep = Annotated[str, Depends(get_job_id)]
ComparisonIdDep = Annotated[str, Depends(get_comparison_id)]

AfterStep = Annotated[int, Query(ge=0, le=MAX_STEPS, description="return what comes after this step"),
                      whole_number("after", 0, MAX_STEPS)]
ResumeAfterStep = Annotated[int | None, Query(ge=0, le=MAX_STEPS, description="resume after this step"),
                            whole_number("after", 0, MAX_STEPS)]
LastEventId = Annotated[int | None, Header(ge=0, le=MAX_STEPS, description="the last step seen: resume after it"),
                        whole_number("Last-Event-ID", 0, MAX_STEPS)]
PageLimit = Annotated[int, Query(ge=1, le=MAX_INT64, description=f"a page holds at most {MAX_PAGE}"),
                      whole_number("limit", 1, MAX_INT64)]
JobPageLimit = Annotated[int, Query(ge=1, le=200), whole_number("limit", 1, 200)]
ComparisonPageLimit = Annotated[int, Query(ge=1, le=100), whole_number("limit", 1, 100)]
Cursor = Annotated[int | None, Query(ge=0, le=MAX_INT64, description="next_cursor of the previous page"),
                   whole_number("cursor", 0, MAX_INT64)]
