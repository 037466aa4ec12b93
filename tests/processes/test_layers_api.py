"""GET /jobs/{id}/layers and the `layers` events of the SSE stream, against the real API and Redis.

The checks are written through the store, as the worker's reporter writes them: no training needed.
"""

from __future__ import annotations

import json
from typing import Any

import httpx

from app.api.auth import OPEN_TENANT
from app.store import JobStore
from mpjobs.contract.jobs import JobState
from mpjobs.contract.spec import JobSpec
from scripts.stack import Stack, iter_sse
from tests.app.store.test_layer_checks import check
from tests.app.store.test_missing_steps import finish, record


def running_job(stack: Stack, steps: int = 6) -> tuple[JobStore, str]:
    """A job of the open tenant, moved to running by hand: no RQ job, so no worker takes it."""
    store = JobStore(stack.redis.client())
    spec = JobSpec.model_validate({"model": {"name": "mlp"}, "training": {"steps": steps}})
    job_id, _ = store.jobs.create(spec, OPEN_TENANT, "cpu", lambda job_id, pipe: None,
                             store.redis.pipeline(transaction=True))
    store.jobs.transition(job_id, JobState.RUNNING, [JobState.QUEUED], "running")
    return store, job_id


def ended_job(stack: Stack) -> str:
    """Six steps with checks at 1 and 5, written in two batches, then succeeded."""
    store, job_id = running_job(stack)
    store.streams.append_steps(job_id, [record(s) for s in range(1, 4)], [], [check(1)])
    store.streams.append_steps(job_id, [record(s) for s in range(4, 7)], [], [check(5, underflow=None)])
    finish(store, job_id, steps_done=6)
    return job_id


def test_layers_are_paged_in_step_order(stack: Stack, client: httpx.Client) -> None:
    job_id = ended_job(stack)
    first = client.get(f"/jobs/{job_id}/layers", params={"limit": 1})
    assert first.status_code == 200, first.text
    assert first.json() == {"job_id": job_id, "checks": [check(1).model_dump(mode="json")], "next_after": 1}
    rest = client.get(f"/jobs/{job_id}/layers", params={"after": 1, "limit": 1}).json()
    assert rest["checks"] == [check(5, underflow=None).model_dump(mode="json")] and rest["next_after"] is None
    everything = client.get(f"/jobs/{job_id}/layers", params={"limit": 1_000_000}).json()  # capped, not refused
    assert [c["step"] for c in everything["checks"]] == [1, 5] and everything["next_after"] is None
    assert client.get(f"/jobs/{job_id}/layers", params={"limit": 0}).status_code == 422
    assert client.get("/jobs/no-such-job/layers").status_code == 404


def stream(client: httpx.Client, job_id: str, headers: dict[str, str] | None = None, query: str = ""
           ) -> list[tuple[str, str | None, dict[str, Any]]]:
    events = []
    for event, event_id, data, _ in iter_sse(client, f"/jobs/{job_id}/metrics/stream{query}", headers):
        events.append((event, event_id, json.loads(data)))
        if event == "end":
            return events
    raise AssertionError("the stream ended without `end`")


def test_the_stream_sends_each_check_just_before_its_step_and_resumes_without_losing_one(
        stack: Stack, client: httpx.Client) -> None:
    job_id = ended_job(stack)
    events = stream(client, job_id)
    numbers = [(e, i, d["step"]) for e, i, d in events if e in ("metrics", "layers")]
    assert numbers == [("layers", None, 1), ("metrics", "1", 1), ("metrics", "2", 2), ("metrics", "3", 3),
                       ("metrics", "4", 4), ("layers", None, 5), ("metrics", "5", 5), ("metrics", "6", 6)]
    layers = [d for e, _, d in events if e == "layers"]
    assert layers == [check(1).model_dump(mode="json"), check(5, underflow=None).model_dump(mode="json")]
    assert events[-1][0] == "end"
    resumed = stream(client, job_id, {"Last-Event-ID": "4"})
    assert [(e, d["step"]) for e, _, d in resumed if e in ("metrics", "layers")] == [
        ("layers", 5), ("metrics", 5), ("metrics", 6)]
    after_the_check = stream(client, job_id, query="?after=5")
    assert [(e, d["step"]) for e, _, d in after_the_check if e in ("metrics", "layers")] == [("metrics", 6)]


def test_a_check_written_while_the_stream_is_open_arrives_live(stack: Stack, client: httpx.Client) -> None:
    store, job_id = running_job(stack, steps=4)
    store.streams.append_steps(job_id, [record(1), record(2)], [], [check(1)])
    seen: list[tuple[str, int | None]] = []
    for event, _, data, _ in iter_sse(client, f"/jobs/{job_id}/metrics/stream"):
        payload = json.loads(data)
        seen.append((event, payload.get("step")))
        if (event, payload.get("step")) == ("metrics", 2):  # caught up: the next batch is written now
            store.streams.append_steps(job_id, [record(3), record(4)], [], [check(3)])
            finish(store, job_id, steps_done=4)
        if event == "end":
            break
    assert [s for s in seen if s[0] in ("metrics", "layers")] == [
        ("layers", 1), ("metrics", 1), ("metrics", 2), ("layers", 3), ("metrics", 3), ("metrics", 4)]
