"""`GET /jobs/{id}/metrics.csv` against the real API: the streamed export is, byte for byte, the CSV written
from every page of `GET /jobs/{id}/metrics` with the standard library, from Redis and from the archive; a
missing job or another tenant's is a 404 with no CSV."""

from __future__ import annotations

import csv
import io
import re
from pathlib import Path

import httpx

from app.api.auth import OPEN_TENANT
from app.store import JobStore
from app.store.retention import Archiver
from mpjobs.contract.records import STEP_SCALARS
from scripts.stack import Stack
from tests.app.store.history import ended_job
from tests.processes.test_cli import mpjobs


def paged_csv(client: httpx.Client, job_id: str) -> str:
    """What a client paging through the JSON writes: csv.DictWriter, null empty, booleans true/false; the scalar
    fields only (an FP8 job's `fp8` rows stay in the JSON)."""
    out = io.StringIO()
    writer = csv.DictWriter(out, list(STEP_SCALARS), lineterminator="\n", extrasaction="ignore")
    writer.writeheader()
    after: int | None = 0
    while after is not None:
        page = client.get(f"/jobs/{job_id}/metrics", params={"after": after, "limit": 777}).json()
        for point in page["points"]:
            writer.writerow({k: "" if v is None else str(v).lower() if isinstance(v, bool) else v
                             for k, v in point.items()})
        after = page["next_after"]
    return out.getvalue()


def exported(client: httpx.Client, job_id: str) -> tuple[httpx.Response, str]:
    with client.stream("GET", f"/jobs/{job_id}/metrics.csv") as response:
        return response, "".join(response.iter_text())


def test_the_streamed_csv_is_the_paged_csv_from_redis_and_from_the_archive(stack: Stack, client: httpx.Client
                                                                           ) -> None:
    store = JobStore(stack.redis.client(), stack.artifacts)
    job_id, written, _ = ended_job(store, 12_000, skip=frozenset({3, 4, 6000}), tenant=OPEN_TENANT)
    response, body = exported(client, job_id)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/csv")
    assert body == paged_csv(client, job_id)
    rows = list(csv.DictReader(io.StringIO(body)))
    assert [int(row["step"]) for row in rows] == [r.step for r in written], "every stored step once, in order"
    assert [row["loss"] for row in rows] == ["" if r.loss is None else repr(r.loss) for r in written]
    assert [row["skipped"] for row in rows] == [str(r.skipped).lower() for r in written]

    assert Archiver(store, retention_s=0).archive(job_id) == "archived"
    assert exported(client, job_id)[1] == body, "the archive exports the same bytes"


def test_the_cli_writes_the_streamed_csv_and_warns_of_every_missing_step(stack: Stack, client: httpx.Client,
                                                                        tmp_path: Path) -> None:
    store = JobStore(stack.redis.client(), stack.artifacts)
    job_id, written, _ = ended_job(store, 40, skip=frozenset({3, 4, 20, 39, 40}), tenant=OPEN_TENANT)
    out = tmp_path / "steps.csv"
    done = mpjobs(stack, "metrics", job_id, "--csv", "--output", str(out))
    assert done.returncode == 0, done.stderr
    assert out.read_text() == paged_csv(client, job_id) and len(out.read_text().splitlines()) == 1 + len(written)
    warned = re.findall(r"^warning: steps (\d+)-(\d+) are missing", done.stderr, re.MULTILINE)
    assert warned == [("3", "4"), ("20", "20"), ("39", "40")], done.stderr


def test_no_csv_for_a_missing_job_or_another_tenants(stack: Stack, client: httpx.Client) -> None:
    store = JobStore(stack.redis.client(), stack.artifacts)
    other, _, _ = ended_job(store, 5, tenant="someone-else")
    for job_id in ("nope", other):
        response, body = exported(client, job_id)
        assert response.status_code == 404 and response.headers["content-type"] == "application/json", body
        assert httpx.Response(404, content=body).json() == {"detail": f"No job with id {job_id!r}."}
