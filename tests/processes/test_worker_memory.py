"""A worker's memory goes back to its idle baseline after a job: one that succeeded, one that failed, and one
canceled while it built its model.

Read from the worker process itself (`/proc/<pid>/status`): VmRSS idle, and VmHWM, its peak since the
peak was reset, to show each job did take the memory it then gave back.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest

from scripts.stack import Stack, private_stack, wait_until
from tests.processes.test_hostile_jobs import slow_to_load

MIB = 2**20
MARGIN = 200 * MIB
"""How far above its baseline an idle worker may stay: thread stacks, allocator bookkeeping and caches that
grow with the shapes a process has seen. A job that kept its model would stay 1 GiB or more above."""
BIG_MLP = {"name": "mlp", "input_dim": 8192, "hidden_units": 8192, "classes": 10}
BIG_MLP_BYTES = (8192 * 8192 + 8192 + 8192 * 10 + 10) * 4 * 4  # float32 weights, gradients, Adam's 2 slots: 1.08 GB
"""Checkpoints and model.keras copy the weights too: the job's peak is higher still."""
# A 134M-parameter embedding (weights and Adam's slots: 1.6 GB, allocated before the check) under one
# attention layer whose scores for 64 rows of 8192 tokens need terabytes: it fails out_of_memory.
UNFIT_TRANSFORMER = {"name": "transformer", "seq_len": 8192, "vocab_size": 131_072, "d_model": 1024, "heads": 128,
                     "layers": 1, "ffn_dim": 8, "classes": 2}


WIDE = 8192
WIDE_BYTES = 2 * (WIDE * WIDE + WIDE) * 4
"""Two Dense(8192) on 8192 inputs, float32: the weights a model canceled while it builds has made (537 MB)."""


def wide_then_slow() -> dict[str, Any]:
    """slow_to_load()'s model, whose first two Dense layers hold WIDE_BYTES (Keras takes many seconds to load the
    rest): a cancel lands while the model builds, with its wide weights made."""
    spec = slow_to_load()
    config = json.loads(spec["model"]["keras_json"])
    outer_input, first, *_ = config["config"]["layers"]
    inner_input, *layers = first["config"]["layers"]
    for input_layer in (outer_input, inner_input):
        input_layer["config"]["batch_shape"] = [None, WIDE]
    for layer in layers[:2]:
        layer["config"]["units"] = WIDE
    spec["model"]["keras_json"] = json.dumps(config)
    return spec


def status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of `pid`, in bytes."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return {key: int(fields[key].split()[0]) * 1024 for key in ("VmRSS", "VmHWM")}


def reset_peak(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # Linux: VmHWM starts again from VmRSS


def run_until_idle(stack: Stack, client: httpx.Client, pid: int, spec: dict[str, Any], state: str) -> dict[str, Any]:
    """Submit `spec`, await its end and then the worker's return to idle (after it released the job's memory)."""
    response = client.post("/jobs", json=spec)
    assert response.status_code == 201, response.text
    job = stack.wait_for_state(client, response.json()["id"], {"succeeded", "failed", "canceled"}, timeout=300)
    assert job["state"] == state, job
    worker = f"rq:worker:{socket.gethostname()}.{pid}"
    wait_until(lambda: stack.redis.client().hget(worker, "state") == "idle", 60, "the worker to be idle")
    return job


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="reads a Linux worker's /proc")
def test_an_idle_workers_memory_returns_to_its_baseline_after_each_job(tmp_path: Path) -> None:
    with private_stack(tmp_path, MAX_MODEL_BYTES=str(2**50)) as stack, stack.client() as client:
        pid = stack.workers[0].pid
        # The first job loads what every job shares (kernels, the engine's first traces): the baseline is after it.
        run_until_idle(stack, client, pid, {"model": {"name": "mlp"}, "training": {"steps": 2}}, "succeeded")
        baseline = status(pid)["VmRSS"]
        reset_peak(pid)
        run_until_idle(stack, client, pid, {"model": BIG_MLP, "training": {"steps": 3, "batch_size": 8},
                                            "dataset": {"samples": 64}}, "succeeded")
        after = status(pid)
        assert after["VmHWM"] - baseline > BIG_MLP_BYTES, (baseline, after)
        assert after["VmRSS"] - baseline < MARGIN, f"idle {after['VmRSS'] / MIB:.0f} MiB after a job, " \
                                                   f"{baseline / MIB:.0f} MiB before"
        reset_peak(pid)
        job = run_until_idle(stack, client, pid, {"model": UNFIT_TRANSFORMER, "training": {"batch_size": 64}},
                             "failed")
        assert job["error"]["reason"] == "out_of_memory", job["error"]
        after = status(pid)
        assert after["VmHWM"] - baseline > BIG_MLP_BYTES, (baseline, after)
        assert after["VmRSS"] - baseline < MARGIN, f"idle {after['VmRSS'] / MIB:.0f} MiB after a failed job, " \
                                                   f"{baseline / MIB:.0f} MiB before"
        # Canceled while it builds its model, its wide weights made: the likeliest job to leave them behind.
        reset_peak(pid)
        response = client.post("/jobs", json=wide_then_slow())
        assert response.status_code == 201, response.text
        job_id = response.json()["id"]
        wait_until(lambda: status(pid)["VmRSS"] - baseline > WIDE_BYTES, 120, "the wide layers' weights")
        assert client.delete(f"/jobs/{job_id}").status_code == 202
        job = stack.wait_for_state(client, job_id, {"succeeded", "failed", "canceled"}, timeout=60)
        assert job["error"] == {"reason": "canceled", "message": "Canceled while building the model."}, job
        wait_until(lambda: stack.redis.client().hget(f"rq:worker:{socket.gethostname()}.{pid}", "state") == "idle",
                   60, "the worker to be idle")
        after = status(pid)
        assert after["VmHWM"] - baseline > WIDE_BYTES, (baseline, after)
        assert after["VmRSS"] - baseline < MARGIN, f"idle {after['VmRSS'] / MIB:.0f} MiB after a canceled job, " \
                                                   f"{baseline / MIB:.0f} MiB before"
