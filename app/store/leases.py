"""Leases of running attempts, and the reap that requeues (or fails) a job whose lease expired."""

from __future__ import annotations

import json
from collections.abc import Sequence

from app.core import clock
from app.store.base import RedisBacked
from app.store.keys import ENDED, JOB_INDEX_PREFIX, RUNNING, events_key, job_key, lease_key

# Requeue a running job whose lease expired, or fail it once `stalled` (attempts lost in a row, none resumed past
# the checkpoint of the one before: reset by the worker that starts an attempt further on; attempt - 1 on a
# record from before it) reaches the limit; a failed job joins `ended`. One winner among all reapers: the
# state and the lease are checked inside the script.
REAP = """
if redis.call('HGET', KEYS[1], 'state') ~= 'running' or redis.call('EXISTS', KEYS[4]) == 1 then
  return 'alive'
end
local attempt = tonumber(redis.call('HGET', KEYS[1], 'attempt'))
local seq = redis.call('HGET', KEYS[1], 'seq')
local index = ARGV[1] .. redis.call('HGET', KEYS[1], 'tenant') .. ':'
local stalled = tonumber(redis.call('HGET', KEYS[1], 'stalled') or (attempt - 1)) + 1
redis.call('HSET', KEYS[1], 'stalled', stalled)
local to, message = 'queued', 'worker lost during attempt ' .. attempt .. '; requeued to resume from its checkpoint'
if stalled >= tonumber(ARGV[2]) then
  to, message = 'failed', 'worker lost during attempt ' .. attempt .. ', the last allowed without progress'
  redis.call('HSET', KEYS[1], 'finished_at', ARGV[3], 'error', ARGV[4])
  redis.call('ZADD', KEYS[5], ARGV[6], ARGV[5])
end
redis.call('HSET', KEYS[1], 'state', to)
redis.call('XADD', KEYS[2], '*', 'state', to, 'at', ARGV[3], 'message', message)
redis.call('ZREM', index .. 'running', ARGV[5])
redis.call('ZADD', index .. to, seq, ARGV[5])
redis.call('SREM', KEYS[3], ARGV[5])
return to
"""


class Leases(RedisBacked):
    """`job:{id}:lease`, renewed while an attempt lives, and the `running` set the reaper walks."""

    SCRIPTS = {"reap": REAP}

    def renew_lease(self, job_id: str, owner: str, ttl_s: float) -> None:
        self.redis.set(lease_key(job_id), owner, px=int(ttl_s * 1000))

    def drop_lease(self, job_id: str) -> None:
        self.redis.delete(lease_key(job_id))

    def leases_held(self, job_ids: Sequence[str]) -> list[str]:
        """The jobs among `job_ids` whose attempt still holds its lease."""
        with self.redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.exists(lease_key(job_id))
            held = pipe.execute()
        return [job_id for job_id, found in zip(job_ids, held, strict=True) if found]

    def running_ids(self) -> set[str]:
        return set(self.redis.smembers(RUNNING))

    def reap(self, job_id: str, max_attempts: int) -> str:
        """'queued' (requeue it), 'failed' (`max_attempts` lost in a row, no progress) or 'alive' (nothing to do)."""
        error = json.dumps({"reason": "worker_lost", "message": (
            f"The worker running this job disappeared on {max_attempts} attempts in a row, none of which got "
            "past the checkpoint of the one before.")})
        keys = [job_key(job_id), events_key(job_id), RUNNING, lease_key(job_id), ENDED]
        now = clock.now()
        args = [JOB_INDEX_PREFIX, max_attempts, clock.iso(now), error, job_id, repr(now.timestamp())]
        return str(self._run("reap", keys, args))
