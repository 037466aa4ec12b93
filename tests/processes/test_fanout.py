"""Live streams fanned out from one Redis reader per API process: connections flat from 1 to 200 viewers, a slow
viewer dropped with its reason and resumed whole, viewers joining mid-run without a gap, a Redis restart that
ends every stream with an `error` event (never a cut body), and the stream limit's 503.

The API is real and so is Redis; the steps are written as a worker writes them (`append_steps`, with layer
checks ahead of their steps), by this test, so it decides when each lands."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis

from app.store import JobStore
from app.store.connect import LIVE_CLIENT
from mpjobs._stream import follow
from mpjobs.contract.jobs import JobState
from scripts.sse_client import Stream, open_stream
from scripts.stack import Stack, private_stack, wait_until
from tests.app.store.test_evaluations_store import evaluation
from tests.app.store.test_layer_checks import check
from tests.app.store.test_missing_steps import finish, record

MAX_STREAMS = 201
QUEUE_EVENTS = 64
PRODUCER = "test-producer"
SPEC = {"model": {"name": "mlp"}, "precision_policy": "float32", "training": {"steps": 100_000}}


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The API alone (no worker: the test writes the steps), with a stream limit and small viewer queues."""
    with private_stack(tmp_path_factory.mktemp("fanout"), workers=0, MAX_STREAMS=str(MAX_STREAMS),
                       STREAM_QUEUE_EVENTS=str(QUEUE_EVENTS)) as stack:
        yield stack


def producer(stack: Stack) -> JobStore:
    return JobStore(redis.Redis.from_url(stack.redis.url, decode_responses=True, client_name=PRODUCER))


def running_job(stack: Stack, store: JobStore) -> str:
    with stack.client() as client:
        job_id = str(client.post("/jobs", json=SPEC).json()["id"])
    store.jobs.transition(job_id, JobState.RUNNING, [JobState.QUEUED], "running")
    return job_id


def write(store: JobStore, job_id: str, first: int, last: int, checks_every: int = 0) -> None:
    """Steps first..last in one batch, with a layer check at each multiple of `checks_every`, as a worker writes."""
    checks = [check(s) for s in range(first, last + 1) if checks_every and s % checks_every == 0]
    store.streams.append_steps(job_id, [record(s) for s in range(first, last + 1)], [], checks)


def connections(stack: Stack) -> list[dict[str, Any]]:
    """Every client of Redis but this test's own: with no worker, the API's."""
    return [c for c in stack.redis.client().client_list() if c["name"] != PRODUCER and c["cmd"] != "client|list"]


async def viewer(stack: Stack, job_id: str, after: int | None = None, **options: Any) -> Stream:
    headers = {} if after is None else {"Last-Event-ID": str(after)}
    stream = await open_stream("127.0.0.1", stack.port, f"/jobs/{job_id}/metrics/stream", headers, **options)
    assert stream.status == 200, stream.body
    return stream


async def read_to_end(stream: Stream) -> Stream:
    async for _ in stream.events():
        pass
    return stream


