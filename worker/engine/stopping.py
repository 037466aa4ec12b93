"""Stopping an attempt: its time limit, and an interrupt between steps by a flag or anywhere by an exception.

A cancel or the time limit stops training after the current call (one step, or several:
worker/engine/stepper.py), with a checkpoint (worker/callbacks/stop_control.py). The rest of an
attempt has no step to stop after: loading a model config (a hostile 1,500-layer Sequential held a
worker for minutes), preparing the data, building the float32 twin, the speed check's models. There
the attempt's watcher raises `Interrupted` in the job's thread with CPython's
`PyThreadState_SetAsyncExc`. It lands at the next bytecode that thread runs: within
microseconds in Python code, and after the running op in TensorFlow's C++ code.

Only inside `Interrupter`'s `with` block, which holds the engine's work and never the
bookkeeping around it (draining step records, recording how the attempt ended): an
interrupt requested as the block ends is withdrawn, so it can never land there.

>>> set_phase("building the model"); current_phase()
'building the model'
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType

from app.core.config import Settings
from mpjobs.contract.spec import JobSpec

log = logging.getLogger("mpjobs.worker")

_phase = "starting"


def set_phase(name: str) -> None:
    """What the attempt is doing now, in words ("building the model"): read by its watcher, which
    publishes it with the job and names it when the attempt is stopped there."""
    global _phase
    _phase = name


def current_phase() -> str:
    return _phase


@contextmanager
def phase(name: str) -> Iterator[None]:
    """`name` for the duration of the block, then the phase before it."""
    before = current_phase()
    set_phase(name)
    try:
        yield
    finally:
        set_phase(before)


class Interrupted(BaseException):
    """Raised in an attempt's thread to stop it where it is. A BaseException, so that no
    `except Exception` in the engine, Keras or TensorFlow takes it for an error and goes on."""


class CancelInterrupt(Interrupted):
    """The job was canceled, and the attempt did not stop by itself within the grace period."""


class DeadlineInterrupt(Interrupted):
    """The attempt ran past its time limit, and did not stop by itself within the grace period."""


class Interrupter:
    """Raises an `Interrupted` in the thread that entered it, from any other thread, while inside."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread_id: int | None = None
        self.sent: type[Interrupted] | None = None
        """The interrupt raised in the thread, if one was."""
        self.where = ""
        """The phase the thread was in when it was sent (`current_phase()` then)."""

    def __enter__(self) -> Interrupter:
        with self._lock:
            self._thread_id, self.sent = threading.get_ident(), None
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        with self._lock:
            thread_id, self._thread_id = self._thread_id, None
            if thread_id is not None and self.sent is not None:
                _async_raise(thread_id, None)  # withdrawn if still pending: it must not land after the block

    @property
    def inside(self) -> bool:
        return self._thread_id is not None

    def interrupt(self, kind: type[Interrupted]) -> bool:
        """Raise `kind` in the thread inside, once. False when none is inside or one was already sent."""
        with self._lock:
            if self._thread_id is None or self.sent is not None:
                return False
            self.sent, self.where = kind, current_phase()
            _async_raise(self._thread_id, kind)
            return True


def _async_raise(thread_id: int, kind: type[BaseException] | None) -> None:
    """Raise `kind` in the thread at its next bytecode; None withdraws one still pending."""
    exc = ctypes.py_object(kind) if kind is not None else None  # None: NULL, which withdraws
    if ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), exc) > 1:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), None)
        raise SystemError("PyThreadState_SetAsyncExc reached more than one thread")


@dataclass(frozen=True)
class TimeLimit:
    """How long an attempt may run, from the moment its worker took it, and which setting said so.

    >>> limit = TimeLimit.of(JobSpec.model_validate({"model": {"name": "mlp"}}), Settings(max_job_seconds=60))
    >>> limit.seconds, limit.source
    (60, 'MAX_JOB_SECONDS')
    """

    seconds: int
    source: str
    """`training.max_seconds`, or `MAX_JOB_SECONDS` (the deployment's) when the spec sets none or more."""
    deadline: float
    """On `time.monotonic()`'s clock."""

    @classmethod
    def of(cls, spec: JobSpec, settings: Settings, started: float | None = None) -> TimeLimit:
        asked = spec.training.max_seconds
        if asked is not None and asked <= settings.max_job_seconds:
            seconds, source = asked, "training.max_seconds"
        else:
            seconds, source = settings.max_job_seconds, "MAX_JOB_SECONDS"
        return cls(seconds, source, (time.monotonic() if started is None else started) + seconds)

    def passed(self) -> bool:
        return time.monotonic() > self.deadline

    def message(self, where: str) -> str:
        """Why the attempt ended, e.g. where="at step 40 of 100"."""
        return f"The time limit ran out {where}: {self.source}={self.seconds} s per attempt."
