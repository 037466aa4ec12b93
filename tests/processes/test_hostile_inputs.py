"""No input gets a 500: each hostile body, path id and integer (tests/processes/hostile.py) sent to a real
API, answered with the exact status and a body in strict JSON, writing nothing.

Its own Redis and API with two tenants' keys, and no worker: jobs stay queued, nothing trains.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from scripts.stack import Stack, private_stack
from tests.processes import hostile
from tests.processes.test_fuzz import server_errors

A = {"Authorization": "Bearer key-a"}
B = {"Authorization": "Bearer key-b"}
JSON = {"content-type": "application/json"}
SPEC = {"model": {"name": "mlp"}, "training": {"steps": 2}}


def _no_constant(token: str) -> Any:
    raise AssertionError(f"the body holds {token}, which strict JSON has not")


def strict_json(response: httpx.Response) -> Any:
    """The body, failing the test unless it is UTF-8 JSON without NaN or Infinity."""
    return json.loads(response.content.decode("utf-8"), parse_constant=_no_constant)


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with private_stack(tmp_path_factory.mktemp("hostile"), workers=0,
                       API_KEYS="key-a:tenant-a,key-b:tenant-b") as stack:
        yield stack


@pytest.fixture(scope="module")
def client(api: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=api.base_url, headers=A, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def job_id(client: httpx.Client) -> str:
    """Tenant a's job, queued (no worker takes it)."""
    created = client.post("/jobs", json=SPEC)
    assert created.status_code == 201, created.text
    return str(created.json()["id"])


@pytest.fixture(scope="module")
def comparison_id(client: httpx.Client) -> str:
    created = client.post("/comparisons", json={"spec": SPEC, "variants": [
        {"precision_policy": "float32"}, {"precision_policy": "mixed_bfloat16"}]})
    assert created.status_code == 201, created.text
    return str(created.json()["id"])


def writes(api: Stack) -> tuple[object, ...]:
    r = api.redis.client()
    return r.get("mpjobs:seq"), r.zcard("mpjobs:jobs:tenant-a"), r.zcard("mpjobs:cmps:tenant-a"), r.llen("rq:queue:any")


@pytest.mark.parametrize("name", list(hostile.BODIES))
def test_a_hostile_body_is_a_422_in_strict_json_naming_the_field_and_writes_nothing(
        api: Stack, client: httpx.Client, name: str) -> None:
    _, loc = hostile.BODIES[name]
    before = writes(api)
    for path, body, where in [("/jobs", hostile.job_body(name), ["body", *loc]),
                              ("/comparisons", hostile.comparison_body(name), ["body", "spec", *loc])]:
        response = client.post(path, content=body, headers=JSON)
        assert response.status_code == 422, (path, response.text[:500])
        assert [error["loc"] for error in strict_json(response)["detail"]] == [where], path
    assert writes(api) == before


def test_invalid_utf8_in_a_body_is_a_422(client: httpx.Client) -> None:
    response = client.post("/jobs", content=b'{"model": {"name": "mlp"}, "name": "\xff"}', headers=JSON)
    assert response.status_code == 422
    assert strict_json(response)["detail"][0]["type"] == "json_invalid"


JOB_ROUTES = [("GET", ""), ("DELETE", ""), ("GET", "/metrics"), ("GET", "/metrics?max_points=5"),
              ("GET", "/metrics/stream"), ("GET", "/metrics.csv"), ("GET", "/layers"),
              ("GET", "/evaluations"), ("GET", "/plan"), ("GET", "/artifacts/model.keras")]
"""Every route under /jobs/{job_id} (app/api/routes/)."""


def _not_found(client: httpx.Client, method: str, path: str, headers: dict[str, str]) -> dict[str, Any]:
    response = client.request(method, path, headers=headers)
    assert response.status_code == 404, (method, path, response.text[:300])
    body: dict[str, Any] = strict_json(response)
    return body


