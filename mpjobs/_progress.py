"""Live progress of a job: a redrawn bar on a terminal, plain lines in a log, an updating output in Jupyter."""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TextIO

from mpjobs._reading import member
from mpjobs.contract.formats import duration, num, scale_num
from mpjobs.contract.jobs import JobState

REDRAW_INTERVAL_S = 0.1
"""A terminal progress bar redraws at most this often; faster is flicker, not information."""
RATE_WINDOW = 50
"""ETA comes from the step rate over this many recent steps, so warm-up does not skew it."""
PHASE_AFTER_S = 1.0
"""With no step for this long, the view asks what the job is doing (its `phase`), then once a second."""


class ProgressView:
    """Live progress on stderr: a redrawn bar on a terminal, plain lines every `interval` s otherwise.

    A thread of its own draws the latest step once a burst of records has stopped arriving (a
    redraw is never owed until the next record or the end), and, while no step comes, what the
    job does instead (`phase_of()`: "measuring speed against float32", "building the model").
    """

    def __init__(self, out: TextIO, total: int, interval: float,
                 phase_of: Callable[[], str | None] | None = None) -> None:
        self.out, self.total, self.interval, self.phase_of = out, total, interval, phase_of
        self.tty = out.isatty()
        self.recent: deque[tuple[float, int]] = deque(maxlen=RATE_WINDOW)
        self.record: dict[str, Any] | None = None
        self.shown_at = float("-inf")
        self.shown_step = 0
        self.closed = False
        self.ending = ""
        self.phase: str | None = None
        self.shown_phase: str | None = None
        self.heard_at = time.monotonic()
        self._lock = threading.RLock()
        self._stopped = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="progress", daemon=True)
        self._ticker.start()

    def step(self, record: dict[str, Any]) -> None:
        with self._lock:
            self.record, self.phase, self.heard_at = record, None, time.monotonic()
            self.recent.append((record["time"], record["step"]))
            if time.monotonic() - self.shown_at >= self._every:
                self._show()

    @property
    def _every(self) -> float:
        return REDRAW_INTERVAL_S if self.tty else self.interval

    def _tick(self) -> None:
        asked_at = float("-inf")
        while not self._stopped.wait(min(self._every, PHASE_AFTER_S)):
            now = time.monotonic()
            if self.phase_of is not None and now - self.heard_at >= PHASE_AFTER_S and now - asked_at >= 1.0:
                asked_at = now
                try:
                    phase = self.phase_of()
                except Exception:  # noqa: BLE001  the stream's own reconnects report a lost API
                    phase = None
                with self._lock:
                    if now >= self.heard_at:  # no step arrived meanwhile
                        self.phase = None if phase == "training" else phase
            with self._lock:
                if self.closed:
                    return
                owed = self.record is not None and self.record["step"] != self.shown_step
                if (owed and now - self.shown_at >= self._every) or self.phase != self.shown_phase:
                    self._show()

    def state(self, state: str, message: str) -> None:
        line = f"state: {state}" + (f" ({message})" if message else "") + "\n"
        with self._lock:
            if member(JobState, state).terminal:
                self.ending = line  # after the last steps, which may still be on their way
                return
            self._clear()
            self.out.write(line)
            if self.tty and self.record:
                self._show()
            self.out.flush()

    def close(self) -> None:
        self._stopped.set()
        with self._lock:
            if self.closed:
                return
            self.closed = True
            if self.record and self.record["step"] != self.shown_step:
                self._show()
            if self.tty and (self.record or self.shown_phase):
                self.out.write("\n")
            self.out.write(self.ending)
            self.out.flush()

    def _clear(self) -> None:
        if self.tty and self.record:
            self.out.write("\r\x1b[K")

    def _show(self) -> None:
        r, phase = self.record, self.phase
        if r is None:  # no step yet: only what the job is doing
            if phase != self.shown_phase and phase is not None:
                self.out.write(f"\r\x1b[K{phase}…" if self.tty else f"phase: {phase}\n")
                self.out.flush()
            self.shown_phase = phase
            return
        step, total = r["step"], self.total
        (t0, s0), (t1, s1) = self.recent[0], self.recent[-1]
        eta = f"ETA {duration((total - step) * (t1 - t0) / (s1 - s0))}" if s1 > s0 and t1 > t0 else "ETA -"
        stats = (f"{step}/{total} {step / total:4.0%}  loss {num(r['loss'])}  scale {scale_num(r['loss_scale'])}  "
                 f"grad norm {num(r['grad_norm'])}" + ("  skipped" if r["skipped"] else ""))
        if self.tty:
            done = round(24 * min(step / total, 1.0))
            self.out.write(f"\r\x1b[K[{'#' * done}{'.' * (24 - done)}] {stats}  {f'{phase}…' if phase else eta}")
        elif step != self.shown_step:
            self.out.write(f"step {stats}  {eta}\n")
        if not self.tty and phase != self.shown_phase and phase is not None:
            self.out.write(f"phase: {phase}\n")
        self.out.flush()
        self.shown_at, self.shown_step, self.shown_phase = time.monotonic(), step, phase


def in_notebook() -> bool:
    """Whether this runs in a Jupyter kernel (IPython over ZMQ), without importing IPython when it is not loaded."""
    ipython = sys.modules.get("IPython")
    shell = getattr(ipython, "get_ipython", lambda: None)() if ipython is not None else None
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


class NotebookOut:
    """A stand-in terminal for `ProgressView` in Jupyter: what a terminal would show (the finished lines, then
    the line being redrawn after its last carriage return) goes to one output, `handle`, updated in place
    (an IPython `DisplayHandle`: anything with `update(data, raw=True)`)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.lines: list[str] = []
        self.current = ""

    def isatty(self) -> bool:
        return True

    def write(self, text: str) -> int:
        for i, part in enumerate(text.replace("\x1b[K", "").split("\n")):
            if i:
                self.lines.append(self.current)
                self.current = ""
            self.current = part.rsplit("\r", 1)[-1] if "\r" in part else self.current + part
        return len(text)

    @property
    def text(self) -> str:
        return "\n".join([*self.lines, self.current]).rstrip("\n")

    def flush(self) -> None:
        self.handle.update({"text/plain": self.text}, raw=True)


def progress_view(total: int, phase_of: Callable[[], str | None] | None = None, interval: float = 5.0
                  ) -> ProgressView:
    """The view for where this runs: Jupyter's output, else stderr (a bar on a terminal, lines every `interval` s)."""
    out: Any = sys.stderr
    if in_notebook():
        from IPython.display import display  # loaded already: this runs in its kernel

        out = NotebookOut(display({"text/plain": ""}, raw=True, display_id=True))
    return ProgressView(out, total, interval, phase_of)
