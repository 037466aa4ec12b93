"""Redis restarts mid-job (AOF everysec): the job finishes, the API says 503 meanwhile, and
the metric series never invents a point. The restart is clean (SIGTERM: Redis writes and fsyncs
its AOF before it exits), so no step may be lost."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from scripts.stack import Stack, freeze_mid_run, private_stack

SPEC = {"model": {"name": "mlp"}, "precision_policy": "mixed_float16", "speed_check": [],
        "training": {"steps": 150, "checkpoint_every": 25}, "dataset": {"samples": 512}}
"""No speed check after the last step (`[]`): it times two more models once the outage is over, and
nothing here reads it."""
SHORT = {"model": {"name": "mlp"}, "precision_policy": "float32",
         "training": {"steps": 150, "checkpoint_every": 25}, "dataset": {"samples": 512}}
"""Redis stays down until this job has written its model: it ends inside the outage, so its last
records have no later batch to ride with and must be written before its last transition."""


@pytest.fixture(scope="module")
def own_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with private_stack(tmp_path_factory.mktemp("restart")) as stack:
        yield stack


@pytest.mark.parametrize(("spec", "ends_in_outage"), [(SPEC, False), (SHORT, True)],
                         ids=["outage-mid-run", "ends-during-outage"])
def test_job_survives_a_redis_restart(own_stack: Stack, spec: dict[str, Any], ends_in_outage: bool) -> None:
    client = own_stack.client()
    # The worker is frozen past step 20 with the job still running, so the outage starts mid-run
    # (and, for SHORT, the job ends inside it) on any machine.
    job_id, pid, spec = freeze_mid_run(own_stack, client, spec, past_step=20)
    try:
        own_stack.redis.stop()  # SIGTERM: a clean shutdown
    finally:
        os.killpg(pid, signal.SIGCONT)
    statuses = []
    outage_ends = time.monotonic() + 2.0
    model = own_stack.artifacts / job_id / "model.keras"
    while time.monotonic() < outage_ends or (ends_in_outage and not model.exists()):
        statuses.append(client.get(f"/jobs/{job_id}").status_code)
        time.sleep(0.1)
        assert time.monotonic() < outage_ends + 60, "the job never finished training"
    own_stack.redis.start()

    assert statuses and set(statuses) == {503}, statuses
    done = own_stack.wait_for_state(client, job_id, {"succeeded", "failed", "canceled"}, timeout=180)
    assert done["state"] == "succeeded", done["error"]

    steps = spec["training"]["steps"]
    page = client.get(f"/jobs/{job_id}/metrics", params={"limit": steps + 1}).json()
    assert [p["step"] for p in page["points"]] == list(range(1, steps + 1)), "every step once, in order"
    assert page["missing_steps"] == [], "a clean restart loses nothing"
    assert done["summary"]["steps_done"] == steps