@pytest.mark.parametrize(("method", "route"), JOB_ROUTES, ids=[f"{m} {r}" for m, r in JOB_ROUTES])
def test_a_malformed_job_id_is_a_404_like_a_missing_job_or_another_tenants(
        api: Stack, client: httpx.Client, job_id: str, method: str, route: str) -> None:
    before = writes(api)
    for bad in [*hostile.malformed_ids(job_id), "0" * 32]:
        assert _not_found(client, method, f"/jobs/{bad}{route}", A) == {"detail": f"No job with id {bad!r}."}, bad
    assert _not_found(client, method, f"/jobs/{job_id}{route}", B) == {"detail": f"No job with id {job_id!r}."}
    assert writes(api) == before
    assert client.get(f"/jobs/{job_id}").json()["state"] == "queued"  # no DELETE reached it


@pytest.mark.parametrize("method", ["GET", "DELETE"])
def test_a_malformed_comparison_id_is_a_404_like_a_missing_comparison_or_another_tenants(
        client: httpx.Client, comparison_id: str, method: str) -> None:
    for bad in [*hostile.malformed_ids(comparison_id), "0" * 32]:
        body = _not_found(client, method, f"/comparisons/{bad}", A)
        assert body == {"detail": f"No comparison with id {bad!r}."}, bad
    body = _not_found(client, method, f"/comparisons/{comparison_id}", B)
    assert body == {"detail": f"No comparison with id {comparison_id!r}."}


def test_the_routes_tried_above_are_every_route_with_an_id(client: httpx.Client) -> None:
    """A route added later with an id in its path must be added to JOB_ROUTES (or the comparisons' test)."""
    with_ids = {(method.upper(), path) for path, operations in client.get("/openapi.json").json()["paths"].items()
                for method in operations if "{" in path}
    tried = {(method, "/jobs/{job_id}" + route.partition("?")[0]) for method, route in JOB_ROUTES}
    assert with_ids == tried | {("GET", "/comparisons/{comparison_id}"), ("DELETE", "/comparisons/{comparison_id}"),
                                ("GET", "/datasets/{dataset_id}"), ("DELETE", "/datasets/{dataset_id}")}


@pytest.mark.parametrize("method", ["GET", "DELETE"])
def test_a_malformed_dataset_id_is_a_404_like_a_missing_dataset_or_another_tenants(
        client: httpx.Client, method: str) -> None:
    real = client.post("/datasets", content=_npz(), headers={"Content-Type": "application/octet-stream"})
    assert real.status_code in (200, 201), real.text
    dataset_id = real.json()["id"]
    for bad in [*hostile.malformed_ids(dataset_id), "0" * 64]:
        assert _not_found(client, method, f"/datasets/{bad}", A) == {"detail": f"No dataset with id {bad!r}."}, bad
    assert _not_found(client, method, f"/datasets/{dataset_id}", B) == {
        "detail": f"No dataset with id {dataset_id!r}."}
    assert client.get(f"/datasets/{dataset_id}").status_code == 200  # no DELETE reached it


def _npz() -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, x=np.eye(3), y=np.arange(3))
    return buffer.getvalue()


def test_without_a_key_a_malformed_id_is_still_a_401(client: httpx.Client, job_id: str) -> None:
    response = httpx.get(f"{client.base_url}/jobs/{job_id}:events")
    assert response.status_code == 401 and strict_json(response) == {"detail": "Send 'Authorization: Bearer <key>'."}


def _range_of(route: str, parameter: str) -> tuple[int, int]:
    if parameter in ("after", "Last-Event-ID"):
        return 0, hostile.MAX_STEP
    if parameter == "cursor":
        return 0, hostile.MAX_INT64
    if parameter == "max_points":
        return 1, 10_000
    return 1, {"/jobs": 200, "/comparisons": 100}.get(route, hostile.MAX_INT64)


@pytest.mark.parametrize(("route", "parameter", "value"), hostile.INTEGERS,
                         ids=[f"{r} {p}={v[:12]}" for r, p, v in hostile.INTEGERS])
def test_an_integer_parameter_out_of_range_or_not_decimal_is_a_422_naming_it_and_its_range(
        client: httpx.Client, job_id: str, route: str, parameter: str, value: str) -> None:
    response = client.get(route.format(id=job_id), params={parameter: value})
    assert response.status_code == 422, response.text[:300]
    [error] = strict_json(response)["detail"]
    low, high = _range_of(route, parameter)
    assert error["loc"] == ["query", parameter]
    assert error["msg"].startswith(f"Value error, Expected {parameter} to be a whole number from {low} to {high}. "
                                   f"Received: {parameter}=")


