"""Which GPUs get a slot (worker/service/gpus.py), and the supervisor's restarts (worker/service/slots.py).

The slots are stand-ins."""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from worker.service import gpus, slots
from worker.service.gpus import chosen_gpus, host_gpus, pinned_gpus
from worker.service.slots import Supervisor

SLOT = """
import os, pathlib, sys
gpu = sys.argv[sys.argv.index("--slot") + 1]
runs = pathlib.Path(os.environ["SLOT_OUT"]) / f"gpu{gpu}"
before = runs.read_text() if runs.exists() else ""
runs.write_text(before + f"{os.environ['CUDA_VISIBLE_DEVICES']} {os.environ['CUDA_DEVICE_ORDER']} {sys.argv[1:]}\\n")
sys.exit(3 if gpu == "1" and not before else 0)
"""
"""A stand-in slot: records what it was given; GPU 1's first run dies (exit code 3)."""


def test_all_takes_every_gpu_of_the_host_and_a_list_takes_those() -> None:
    assert chosen_gpus("all", "0,1,2") == ["0", "1", "2"]
    assert chosen_gpus("all", "none") == []
    assert chosen_gpus(" 2, 0 ", ["0", "1", "2"]) == ["2", "0"]


EXPECTED = ("Expected `all`, or GPU indices such as `0,1` (a slot each), `0+1` for one slot with both, each GPU "
            "once.")


def test_a_slot_can_hold_several_gpus() -> None:
    assert chosen_gpus("0+1,3", "0,1,2,3") == ["0,1", "3"]
    assert chosen_gpus("2+0", ["0", "1", "2"]) == ["2,0"]


@pytest.mark.parametrize(("worker_gpus", "message"), [
    ("3", "WORKER_GPUS=3 names GPU 3, which this host does not have. Expected `all` or some of its GPUs: 0, 1"),
    ("0,0", f"{EXPECTED} Received: WORKER_GPUS=0,0"),
    ("0+1,1", f"{EXPECTED} Received: WORKER_GPUS=0+1,1"),
    ("gpu0", "Expected `all` or distinct GPU indices such as `0,1`. Received: WORKER_GPUS=gpu0"),
    ("none", f"{EXPECTED} Received: WORKER_GPUS=none"),
])
def test_a_worker_gpus_the_host_cannot_give_is_refused_by_name(worker_gpus: str, message: str) -> None:
    with pytest.raises(ValueError) as error:
        chosen_gpus(worker_gpus, "0,1")
    assert str(error.value) == message


def test_nvidia_smi_answers_when_no_gpus_are_injected(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "nvidia-smi"
    fake.write_text('#!/bin/sh\n[ "$*" = "--query-gpu=index --format=csv,noheader" ] && printf "0\\n1\\n"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert host_gpus() == ["0", "1"]
    assert host_gpus("3") == ["3"], "injected GPUs win over detection"


def test_a_host_without_nvidia_smi_or_driver_has_no_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(gpus, "NVIDIA_DRIVER", tmp_path / "no-driver")
    assert host_gpus() == []


def test_the_pinned_gpus_are_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert pinned_gpus() == []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert pinned_gpus() == ["1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert pinned_gpus() == []


@pytest.fixture
def handlers() -> Iterator[None]:
    """Supervisor.run installs SIGTERM and SIGINT handlers: pytest gets its own back."""
    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


@pytest.mark.processes
@pytest.mark.usefixtures("handlers")
def test_each_slot_is_pinned_to_its_gpu_and_a_dead_one_is_restarted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(slots, "RESTART_BACKOFF_S", 0.05)
    script = tmp_path / "slot.py"
    script.write_text(SLOT)
    supervisor = Supervisor(["0", "1"], burst=True, command=[sys.executable, str(script)],
                            env={"SLOT_OUT": str(tmp_path), "PATH": "/usr/bin:/bin"})
    with caplog.at_level(logging.INFO, logger="mpjobs.worker"):
        assert supervisor.run() == 0
    assert (tmp_path / "gpu0").read_text() == "0 PCI_BUS_ID ['--slot', '0', '--burst']\n"
    assert (tmp_path / "gpu1").read_text() == "1 PCI_BUS_ID ['--slot', '1', '--burst']\n" * 2
    died = [r.getMessage() for r in caplog.records if "died" in r.getMessage()]
    assert len(died) == 1 and died[0].startswith("supervisor: slot gpu1 (pid ")
    assert "died with exit code 3 after" in died[0] and "(1 in a row); restarting it in 0 s" in died[0]


def test_backoff_doubles_for_each_death_in_a_row_up_to_a_minute() -> None:
    supervisor, slot = Supervisor(["0"]), slots.Slot("0")
    delays = []
    for _ in range(8):
        slot.process, slot.started_at = _Exited(), 100.0
        supervisor._ended(slot, 1, now=101.0)
        assert slot.restart_at is not None
        delays.append(slot.restart_at - 101.0)
    assert delays == [1, 2, 4, 8, 16, 32, 60, 60]
    slot.process, slot.started_at = _Exited(), 0.0
    supervisor._ended(slot, -9, now=slots.STABLE_S)
    assert slot.restart_at == slots.STABLE_S + 1, "a slot that had lived a minute starts over at 1 s"


class _Exited:
    pid = 4242
