"""The attempt's watcher thread: cancel polls, lease renewals, the phase, and interrupts past a grace period."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from app.store import JobStore
from worker.engine.stopping import (
    CancelInterrupt,
    DeadlineInterrupt,
    Interrupted,
    Interrupter,
    TimeLimit,
    current_phase,
)

log = logging.getLogger("mpjobs.worker")

CANCEL_POLL_S = 0.25
"""How often a running job checks for a cancel request; a cancel lands within this plus one step."""
LEASE_RENEWALS = 6
"""Renewals per lease period: a lease survives several missed renewals (a GC pause, a Redis blip)."""
GRACEFUL_PHASES = frozenset({"training", "saving", "saving the model", "measuring speed against float32"})
"""Phases that stop by themselves when asked (after the step, with a checkpoint; between speed-check
pieces) or end soon. Outside them (building the model, preparing the data, restoring a checkpoint)
a cancel or the time limit interrupts the attempt at once."""
CANCEL_GRACE_S = 2.0
"""A canceled attempt in a graceful phase that has not stopped this long after the request is interrupted."""
DEADLINE_GRACE_S = 10.0
"""Likewise past its time limit; longer, so that a long step in progress can end and be checkpointed."""
STUCK_S = 60.0
"""An interrupted attempt still running this long after (one C++ call that never returns) ends
the worker process: its job is recorded as ended first, and the supervisor or the container's
restart policy starts a fresh worker."""


class AttemptWatcher:
    """On a thread: polls the cancel flag, renews the attempt's lease and publishes its phase, so the
    training step never waits on Redis and a dead worker's lease runs out. A cancel or the time
    limit the attempt does not honour by itself within a grace period is raised in its thread
    (worker/engine/stopping.py); one it still does not honour ends the process (`on_stuck`)."""

    def __init__(self, store: JobStore, job_id: str, owner: str, lease_s: float, limit: TimeLimit | None = None,
                 interrupter: Interrupter | None = None,
                 on_stuck: Callable[[type[Interrupted]], None] | None = None) -> None:
        self.store, self.job_id, self.owner, self.lease_s = store, job_id, owner, lease_s
        self.limit, self.interrupter, self.on_stuck = limit, interrupter, on_stuck
        self.cancel_requested = threading.Event()
        self._canceled_at: float | None = None
        self._interrupted_at: float | None = None
        self._published_phase: str | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"attempt-{job_id}", daemon=True)

    def _watch(self) -> None:
        renew_every, renewed = self.lease_s / LEASE_RENEWALS, time.monotonic()
        failing = False
        while not self._done.wait(CANCEL_POLL_S):
            self._enforce()  # first, and without Redis: a Redis outage must not shield a stuck attempt
            try:
                if time.monotonic() - renewed >= renew_every:
                    self.store.leases.renew_lease(self.job_id, self.owner, self.lease_s)
                    renewed = time.monotonic()
                if not self.cancel_requested.is_set() and self.store.cancels.cancel_requested(self.job_id):
                    self.store.cancels.acknowledge_cancel(self.job_id, self.owner)  # else the API presumes it dead
                    self._canceled_at = time.monotonic()
                    self.cancel_requested.set()
                now_phase = current_phase()
                if now_phase != self._published_phase:
                    self.store.jobs.set_fields(self.job_id, phase=now_phase)
                    self._published_phase = now_phase
                failing = False
            except Exception as exc:  # A Redis blip must not kill training; try again next poll.
                if not failing:
                    log.warning("attempt watch for %s failing, retrying: %s", self.job_id, exc)
                failing = True

    def _enforce(self) -> None:
        """Interrupt an attempt past its grace period; end the process if that did not stop it."""
        if self.interrupter is None:
            return
        now = time.monotonic()
        if self._interrupted_at is not None:
            if self.interrupter.inside and now - self._interrupted_at > STUCK_S and self.on_stuck is not None:
                assert self.interrupter.sent is not None
                self.on_stuck(self.interrupter.sent)
            return
        graceful = current_phase() in GRACEFUL_PHASES
        kind: type[Interrupted] | None = None
        if self._canceled_at is not None and now - self._canceled_at > (CANCEL_GRACE_S if graceful else 0):
            kind = CancelInterrupt
        elif self.limit is not None and now > self.limit.deadline + (DEADLINE_GRACE_S if graceful else 0):
            kind = DeadlineInterrupt
        if kind is not None and self.interrupter.interrupt(kind):
            self._interrupted_at = now
            log.warning("job %s: %s while %s; interrupted", self.job_id,
                        "canceled" if kind is CancelInterrupt else "out of time", self.interrupter.where)

    def __enter__(self) -> AttemptWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
