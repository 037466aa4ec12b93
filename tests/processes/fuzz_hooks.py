"""schemathesis hooks that mix the hostile inputs of tests/processes/hostile.py into its generated cases.

tests/processes/test_fuzz.py loads them (SCHEMATHESIS_HOOKS). Every other case gets hostile values in
place of generated ones, taking each list in turn: a path id (a job's other Redis keys, `job:{id}:events`),
an integer query parameter (10**30, 5,000 digits, '²'), a Last-Event-ID, a body (NaN, 1e400, lone
surrogates, "10" for a number, a 1,500-layer keras_json). No schema can express them, so schemathesis
alone never sends them; its checks (no 5xx, declared status codes, schemas and content types) then
apply to these cases as to any other.
"""

from __future__ import annotations

import itertools
from typing import Any

import schemathesis

from tests.processes import hostile

IDS = hostile.malformed_ids(hostile.WELL_FORMED_ID)
INTEGERS = sorted({value for _, _, value in hostile.INTEGERS})
LAST_EVENT_IDS = [value.decode("latin-1") for value in hostile.LAST_EVENT_IDS]  # a header is Latin-1
BODIES = sorted(hostile.BODIES)

_cases = itertools.count()


def _pick(values: list[Any], turn: int) -> Any:
    return values[turn % len(values)]


@schemathesis.hook
def map_case(context: Any, case: Any) -> Any:
    number = next(_cases)
    if number % 2:
        return case
    turn = number // 2
    for name in case.path_parameters:
        case.path_parameters[name] = _pick(IDS, turn)
    integers = [name for name in case.query if name in ("after", "limit", "cursor", "max_points")]
    if integers:
        case.query[_pick(integers, turn)] = _pick(INTEGERS, turn)
    if case.path.endswith("/stream"):
        case.headers["Last-Event-ID"] = _pick(LAST_EVENT_IDS, turn)
    if case.method.upper() == "POST" and case.path in ("/jobs", "/comparisons"):
        body = _pick(BODIES, turn)
        case.body = hostile.job_body(body) if case.path == "/jobs" else hostile.comparison_body(body)
        case.media_type = "application/json"
    return case
