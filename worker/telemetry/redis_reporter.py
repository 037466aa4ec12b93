"""RedisReporter: step records, layer checks, evaluations, rollups, progress and the summary into Redis.

Training never waits for Redis: while Redis is unreachable (a restart, a
failover) records and layer checks stay pending in memory and go out with the
next batch. A batch that was half written before the connection dropped is safe
to resend: a step id Redis already has is refused, and counted as written.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence

from app.store import JobStore
from app.store.connect import UNAVAILABLE
from app.store.rollup import ROLLUP_STEPS, Rollup
from mpjobs.contract.records import EvalRecord, LayerCheck, StepRecord, Summary

log = logging.getLogger("mpjobs.worker")

DURABLE_AFTER_S = 2.0
"""Redis with AOF `everysec` has a write on disk within about a second: one acknowledged this long ago
survives a crash of Redis, and a checkpoint at or below it is the oldest a resumed attempt may need."""



class RedisReporter:
    """Writes each batch of records, with the layer checks handed over before it, in one pipelined
    round trip (XADD per step and per check)."""

    def __init__(self, store: JobStore, job_id: str, durable: int = 0) -> None:
        self.store, self.job_id = store, job_id
        self._durable = durable
        self._acknowledged: deque[tuple[float, int]] = deque()
        """(time.monotonic(), step) of each batch Redis acknowledged and `durable` has not yet passed."""
        self.partial = self._resume_partial()
        self.pending: list[StepRecord] = []
        self.pending_rollups: list[tuple[int, Rollup]] = []
        self.pending_layers: list[LayerCheck] = []
        self.pending_evaluations: list[EvalRecord] = []
        self.outage = False
        self.counted: set[str] = set()
        """Diagnosis codes already counted in the store's stats."""

    def _resume_partial(self) -> Rollup:
        """Rebuild the unfinished rollup from steps already stored (a resumed attempt)."""
        partial = Rollup()
        for record in self.store.streams.unrolled_steps(self.job_id):
            partial.add(record)
        return partial

    def steps(self, records: Sequence[StepRecord]) -> None:
        for record in records:
            self.partial.add(record.model_dump())
            if record.step % ROLLUP_STEPS == 0:
                self.pending_rollups.append((record.step // ROLLUP_STEPS, self.partial))
                self.partial = Rollup()
        self.pending.extend(records)
        try:
            self._send()
        except UNAVAILABLE as exc:
            if not self.outage:
                log.warning("redis unavailable, holding %d step records: %s", len(self.pending), exc)
            self.outage = True

    def layers(self, checks: Sequence[LayerCheck]) -> None:
        """Held until the batch of steps that follows: they go out in its round trip."""
        self.pending_layers.extend(checks)

    def evaluations(self, records: Sequence[EvalRecord]) -> None:
        """Written at once (they are rare); held, like steps, while Redis is away."""
        self.pending_evaluations.extend(records)
        try:
            self.store.evaluations.append(self.job_id, self.pending_evaluations)
            self.pending_evaluations = []
        except UNAVAILABLE:
            self.outage = True

    def _send(self) -> None:
        """Write every pending check, record and rollup in one round trip (evaluations held over an outage
        just before); raises while Redis is away."""
        if self.pending_evaluations:  # before the steps: a reader that sees step s sees its evaluation
            self.store.evaluations.append(self.job_id, self.pending_evaluations)
            self.pending_evaluations = []
        self.store.streams.append_steps(self.job_id, self.pending, self.pending_rollups, self.pending_layers)
        if self.pending:
            self._acknowledged.append((time.monotonic(), self.pending[-1].step))
        if self.outage:
            log.warning("redis is back; wrote %d held step records and %d layer checks", len(self.pending),
                        len(self.pending_layers))
        self.pending, self.pending_rollups, self.pending_layers, self.outage = [], [], [], False

    def durable(self) -> int:
        """The last step Redis acknowledged at least DURABLE_AFTER_S ago (or the step the attempt resumed from):
        one a crash of Redis no longer loses. Called from the checkpoint writer's thread."""
        cutoff = time.monotonic() - DURABLE_AFTER_S
        while self._acknowledged and self._acknowledged[0][0] <= cutoff:
            self._durable = self._acknowledged.popleft()[1]
        return self._durable

    def summary(self, summary: Summary) -> None:
        codes = {d.code for d in summary.diagnoses}
        try:
            self.store.jobs.set_fields(self.job_id, summary=summary.model_dump_json())
            if codes - self.counted:
                self.store.counters.count_diagnoses(self.job_id, codes)
                self.counted |= codes
        except UNAVAILABLE:
            self.outage = True  # the next summary, or the final transition, carries it

    def drain(self) -> None:
        """Write the records and checks an outage held back (or checks no batch followed); the job's
        last steps have no next batch to ride with. Raises while Redis is still unreachable, for the
        caller to retry."""
        if self.pending or self.pending_rollups or self.pending_layers:
            self._send()
        if self.pending_evaluations:
            self.store.evaluations.append(self.job_id, self.pending_evaluations)
            self.pending_evaluations = []
