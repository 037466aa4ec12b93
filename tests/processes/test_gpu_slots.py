"""One job slot per GPU (worker/service/slots.py): given two GPUs on this CPU machine (HOST_GPUS), one
`python -m worker` runs a slot per GPU, each its own process pinned with CUDA_VISIBLE_DEVICES, two jobs
at once; a SIGKILLed slot is restarted and its job resumes; SIGTERM stops every slot after its job."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from scripts.stack import Stack, freeze_mid_run, private_stack, wait_until

LEASE_S, REAP_INTERVAL_S = 3.0, 1.0
ENDLESS = {"model": {"name": "mlp"}, "precision_policy": "float32", "dataset": {"samples": 64},
           "training": {"steps": 10_000_000}}
"""Still running whenever the test looks: canceled once it has what it needs."""
SHORT = {"model": {"name": "mlp"}, "precision_policy": "float32", "dataset": {"samples": 256},
         "training": {"steps": 120, "checkpoint_every": 20}}
TERMINAL = {"succeeded", "failed", "canceled"}

Slots = tuple[Stack, "subprocess.Popen[bytes]"]


@pytest.fixture(scope="module")
def slots(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Slots]:
    with private_stack(tmp_path_factory.mktemp("slots"), workers=0, LEASE_S=str(LEASE_S),
                       REAP_INTERVAL_S=str(REAP_INTERVAL_S)) as stack:
        yield stack, stack.start_supervisor("0,1")


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(entry.decode().split("=", 1) for entry in raw if b"=" in entry)


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def assert_pinned(job: dict[str, Any], supervisor: subprocess.Popen[bytes]) -> str:
    """The job ran in a slot of `supervisor` pinned to exactly the GPU it recorded; returns that GPU."""
    (gpu,) = job["worker"]["gpus"]
    pid = job["worker"]["pid"]
    assert parent(pid) == supervisor.pid
    env = environ(pid)
    assert env["CUDA_VISIBLE_DEVICES"] == gpu and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    return str(gpu)


def test_one_slot_per_gpu_runs_two_jobs_at_once_each_pinned_to_its_gpu(slots: Slots) -> None:
    stack, supervisor = slots
    assert "tensorflow" not in Path(f"/proc/{supervisor.pid}/maps").read_text(), "TensorFlow loads in slots only"
    with stack.client() as client:
        ids = [client.post("/jobs", json=ENDLESS).json()["id"] for _ in range(2)]
        try:
            def both_running() -> list[dict[str, Any]] | None:
                jobs = [client.get(f"/jobs/{job_id}").json() for job_id in ids]
                return jobs if all(job["state"] == "running" for job in jobs) else None

            jobs = wait_until(both_running, 120, "both jobs running at once", interval=0.1)
            assert sorted(assert_pinned(job, supervisor) for job in jobs) == ["0", "1"]
            host = jobs[0]["worker"]["host"]
            assert sorted(stack.slot_names()) == sorted(
                f"{host}.{job['worker']['pid']}.gpu{job['worker']['gpus'][0]}" for job in jobs)
            for job in jobs:
                assert f", GPU {job['worker']['gpus'][0]})" in job["transitions"][1]["message"]
        finally:
            for job_id in ids:
                client.delete(f"/jobs/{job_id}")
            for job_id in ids:
                stack.wait_for_state(client, job_id, TERMINAL)


def test_a_killed_slot_is_restarted_and_its_job_resumes(slots: Slots) -> None:
    stack, supervisor = slots
    with stack.client() as client:
        job_id, pid, spec = freeze_mid_run(stack, client, SHORT, past_step=30)
        gpu = assert_pinned(client.get(f"/jobs/{job_id}").json(), supervisor)
        os.killpg(pid, signal.SIGKILL)

        def restarted() -> int | None:
            pids = [int(name.split(".")[-2]) for name in stack.slot_names() if name.endswith(f".gpu{gpu}")]
            return next((p for p in pids if p != pid and parent(p) == supervisor.pid), None)

        new_pid = wait_until(restarted, 60, f"the slot of GPU {gpu} to be restarted")
        assert environ(new_pid)["CUDA_VISIBLE_DEVICES"] == gpu
        job = stack.wait_for_state(client, job_id, TERMINAL)
        assert job["state"] == "succeeded", job["error"]
        assert job["attempt"] == 2 and "resuming from step" in job["transitions"][3]["message"]
        assert job["summary"]["steps_done"] == spec["training"]["steps"]
        assert_pinned(job, supervisor)
    log = (stack.logs / "worker0.log").read_text()
    assert f"slot gpu{gpu} (pid {pid}) died with signal SIGKILL" in log


def test_a_slot_with_two_gpus_takes_the_jobs_on_two_devices(slots: Slots) -> None:
    stack, _ = slots
    # GPUs 2 and 3 as one slot; on this CPU machine its two devices are the CPU split in two.
    pair = stack.start_supervisor("2,3", WORKER_GPUS="2+3", CPU_LOGICAL_DEVICES="2")
    try:
        with stack.client() as client:
            spec = {**SHORT, "training": {"steps": 6, "batch_size": 16, "devices": 2}}
            job_id = client.post("/jobs", json=spec).json()["id"]
            job = stack.wait_for_state(client, job_id, TERMINAL)
            assert job["state"] == "succeeded", job["error"]
            assert job["queue"].endswith("-x2") and job["worker"]["gpus"] == ["2", "3"]
            assert parent(job["worker"]["pid"]) == pair.pid  # not one of the one-GPU slots listening beside it
            assert environ(job["worker"]["pid"])["CUDA_VISIBLE_DEVICES"] == "2,3"
            assert [p["step"] for p in client.get(f"/jobs/{job_id}/metrics").json()["points"]] == list(range(1, 7))
    finally:
        pair.send_signal(signal.SIGTERM)
        assert pair.wait(60) == 0


def test_sigterm_lets_each_slot_finish_its_job_then_stops_them_all(slots: Slots) -> None:
    stack, supervisor = slots
    with stack.client() as client:
        job_id, pid, _ = freeze_mid_run(stack, client, SHORT, past_step=10)
        children = [int(name.split(".")[-2]) for name in stack.slot_names()
                    if Path(f"/proc/{name.split('.')[-2]}").exists()]
        supervisor.send_signal(signal.SIGTERM)
        # Forwarded to the frozen slot too: it takes the signal as it resumes, mid-job.
        wait_until(lambda: (stack.logs / "worker0.log").read_text().count("SIGTERM to slot") >= 2, 10,
                   "the supervisor to forward SIGTERM to both slots")
        os.killpg(pid, signal.SIGCONT)
        assert supervisor.wait(60) == 0
        job = client.get(f"/jobs/{job_id}").json()
        assert job["state"] == "succeeded" and job["attempt"] == 1, "a warm shutdown finishes the job"
        assert not [p for p in children if Path(f"/proc/{p}").exists()], "every slot has exited"
