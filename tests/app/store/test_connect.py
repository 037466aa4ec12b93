"""The clients app/store/connect.py builds, against a real redis-server restarted under them: a pooled connection whose
server went is replaced without an error; the worker's waits for Redis, and stops waiting when told."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from app.store.connect import async_client, client, waiting_client
from scripts.stack import RedisServer, wait_until


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()


def test_a_sync_clients_next_command_after_a_restart_succeeds(own_server: RedisServer) -> None:
    r = client(own_server.url)
    assert r.set("k", "v")  # a pooled connection, left open
    own_server.stop()
    own_server.start()
    assert r.get("k") == "v"
    r.close()


def test_an_async_clients_next_command_after_a_restart_succeeds(own_server: RedisServer) -> None:
    async def run() -> tuple[str | None, list[object]]:
        r = async_client(own_server.url)
        await r.set("k", "v")
        own_server.stop()
        own_server.start()
        value = await r.get("k")
        async with r.pipeline(transaction=True) as pipe:
            replies = await pipe.incr("n").get("k").execute()  # the pool's only connection, now fresh
        await r.aclose()
        return value, replies

    assert asyncio.run(run()) == ("v", [1, "v"])


def test_the_workers_client_waits_for_redis_and_answers_once_it_is_up(
        own_server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    stop = threading.Event()
    r = waiting_client(own_server.url, stop)
    own_server.stop()
    answers: list[object] = []
    waiting = threading.Thread(target=lambda: answers.append(r.ping()))
    with caplog.at_level(logging.INFO, logger="mpjobs.redis"):
        waiting.start()
        wait_until(lambda: f"waiting for redis at {own_server.url}" in caplog.text, 10, "the wait to be logged")
        assert answers == [] and waiting.is_alive()
        own_server.start()
        waiting.join(10)
    assert answers == [True]
    assert f"redis at {own_server.url} answers again" in caplog.text
    r.close()


def test_the_workers_client_stops_waiting_when_told(own_server: RedisServer,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    stop = threading.Event()
    r = waiting_client(own_server.url, stop)
    own_server.stop()
    raised: list[Exception] = []

    def ping() -> None:
        try:
            r.ping()
        except redis.ConnectionError as exc:
            raised.append(exc)

    waiting = threading.Thread(target=ping)
    with caplog.at_level(logging.INFO, logger="mpjobs.redis"):
        waiting.start()
        wait_until(lambda: "waiting for redis at" in caplog.text, 10, "the wait to be logged")
    stop.set()
    waiting.join(10)
    assert not waiting.is_alive() and len(raised) == 1
