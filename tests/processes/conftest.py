"""Fixtures over real processes: see scripts/stack.py."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import httpx
import pytest

from scripts.stack import ROOT, RedisServer, Stack, free_port, wait_until

__all__ = ["ROOT", "RedisServer", "Stack", "free_port", "wait_until"]


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed; `make test` installs Debian's package")
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def stack(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(redis_server, tmp_path_factory.mktemp("stack"))
    try:
        s.start_api()
        s.start_worker()
        yield s
    finally:
        s.stop()


@pytest.fixture
def client(stack: Stack) -> Iterator[httpx.Client]:
    with stack.client() as c:
        yield c
