"""Fixtures every test folder shares."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from scripts.stack import RedisServer

# Quiet TensorFlow's C++ start-up chatter in test output; errors still show.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


SLOWEST_FIRST = (
    "tests/processes/test_heldout_verdict.py",
    "tests/processes/test_dashboard_data.py",
    "tests/processes/test_datasets_http.py",
    "tests/worker/engine/test_saved_model.py",
    "tests/processes/test_bench_gpu_speedup.py",
    "tests/processes/test_load.py",
    "tests/worker/engine/test_fp8_fit.py",
    "tests/processes/test_replicas.py",
    "tests/processes/test_comparisons_http.py",
    "tests/worker/engine/test_jax_backend.py",
    "tests/processes/test_worker_memory.py",
    "tests/processes/test_slow_checkpoints.py",
    "tests/processes/test_chaos_soak.py",
    "tests/processes/test_crash.py",
    "tests/processes/test_resume_gaps.py",
    "tests/worker/numerics/test_numerics_architectures.py",
    "tests/worker/numerics/test_plan.py",
    "tests/processes/test_plan_http.py",
    "tests/worker/numerics/test_fp8_telemetry.py",
    "tests/processes/test_bench_engine.py",
    "tests/processes/test_fuzz.py",
    "tests/processes/test_retention.py",
    "tests/processes/test_bench_smoke.py",
    "tests/processes/test_dashboard.py",
    "tests/processes/test_bench_service.py",
    "tests/processes/test_observability.py",
    "tests/processes/test_bench_peers.py",
    "tests/worker/numerics/test_speed.py",
    "tests/processes/test_cli.py",
    "tests/processes/test_e2e.py",
)
"""Test files that take a minute or so, longest first. `make test` runs files on two processes (pytest-xdist,
--dist loadfile), handing out files in collection order: started last, one of these would leave one
process running alone for minutes at the end."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The slowest files first, the rest in their usual order (a stable sort, the same in every process)."""
    rank = {path: i for i, path in enumerate(SLOWEST_FIRST)}
    root = config.rootpath
    for item in items:
        if item.path.is_relative_to(root / "tests" / "processes"):
            item.add_marker(pytest.mark.processes)
    items.sort(key=lambda item: rank.get(item.path.relative_to(root).as_posix(), len(rank)))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A real redis-server on a free port, one per test module, for the tests of the store and the worker's
    Redis side (the service tests start theirs with the stack)."""
    redis = RedisServer(tmp_path_factory.mktemp("redis"))
    redis.start()
    yield redis
    redis.stop()
