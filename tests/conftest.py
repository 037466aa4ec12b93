"""Fixtures every test folder shares."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.stack import RedisServer

# Quiet TensorFlow's C++ start-up chatter in test output; errors still show.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A real redis-server on a free port, one per test module, for the tests of the store and the worker's
    Redis side (the service tests start theirs with the stack)."""
    redis = RedisServer(tmp_path_factory.mktemp("redis"))
    redis.start()
    yield redis
    redis.stop()