async def until(what: str, check: Any, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def test_redis_connections_stay_constant_from_1_to_200_viewers(live: Stack) -> None:
    store = producer(live)
    job_id = running_job(live, store)
    write(store, job_id, 1, 10, checks_every=5)

    async def run() -> tuple[int, int, list[Stream]]:
        first = await viewer(live, job_id)
        readers = [asyncio.create_task(read_to_end(first))]
        await until("the first viewer's 10 steps", lambda: len(first.steps()) == 10)
        one = len(connections(live))
        streams = [first, *await asyncio.gather(*(viewer(live, job_id) for _ in range(199)))]
        readers += [asyncio.create_task(read_to_end(s)) for s in streams[1:]]
        await until("every viewer's 10 steps", lambda: all(len(s.steps()) == 10 for s in streams))
        write(store, job_id, 11, 20, checks_every=5)
        await until("every viewer's 20 steps", lambda: all(len(s.steps()) == 20 for s in streams))
        two_hundred = len(connections(live))
        finish(store, job_id, 20)
        await asyncio.gather(*readers)
        return one, two_hundred, streams

    one, two_hundred, streams = asyncio.run(run())
    assert one == two_hundred, f"{one} Redis connections with 1 viewer, {two_hundred} with 200"
    named = [c for c in connections(live) if c["name"] == LIVE_CLIENT]
    assert 1 <= len(named) <= 3, named  # the reader and STREAM_READ_CONNECTIONS (2) for catching up
    for stream in streams:
        assert stream.whole and stream.steps() == list(range(1, 21))
        layers = [json.loads(e.data)["step"] for e in stream.received if e.kind == "layers"]
        assert layers == [5, 10, 15, 20]
        assert [e.kind for e in stream.received][-1] == "end"


def test_a_slow_viewer_is_dropped_with_its_event_and_resumes_losing_nothing(live: Stack) -> None:
    store = producer(live)
    job_id = running_job(live, store)
    steps = 12_000  # several MB of events: more than the kernel buffers a client that stops reading

    async def run() -> tuple[Stream, Stream, Stream]:
        slow = await viewer(live, job_id, receive_buffer=4096)  # reads nothing until the job has ended
        fast = await viewer(live, job_id)
        fast_reader = asyncio.create_task(read_to_end(fast))
        for first in range(1, steps + 1, 500):
            write(store, job_id, first, first + 499)
            await until("the fast viewer to keep up", lambda first=first: len(fast.steps()) >= first + 499)
        finish(store, job_id, steps)
        await fast_reader
        await read_to_end(slow)
        resumed = await read_to_end(await viewer(live, job_id, after=slow.steps()[-1]))
        return slow, fast, resumed

    slow, fast, resumed = asyncio.run(run())
    assert fast.whole and fast.steps() == list(range(1, steps + 1)), "the slow viewer never held back the others"
    assert fast.received[-1].kind == "end"
    assert slow.whole, "a dropped viewer's body ends whole"
    last = slow.received[-1]
    assert last.kind == "error" and json.loads(last.data)["reason"] == "too_slow", last
    assert "STREAM_QUEUE_EVENTS" in json.loads(last.data)["detail"]
    got = slow.steps()
    assert got == list(range(1, len(got) + 1)) and len(got) < steps
    assert got + resumed.steps() == list(range(1, steps + 1)), "resumed after its last event id: nothing lost"
    assert resumed.received[-1].kind == "end"


def test_viewers_joining_mid_run_get_every_step_once(live: Stack) -> None:
    """While steps land every few ms (a check every 7, stored before its step; an evaluation every 30, stored
    after its step as the worker's last one is), viewers join at staggered moments, from the start or from a
    Last-Event-ID halfway back: the first of them starts the job's reader, the others join it."""
    store = producer(live)
    job_id = running_job(live, store)
    total = 600
    written = 0

    def produce() -> None:
        nonlocal written
        for first in range(1, total + 1, 3):
            write(store, job_id, first, first + 2, checks_every=7)
            if (first + 2) % 30 == 0:
                store.evaluations.append(job_id, [evaluation(first + 2)])
            written = first + 2
            time.sleep(0.004)
        finish(store, job_id, total)

    async def run() -> list[tuple[int, Stream]]:
        joined: list[tuple[int, Stream]] = []
        readers = []
        thread = threading.Thread(target=produce)
        thread.start()
        for n in range(12):
            await until("more steps", lambda n=n: written >= 40 * (n + 1))
            after = 0 if n % 2 == 0 else written // 2
            stream = await viewer(live, job_id, after=after or None)
            joined.append((after, stream))
            readers.append(asyncio.create_task(read_to_end(stream)))
        await asyncio.gather(*readers)
        thread.join()
        return joined

    for after, stream in asyncio.run(run()):
        assert stream.whole and stream.received[-1].kind == "end"
        assert stream.steps() == list(range(after + 1, total + 1)), f"joined after step {after}"
        kinds = [(e.kind, int(e.id) if e.id else json.loads(e.data).get("step")) for e in stream.received]
        checks = [step for kind, step in kinds if kind == "layers"]
        assert checks == [s for s in range(after + 1, total + 1) if s % 7 == 0]
        for i, (kind, step) in enumerate(kinds):
            if kind == "layers":
                following = next(event for event in kinds[i + 1:] if event[0] != "evaluation")
                assert following == ("metrics", step), "each check just before its step (its evaluation between)"
        evaluations = [step for kind, step in kinds if kind == "evaluation"]
        assert evaluations == [s for s in range(after + 1, total + 1) if s % 30 == 0], f"joined after step {after}"


def test_a_redis_restart_ends_every_stream_with_an_error_event_and_clients_resume(live: Stack) -> None:
    store = producer(live)
    jobs = [running_job(live, store) for _ in range(2)]
    for job_id in jobs:
        write(store, job_id, 1, 30)
    followed: dict[str, list[int]] = {job_id: [] for job_id in jobs}

    def follow_with_the_client(job_id: str) -> None:
        with httpx.Client(base_url=live.base_url, timeout=30) as http:
            for event in follow(http, job_id):
                if event.kind == "metrics":
                    followed[job_id].append(int(event.id or 0))

    clients = [threading.Thread(target=follow_with_the_client, args=(job_id,)) for job_id in jobs]

    async def run() -> list[Stream]:
        streams = [await viewer(live, jobs[n % 2]) for n in range(40)]
        readers = [asyncio.create_task(read_to_end(s)) for s in streams]
        for thread in clients:
            thread.start()
        await until("every viewer's 30 steps", lambda: all(len(s.steps()) == 30 for s in streams))
        await until("the client's 30 steps", lambda: all(len(f) == 30 for f in followed.values()))
        live.redis.stop()
        await asyncio.gather(*readers)
        return streams

    streams = asyncio.run(run())
    for stream in streams:
        assert stream.whole, "no body is cut: each ends with its last chunk"
        assert stream.received[-1].kind == "error", stream.received[-1]
        assert json.loads(stream.received[-1].data)["reason"] == "redis_unavailable"
        assert stream.steps() == list(range(1, 31))
    live.redis.start()
    store = producer(live)
    for job_id in jobs:
        write(store, job_id, 31, 60)
        finish(store, job_id, 60)
    for thread in clients:
        thread.join(90)
        assert not thread.is_alive()
    assert all(steps == list(range(1, 61)) for steps in followed.values()), "the client resumed: each step once"

    async def resumed(job_id: str) -> Stream:
        return await read_to_end(await viewer(live, job_id, after=30))

    async def resume() -> list[Stream]:
        return list(await asyncio.gather(*(resumed(jobs[n % 2]) for n in range(40))))

    for stream in asyncio.run(resume()):
        assert stream.whole and stream.steps() == list(range(31, 61)) and stream.received[-1].kind == "end"


def test_past_the_stream_limit_a_new_stream_gets_503_with_retry_after_before_any_body(live: Stack) -> None:
    store = producer(live)
    job_id = running_job(live, store)

    async def run() -> tuple[Stream, Stream]:
        streams = await asyncio.gather(*(viewer(live, job_id) for _ in range(MAX_STREAMS)))
        refused = await open_stream("127.0.0.1", live.port, f"/jobs/{job_id}/metrics/stream")
        streams[0].close()
        await asyncio.sleep(0)

        async def admitted() -> Stream:
            while True:
                stream = await open_stream("127.0.0.1", live.port, f"/jobs/{job_id}/metrics/stream")
                if stream.status == 200:
                    return stream
                await asyncio.sleep(0.05)

        again = await asyncio.wait_for(admitted(), 30)
        for stream in [*streams, again]:
            stream.close()
        return refused, again

    refused, again = asyncio.run(run())
    assert refused.status == 503 and refused.headers["retry-after"] == "5"
    assert refused.headers["content-type"] == "application/json"
    assert "MAX_STREAMS" in json.loads(refused.body)["detail"]
    assert again.status == 200, "a stream closed gives its place back"
    wait_until(lambda: httpx.get(f"{live.base_url}/healthz").status_code == 200, 10, "the API")
