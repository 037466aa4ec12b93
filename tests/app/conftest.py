"""Fixtures for the API-side tests: a real redis-server of their own, on a free port."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from app.store import JobStore
from scripts.stack import RedisServer


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[JobStore]:
    """A JobStore on a fresh redis-server, one per test module."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield JobStore(server.client())
    server.stop()
