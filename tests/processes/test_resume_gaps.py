"""Issue 31, items 1 and 5: an attempt lost after its last step resumes from what Redis holds and redoes
what it had not finished (the held step records; the after-run timing of a comparison's variants)."""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from app.store import JobStore
from scripts.stack import Stack, freeze_mid_run, private_stack, wait_until

SPEC = {"model": {"name": "mlp", "input_dim": 32, "hidden_units": 32}, "precision_policy": "mixed_float16",
        "loss_scale": {"mode": "dynamic"}, "speed_check": [],
        "training": {"steps": 300, "checkpoint_every": 50}, "dataset": {"samples": 512}}
"""The soak's reproduction: mlp mixed_float16 + dynamic, 300 steps, a checkpoint every 50."""
TERMINAL = {"succeeded", "failed", "canceled"}


@pytest.fixture(scope="module")
def own_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # A lost worker's job is requeued within 3 + 1 s; its timing lasts long enough to be caught.
    with private_stack(tmp_path_factory.mktemp("gaps"), LEASE_S="3", REAP_INTERVAL_S="1",
                       SPEED_CHECK_STEPS="8") as stack:
        yield stack


def resumed_from(client: httpx.Client, job_id: str) -> list[int]:
    """The step each attempt after the first resumed from, from the job's events."""
    events = client.get(f"/jobs/{job_id}").json()["transitions"]
    return [int(m.group(1)) for e in events if (m := re.search(r"resuming from step (\d+)", e["message"]))]


def test_a_worker_killed_after_the_last_step_during_an_outage_loses_no_step(own_stack: Stack) -> None:
    """Redis stops past step 240; the worker trains to the end holding the records, writes its last
    checkpoint and model, and is SIGKILLed before Redis is back. The job must not succeed with those steps
    missing: the next attempt starts from a checkpoint whose steps Redis holds and recomputes the rest."""
    client = own_stack.client()
    job_id, pid, spec = freeze_mid_run(own_stack, client, SPEC, past_step=240)
    held = JobStore(own_stack.redis.client()).cancels.attempt(job_id).step  # the last step Redis has
    steps = spec["training"]["steps"]
    try:
        own_stack.redis.stop()  # clean: nothing Redis acknowledged is lost
    finally:
        os.killpg(pid, signal.SIGCONT)
    model = own_stack.artifacts / job_id / "model.keras"
    wait_until(model.exists, 120, "the attempt to finish training during the outage")
    os.killpg(pid, signal.SIGKILL)
    own_stack.workers = [w for w in own_stack.workers if w.pid != pid]
    own_stack.redis.start()
    own_stack.start_worker()

    done = own_stack.wait_for_state(client, job_id, TERMINAL, timeout=240)
    assert done["state"] == "succeeded", done["error"]
    page = client.get(f"/jobs/{job_id}/metrics", params={"limit": steps + 1}).json()
    assert [p["step"] for p in page["points"]] == list(range(1, steps + 1)), "every step once, in order"
    assert page["missing_steps"] == []
    assert done["summary"]["steps_done"] == steps
    resumed = resumed_from(client, job_id)
    assert resumed and resumed[-1] <= held < steps, (resumed, held)


def test_a_baseline_killed_while_timing_its_variants_times_them_again(own_stack: Stack) -> None:
    """A comparison's float32 baseline is SIGKILLed while it times the variants after its last step. Its
    next attempt resumes at that step and must time them again: every verdict clause has its speed."""
    client = own_stack.client()
    spec = {"model": {"name": "mlp", "input_dim": 32, "hidden_units": 32}, "training": {"steps": 300, "seed": 3},
            "dataset": {"samples": 256}}
    created = client.post("/comparisons", json={"spec": spec, "variants": [
        {"precision_policy": "float32"}, {"precision_policy": "mixed_bfloat16"}]})
    assert created.status_code == 201, created.text
    base_id = created.json()["variants"][0]["job_id"]
    store = JobStore(own_stack.redis.client())

    def timing() -> int | None:
        job = store.jobs.get(base_id)
        assert job is not None and job.state.value not in TERMINAL, "the baseline ended before it was seen timing"
        return job.worker.pid if job.phase == "measuring speed against float32" and job.worker else None

    pid = wait_until(timing, 180, "the baseline to time its variants", interval=0.005)
    os.killpg(pid, signal.SIGKILL)
    own_stack.workers = [w for w in own_stack.workers if w.pid != pid]
    own_stack.start_worker()

    def finished() -> dict[str, Any] | None:
        report: dict[str, Any] = client.get(f"/comparisons/{created.json()['id']}").json()
        return report if report["state"] == "done" else None

    report = wait_until(finished, 240, "the comparison")
    rows = {v["label"]: v for v in report["variants"]}
    assert rows["float32"]["state"] == "succeeded" and rows["mixed_bfloat16"]["state"] == "succeeded", report
    assert resumed_from(client, base_id)[-1] == 300, "the attempt after the kill resumed at the last step"
    assert rows["mixed_bfloat16"]["speed"] is not None, report
    assert "not measured" not in report["verdict"], report["verdict"]
