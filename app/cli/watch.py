"""Following jobs live: the SSE stream with reconnects, the progress bar, and comparison polling."""

from __future__ import annotations

import json
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TextIO

import httpx

from app.cli.api import Api
from app.cli.errors import CliError, Exit, exit_for
from app.cli.words import duration, num, scale_num, summary_lines
from app.core.job import JobState

REDRAW_INTERVAL_S = 0.1
"""A terminal progress bar redraws at most this often; faster is flicker, not information."""
RATE_WINDOW = 50
"""ETA comes from the step rate over this many recent steps, so warm-up does not skew it."""
GIVE_UP_S = 60.0
"""`watch` stops retrying once the API has been unreachable this long."""
POLL_INTERVAL_S = 1.0
"""How often `compare --watch` and `cancel --wait` read the state."""
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
            if JobState(state).terminal:
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


def follow(api: Api, job: dict[str, Any], view: ProgressView) -> None:
    """Show the job's stream until `end`, reconnecting after the last step seen when it drops."""
    after = max(0, job["progress"]["step"] - 1)
    seen: set[tuple[str, str]] = set()
    heard = time.monotonic()
    while True:
        try:
            for event, data in api.events(job["id"], after):
                heard = time.monotonic()
                payload = json.loads(data)
                if event == "metrics":
                    after = payload["step"]
                    view.step(payload)
                elif event == "state" and (payload["state"], payload["at"]) not in seen:
                    seen.add((payload["state"], payload["at"]))
                    view.state(payload["state"], payload.get("message", ""))
                elif event == "end":
                    return
        except httpx.ReadTimeout:
            heard = time.monotonic()  # a quiet stream (a queued job), not a lost API
            continue
        except (httpx.TransportError, CliError) as exc:
            if isinstance(exc, CliError) and exc.code != Exit.UNAVAILABLE:
                raise
            if time.monotonic() - heard > GIVE_UP_S:
                raise CliError(Exit.UNAVAILABLE, f"lost the API at {api.url} for {GIVE_UP_S:.0f} s: {exc}") from exc
        time.sleep(0.5)  # the stream ended early or failed: reopen it after the last step seen


def watch(api: Api, job_id: str, interval: float) -> int:
    job = api.call("GET", f"/jobs/{job_id}")
    view = ProgressView(sys.stderr, job["progress"]["total_steps"], interval,
                        phase_of=lambda: api.call("GET", f"/jobs/{job_id}").get("phase"))
    if job.get("waiting_reason"):
        print(f"waiting: {job['waiting_reason']}", file=sys.stderr)
    try:
        if not JobState(job["state"]).terminal:
            follow(api, job, view)
            job = api.call("GET", f"/jobs/{job_id}")
    except KeyboardInterrupt:
        raise CliError(Exit.INTERRUPTED, f"stopped watching; job {job_id} keeps running. "
                                         f"Cancel it with: mpjobs cancel {job_id}") from None
    finally:
        view.close()
    print("\n".join(summary_lines(job)))
    return exit_for(job["state"])


def watch_comparison(api: Api, comparison_id: str) -> dict[str, Any]:
    states: dict[str, str] = {}
    tty = sys.stderr.isatty()
    try:
        while True:
            c: dict[str, Any] = api.call("GET", f"/comparisons/{comparison_id}")
            if tty:
                sys.stderr.write("\r\x1b[K")
            for v in c["variants"]:
                if states.get(v["label"]) != v["state"]:
                    states[v["label"]] = v["state"]
                    sys.stderr.write(f"{v['label']}: {v['state']}\n")
            if c["state"] == "done":
                return c
            if tty:
                sys.stderr.write("  ".join(f"{v['label']} {v['progress']['step']}/{v['progress']['total_steps']}"
                                           for v in c["variants"]))
            sys.stderr.flush()
            time.sleep(POLL_INTERVAL_S)
    except KeyboardInterrupt:
        raise CliError(Exit.INTERRUPTED, f"stopped watching; comparison {comparison_id} keeps running. See it "
                                         f"with: mpjobs compare --show {comparison_id}; cancel a variant with: "
                                         "mpjobs cancel JOB") from None
