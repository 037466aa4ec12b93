"""Cancel flags: the API raises one, the running worker answers and stops; a silent worker's job is canceled here."""

from __future__ import annotations

import json
from dataclasses import dataclass

from app.core import clock
from app.store.base import RedisBacked
from app.store.keys import JOB_INDEX_PREFIX, RUNNING, events_key, job_key, lease_key
from mpjobs.contract.jobs import JobState

# Cancel a running attempt whose worker is presumed dead: only if it is still the attempt the caller
# watched, and its lease is gone or still held by the same owner with no answer to the flag. A new
# attempt, or a worker that answered, is left alone: it stops at its next step.
CANCEL_LOST = """
local state = redis.call('HGET', KEYS[1], 'state')
if state ~= 'running' then return state or '' end
local lease = redis.call('GET', KEYS[4])
if redis.call('HGET', KEYS[1], 'attempt') ~= ARGV[2]
   or (lease and (lease ~= ARGV[3] or redis.call('HEXISTS', KEYS[1], 'cancel_seen') == 1)) then
  return 'running'
end
local seq = redis.call('HGET', KEYS[1], 'seq')
local index = ARGV[1] .. redis.call('HGET', KEYS[1], 'tenant') .. ':'
redis.call('HSET', KEYS[1], 'state', 'canceled', 'finished_at', ARGV[4], 'error', ARGV[6])
redis.call('XADD', KEYS[2], '*', 'state', 'canceled', 'at', ARGV[4], 'message', ARGV[5])
redis.call('ZREM', index .. 'running', ARGV[7])
redis.call('ZADD', index .. 'canceled', seq, ARGV[7])
redis.call('SREM', KEYS[3], ARGV[7])
redis.call('DEL', KEYS[4])
return 'canceled'
"""


@dataclass(frozen=True)
class Attempt:
    """A job's current attempt as a cancel sees it."""

    state: JobState | None
    """None: the job does not exist."""
    number: int
    lease_owner: str | None
    """`host:pid` of the worker whose lease is live; None once it expired (or was dropped)."""
    answered: bool
    """The worker has seen the cancel flag (its watcher wrote `cancel_seen`)."""
    step: int


class CancelFlags(RedisBacked):
    SCRIPTS = {"cancel_lost": CANCEL_LOST}

    def request_cancel(self, job_id: str) -> None:
        self.redis.hset(job_key(job_id), "cancel_requested", 1)

    def cancel_requested(self, job_id: str) -> bool:
        return self.redis.hget(job_key(job_id), "cancel_requested") == "1"

    def acknowledge_cancel(self, job_id: str, owner: str) -> None:
        """The worker `owner` has seen the flag: it is alive, and stops at its next step."""
        self.redis.hset(job_key(job_id), "cancel_seen", owner)

    def attempt(self, job_id: str) -> Attempt:
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.hmget(job_key(job_id), "state", "attempt", "cancel_seen", "step")
            pipe.get(lease_key(job_id))
            (state, number, seen, step), owner = pipe.execute()
        return Attempt(state=JobState(state) if state else None, number=int(number or 0), lease_owner=owner,
                       answered=seen is not None, step=int(step or 0))

    def cancel_lost(self, attempt: Attempt, job_id: str, message: str, error: dict[str, str]) -> JobState | None:
        """Cancel `attempt` of the job, its worker presumed dead, and drop its lease: no reaper then sees
        it (and `canceled` is terminal). Returns the job's state after: CANCELED (done here), RUNNING (a
        live worker, or a new attempt, holds it: it stops at its next step), a state it had reached first,
        or None if the job is gone."""
        keys = [job_key(job_id), events_key(job_id), RUNNING, lease_key(job_id)]
        state = self._run("cancel_lost", keys, [JOB_INDEX_PREFIX, attempt.number, attempt.lease_owner or "",
                                                clock.iso(), message, json.dumps(error), job_id])
        return JobState(state) if state else None
