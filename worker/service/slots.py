"""The supervisor: one job slot per GPU, each a `python -m worker --slot GPU` process pinned to it.

Docker gives every replica of a scaled service the same GPU, so one worker per host starts a
slot per chosen GPU instead (worker/service/gpus.py), with CUDA_VISIBLE_DEVICES set to that GPU. Slots
are spawned, never forked, and this process never loads TensorFlow. A slot that dies is
restarted after a backoff; its job, whose lease then runs out, is requeued by any worker's
reaper and resumed from its checkpoint, as for any dead worker. SIGTERM and SIGINT are
forwarded to every slot (the first: RQ's warm shutdown, each slot finishes its job; a second:
cold), and the supervisor exits once they all have.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import FrameType

log = logging.getLogger("mpjobs.worker")

RESTART_BACKOFF_S = 1.0
"""The wait before a dead slot is restarted; doubled for each death in a row, up to RESTART_BACKOFF_MAX_S."""
RESTART_BACKOFF_MAX_S = 60.0
"""A slot that dies at start-up (a broken driver, Redis refusing it) is retried once a minute, no faster."""
STABLE_S = 60.0
"""A slot that lived this long before it died starts again from RESTART_BACKOFF_S."""
POLL_S = 0.2
"""How often the supervisor looks at its slots and forwards the signals it received."""
PR_SET_PDEATHSIG = 1


@dataclass
class Slot:
    """One GPU's worker process, and when to start it again."""

    gpu: str
    process: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    deaths_in_a_row: int = 0
    restart_at: float | None = None
    forwarded: int = 0
    """How many of the supervisor's received signals this process has been sent: a slot started
    as a signal arrives still gets it."""


class Supervisor:
    """Runs and restarts one slot per GPU until SIGTERM or SIGINT; `burst`: until every slot
    has emptied the queues and exited 0."""

    def __init__(self, gpus: Sequence[str], burst: bool = False, command: Sequence[str] | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        self.slots = [Slot(gpu) for gpu in gpus]
        self.burst = burst
        self.command = list(command or [sys.executable, "-m", "worker"])
        self.env = dict(os.environ if env is None else env)
        self.received: list[int] = []

    def run(self) -> int:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_signal)
        for slot in self.slots:
            self._start(slot)
        while any(slot.process is not None or slot.restart_at is not None for slot in self.slots):
            now = time.monotonic()
            for slot in self.slots:
                self._tend(slot, now)
            time.sleep(POLL_S)
        log.info("supervisor: every slot has stopped")
        return 0

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signum)  # forwarded by the loop, which also reaches a slot started meanwhile

    def _tend(self, slot: Slot, now: float) -> None:
        if slot.process is not None:
            while slot.forwarded < len(self.received):
                self._send(slot, self.received[slot.forwarded])
                slot.forwarded += 1
            code = slot.process.poll()
            if code is not None:
                self._ended(slot, code, now)
        if self.received:
            slot.restart_at = None  # asked to stop: nothing is started again
        elif slot.restart_at is not None and now >= slot.restart_at:
            self._start(slot)

    def _send(self, slot: Slot, signum: int) -> None:
        assert slot.process is not None
        log.info("supervisor: %s to slot gpu%s (pid %d)", signal.Signals(signum).name, slot.gpu, slot.process.pid)
        try:
            slot.process.send_signal(signum)
        except ProcessLookupError:
            pass  # it died meanwhile; the next poll sees it

    def _ended(self, slot: Slot, code: int, now: float) -> None:
        assert slot.process is not None
        pid, lived = slot.process.pid, now - slot.started_at
        slot.process = None
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        if self.received or (self.burst and code == 0):
            log.info("supervisor: slot gpu%s (pid %d) stopped with %s", slot.gpu, pid, how)
            return
        slot.deaths_in_a_row = 1 if lived >= STABLE_S else slot.deaths_in_a_row + 1
        delay = min(RESTART_BACKOFF_S * 2 ** (slot.deaths_in_a_row - 1), RESTART_BACKOFF_MAX_S)
        slot.restart_at = now + delay
        log.warning("supervisor: slot gpu%s (pid %d) died with %s after %.1f s (%d in a row); restarting it "
                    "in %.0f s; a job it held is requeued once its lease runs out",
                    slot.gpu, pid, how, lived, slot.deaths_in_a_row, delay)

    def _start(self, slot: Slot) -> None:
        env = {**self.env, "CUDA_VISIBLE_DEVICES": slot.gpu, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
        command = [*self.command, "--slot", slot.gpu, *(["--burst"] if self.burst else [])]
        # A session of its own: a terminal's Ctrl+C reaches the supervisor only, which forwards it.
        slot.process = subprocess.Popen(command, env=env, start_new_session=True, preexec_fn=_die_with_parent)
        slot.started_at, slot.restart_at, slot.forwarded = time.monotonic(), None, 0
        log.info("supervisor: slot gpu%s started (pid %d, CUDA_VISIBLE_DEVICES=%s)",
                 slot.gpu, slot.process.pid, slot.gpu)


def _die_with_parent() -> None:
    """In the slot, before exec: a warm shutdown (SIGTERM) if the supervisor itself is killed, so no
    slot outlives it. Linux only; elsewhere a slot outlives a SIGKILLed supervisor."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