@pytest.mark.parametrize("value", hostile.LAST_EVENT_IDS, ids=[repr(v[:12]) for v in hostile.LAST_EVENT_IDS])
def test_a_last_event_id_that_is_not_a_step_is_a_422_naming_it(client: httpx.Client, job_id: str,
                                                               value: bytes) -> None:
    response = client.get(f"/jobs/{job_id}/metrics/stream", headers={"Last-Event-ID": value})  # type: ignore[dict-item]
    assert response.status_code == 422, response.text[:300]
    [error] = strict_json(response)["detail"]
    assert error["loc"] == ["header", "last-event-id"]
    assert error["msg"].startswith(f"Value error, Expected Last-Event-ID to be a whole number from 0 to "
                                   f"{hostile.MAX_STEP}. Received: Last-Event-ID=")


def test_every_integer_at_its_bounds_is_accepted(client: httpx.Client, job_id: str) -> None:
    for route, params in [
        (f"/jobs/{job_id}/metrics", {"after": hostile.MAX_STEP, "limit": hostile.MAX_INT64}),
        (f"/jobs/{job_id}/metrics", {"after": 0, "limit": 1, "max_points": 10_000}),
        (f"/jobs/{job_id}/layers", {"after": hostile.MAX_STEP, "limit": hostile.MAX_INT64}),
        (f"/jobs/{job_id}/evaluations", {"after": hostile.MAX_STEP, "limit": hostile.MAX_INT64}),
        ("/jobs", {"cursor": hostile.MAX_INT64, "limit": 200}),
        ("/jobs", {"cursor": 0, "limit": 1}),
        ("/comparisons", {"cursor": hostile.MAX_INT64, "limit": 100}),
    ]:
        response = client.get(route, params=params)
        assert response.status_code == 200, (route, params, response.text[:300])
        strict_json(response)
    assert job_id in {job["id"] for job in client.get("/jobs", params={"cursor": hostile.MAX_INT64}).json()["jobs"]}
    for headers, query in [({"Last-Event-ID": str(hostile.MAX_STEP)}, ""), ({}, f"?after={hostile.MAX_STEP}"),
                           ({"Last-Event-ID": "0"}, "")]:
        with client.stream("GET", f"/jobs/{job_id}/metrics/stream{query}", headers=headers) as response:
            assert response.status_code == 200
            assert next(response.iter_lines()) == "event: state"  # the job's queued event: the stream runs


def test_the_openapi_states_every_integer_parameters_range(client: httpx.Client) -> None:
    """So schemathesis (tests/processes/test_fuzz.py) tries each bound and one past it."""
    ranges = {}
    for path, operations in client.get("/openapi.json").json()["paths"].items():
        for method, operation in operations.items():
            for parameter in operation.get("parameters", []):
                schema = parameter["schema"]
                schema = next((s for s in schema.get("anyOf", []) if s.get("type") == "integer"), schema)
                if schema.get("type") == "integer":
                    ranges[(method, path, parameter["name"])] = (schema.get("minimum"), schema.get("maximum"))
    step, int64 = (0, hostile.MAX_STEP), (0, hostile.MAX_INT64)
    assert ranges == {
        ("get", "/jobs", "limit"): (1, 200), ("get", "/jobs", "cursor"): int64,
        ("get", "/jobs/{job_id}/metrics", "after"): step,
        ("get", "/jobs/{job_id}/metrics", "limit"): (1, hostile.MAX_INT64),
        ("get", "/jobs/{job_id}/metrics", "max_points"): (1, 10_000),
        ("get", "/jobs/{job_id}/metrics/stream", "after"): step,
        ("get", "/jobs/{job_id}/metrics/stream", "last-event-id"): step,
        ("get", "/jobs/{job_id}/layers", "after"): step,
        ("get", "/jobs/{job_id}/layers", "limit"): (1, hostile.MAX_INT64),
        ("get", "/jobs/{job_id}/evaluations", "after"): step,
        ("get", "/jobs/{job_id}/evaluations", "limit"): (1, hostile.MAX_INT64),
        ("get", "/comparisons", "limit"): (1, 100), ("get", "/comparisons", "cursor"): int64,
    }


def test_the_api_logged_no_server_error(api: Stack) -> None:
    """Runs last in this file: any 5xx answered to the requests above, from the API's own access log."""
    assert server_errors(api) == []
