"""Idempotency, tenant isolation and hostile input, against real processes."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from scripts.stack import ROOT, Stack, free_port, wait_until

SPEC = {"model": {"name": "mlp"}, "training": {"steps": 2}, "dataset": {"samples": 64}}


def test_same_idempotency_key_and_body_return_the_same_job(stack: Stack, client: httpx.Client) -> None:
    headers = {"Idempotency-Key": "retry-me-1"}
    first = client.post("/jobs", json=SPEC, headers=headers)
    again = client.post("/jobs", json=SPEC, headers=headers)
    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json()["id"] == first.json()["id"]
    other = client.post("/jobs", json={**SPEC, "name": "different"}, headers=headers)
    assert other.status_code == 409 and "Idempotency-Key" in other.json()["detail"]


def test_fifty_concurrent_posts_with_one_key_create_one_job(stack: Stack) -> None:
    r = stack.redis.client()
    before = r.zcard("mpjobs:jobs:default")

    def post(_: int) -> httpx.Response:
        return httpx.post(f"{stack.base_url}/jobs", json=SPEC, headers={"Idempotency-Key": "race-1"}, timeout=30)

    with ThreadPoolExecutor(max_workers=50) as pool:
        responses = list(pool.map(post, range(50)))
    assert sorted(resp.status_code for resp in responses) == [200] * 49 + [201]
    assert len({resp.json()["id"] for resp in responses}) == 1
    assert r.zcard("mpjobs:jobs:default") == before + 1


def test_body_over_one_mib_is_413_and_writes_nothing(stack: Stack, client: httpx.Client) -> None:
    before = stack.writes()
    big = {**SPEC, "name": "x" * (2 * 2**20)}
    assert client.post("/jobs", json=big).status_code == 413

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it streams
        yield b'{"model": {"name": "mlp"}, "name": "'
        for _ in range(40):
            yield b"y" * 65536
        yield b'"}'

    response = client.post("/jobs", content=chunks(), headers={"content-type": "application/json"})
    assert response.status_code == 413
    assert stack.writes() == before


@pytest.mark.parametrize(("content", "content_type"), [
    (b'{"model": {"name": "mlp"}}', "text/plain"),
    (b'{"model": {"name": "mlp"}}', "application/x-www-form-urlencoded"),  # curl -d without -H
    (b"model=mlp", "multipart/form-data; boundary=x"),
])
def test_a_body_that_is_not_sent_as_json_is_415_saying_what_to_send(stack: Stack, client: httpx.Client,
                                                                    content: bytes, content_type: str) -> None:
    before = stack.writes()
    for path in ("/jobs", "/comparisons"):
        response = client.post(path, content=content, headers={"content-type": content_type})
        assert response.status_code == 415, response.text
        assert response.json()["detail"] == (
            "Send the body as JSON, with the header 'Content-Type: application/json' (curl: -H 'content-type: "
            f"application/json'). Received: content-type {content_type.split(';')[0]!r}")
    assert stack.writes() == before


def test_a_body_without_a_content_type_is_415_too(client: httpx.Client) -> None:
    response = client.post("/jobs", content=b'{"model": {"name": "mlp"}}')
    assert response.status_code == 415 and response.json()["detail"].endswith("Received: content-type 'none'")


def test_a_long_input_is_echoed_cut(client: httpx.Client) -> None:
    body = {"model": {"keras_json": "x" * 100_000, "loss": "mse"}}
    response = client.post("/jobs", json=body)
    assert response.status_code == 422 and len(response.content) < 5_000
    assert "… (100,000 characters)" in response.text


@pytest.mark.parametrize(("content", "content_type"), [
    (b'{"model": ' * 5000, "application/json"),
    (b"[" * 100_000 + b"]" * 100_000, "application/json"),
])
def test_malformed_json_is_422(stack: Stack, client: httpx.Client, content: bytes,
                                                     content_type: str) -> None:
    before = stack.writes()
    assert client.post("/jobs", content=content, headers={"content-type": content_type}).status_code == 422
    assert stack.writes() == before


@pytest.fixture(scope="module")
def keyed_api(stack: Stack) -> Iterator[str]:
    port = free_port()
    env = {**stack.env, "API_KEYS": "key-a:tenant-a,key-b:tenant-b"}
    api = subprocess.Popen([sys.executable, "-m", "uvicorn", "app.main:app", "--port", str(port)], cwd=ROOT,
                           env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: httpx.get(f"{base}/healthz").status_code == 200, 30, "the keyed API")
        yield base
    finally:
        api.terminate()
        api.wait(10)


def test_keys_are_required_everywhere_but_healthz(keyed_api: str) -> None:
    assert httpx.get(f"{keyed_api}/healthz").status_code == 200
    # Open by design: the dashboard's page (it asks for the key) and Prometheus's scrape.
    assert httpx.get(f"{keyed_api}/").status_code == 200 and httpx.get(f"{keyed_api}/metrics").status_code == 200
    for path in ["/jobs", "/jobs/x", "/readyz", "/jobs/x/metrics", "/jobs/x/layers", "/comparisons",
                 "/comparisons/x"]:
        response = httpx.get(keyed_api + path)
        assert response.status_code == 401, path
        assert response.headers["www-authenticate"] == "Bearer"
    wrong = httpx.get(f"{keyed_api}/jobs", headers={"Authorization": "Bearer key-c"})
    assert wrong.status_code == 401
    assert httpx.post(f"{keyed_api}/jobs", json=SPEC).status_code == 401


def test_tenant_b_gets_404_on_every_endpoint_of_tenant_a(stack: Stack, keyed_api: str) -> None:
    a = httpx.Client(base_url=keyed_api, headers={"Authorization": "Bearer key-a"}, timeout=30)
    b = httpx.Client(base_url=keyed_api, headers={"Authorization": "Bearer key-b"}, timeout=30)
    job_id = a.post("/jobs", json=SPEC).json()["id"]
    stack.wait_for_state(a, job_id, {"succeeded"})
    assert a.get(f"/jobs/{job_id}/artifacts/model.keras").status_code == 200
    assert a.get(f"/jobs/{job_id}/layers").status_code == 200
    for path in ["", "/metrics", "/metrics?max_points=5", "/metrics/stream", "/layers", "/artifacts/model.keras"]:
        assert b.get(f"/jobs/{job_id}{path}").status_code == 404, path
    assert b.delete(f"/jobs/{job_id}").status_code == 404
    assert job_id not in {j["id"] for j in b.get("/jobs", params={"limit": 200}).json()["jobs"]}
    assert job_id in {j["id"] for j in a.get("/jobs", params={"limit": 200}).json()["jobs"]}
    # Same key string, other tenant: idempotency keys are per tenant.
    first_a = a.post("/jobs", json=SPEC, headers={"Idempotency-Key": "shared"}).json()["id"]
    first_b = b.post("/jobs", json=SPEC, headers={"Idempotency-Key": "shared"}).json()["id"]
    assert first_a != first_b


def test_tenant_b_cannot_see_or_cancel_tenant_a_comparison(stack: Stack, keyed_api: str) -> None:
    a = httpx.Client(base_url=keyed_api, headers={"Authorization": "Bearer key-a"}, timeout=30)
    b = httpx.Client(base_url=keyed_api, headers={"Authorization": "Bearer key-b"}, timeout=30)
    created = a.post("/comparisons", json={"spec": SPEC, "variants": [
        {"precision_policy": "float32"}, {"precision_policy": "mixed_bfloat16"}]})
    assert created.status_code == 201, created.text
    comparison = created.json()
    assert b.get(f"/comparisons/{comparison['id']}").status_code == 404
    assert b.delete(f"/comparisons/{comparison['id']}").status_code == 404
    assert comparison["id"] not in {c["id"] for c in b.get("/comparisons").json()["comparisons"]}
    for variant in comparison["variants"]:
        assert b.get(f"/jobs/{variant['job_id']}").status_code == 404
        stack.wait_for_state(a, variant["job_id"], {"succeeded"})
    assert a.get(f"/comparisons/{comparison['id']}").json()["state"] == "done"


def test_api_keys_never_appear_in_the_api_output(stack: Stack, tmp_path: Path) -> None:
    keys = {"tenant-a": "sk-a-7f3a9c1e5b", "tenant-b": "sk-b-4d2e8a6c0f"}
    wrong = "sk-c-91b0d3f7e2"  # a caller's mistyped key can be a real one: never logged either
    port = free_port()
    env = {**stack.env, "API_KEYS": ",".join(f"{key}:{tenant}" for tenant, key in keys.items()),
           "PYTHONUNBUFFERED": "1"}
    log = tmp_path / "api.log"
    with log.open("wb") as out:  # debug: a key logged at any level shows
        api = subprocess.Popen([sys.executable, "-m", "uvicorn", "app.main:app", "--port", str(port),
                                "--log-level", "debug"], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: httpx.get(f"{base}/healthz").status_code == 200, 30, "the keyed API")
        with httpx.Client(base_url=base, timeout=30) as c:
            for key in keys.values():
                bearer = {"Authorization": f"Bearer {key}"}
                assert c.get("/jobs", headers=bearer).status_code == 200
                assert c.get("/jobs/nope", headers=bearer).status_code == 404
                assert c.post("/jobs", json={"model": {"name": "nope"}}, headers=bearer).status_code == 422
            for authorization in (f"Bearer {wrong}", f"Bearer {keys['tenant-a']}x", f"Token {keys['tenant-a']}",
                                  f"bearer  {keys['tenant-b']}", keys["tenant-b"]):
                assert c.get("/jobs", headers={"Authorization": authorization}).status_code == 401, authorization
    finally:
        api.terminate()
        api.wait(10)
    output = log.read_text()
    assert '"GET /jobs HTTP/1.1" 200' in output and '"GET /jobs HTTP/1.1" 401' in output, output[-2000:]
    for key in [*keys.values(), wrong]:
        assert key not in output, output[-2000:]
