"""Deleting ended jobs for good: one Lua script checks that every job may go, then deletes all their keys.

A job may go when it belongs to the caller's tenant, has ended, no attempt holds its lease any more,
and (deleted alone) no comparison it belongs to still exists. The script checks every job before it
deletes anything, so a refused delete deletes nothing. Its deletes free memory and allocate none,
so they run when Redis is over its `maxmemory` too: deleting old jobs is how a full Redis is freed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from app.store.base import RedisBacked
from app.store.keys import (
    COMPARISON_PREFIX,
    ENDED,
    JOB_INDEX_PREFIX,
    RUNNING,
    comparison_index_key,
    comparison_key,
    job_keys,
)
from mpjobs.contract.jobs import JobState

# KEYS: the `running` set; with a comparison (ARGV[5] its id), its hash and its tenant's index; then
# each job's own keys, ARGV[4] of them, its record first and its lease second. ARGV[8...]: the job ids.
PURGE = """
local tenant, index, cmp_prefix, per_job, whole = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5]
local states, ended = {}, {}
for s in string.gmatch(ARGV[6], '%S+') do states[#states + 1] = s end
for s in string.gmatch(ARGV[7], '%S+') do ended[s] = true end
local first = 2
if whole ~= '' then
  if redis.call('HGET', KEYS[2], 'tenant') ~= tenant then return {'missing', whole, ''} end
  first = 4
end
local going, n = {}, 8
for i = first, #KEYS, per_job do
  local id = ARGV[n]
  n = n + 1
  local owner, state, cmp = unpack(redis.call('HMGET', KEYS[i], 'tenant', 'state', 'comparison'))
  if owner ~= tenant then
    -- a comparison's job already gone is skipped; a job asked for by id is not found
    if whole == '' then return {'missing', id, ''} end
  else
    if not ended[state] then return {'active', id, state} end
    if redis.call('EXISTS', KEYS[i + 1]) == 1 then return {'held', id, ''} end
    if whole == '' and cmp and redis.call('EXISTS', cmp_prefix .. cmp) == 1 then
      return {'in_comparison', id, cmp}
    end
    going[#going + 1] = {i, id}
  end
end
for _, job in ipairs(going) do
  local i, id = job[1], job[2]
  redis.call('DEL', unpack(KEYS, i, i + per_job - 1))
  redis.call('ZREM', index .. tenant, id)
  for _, s in ipairs(states) do redis.call('ZREM', index .. tenant .. ':' .. s, id) end
  redis.call('SREM', KEYS[1], id)
end
if whole ~= '' then
  redis.call('DEL', KEYS[2])
  redis.call('ZREM', KEYS[3], whole)
end
return {'ok', '', ''}
"""


@dataclass(frozen=True)
class PurgeRefusal:
    """Why the purge script deleted nothing.

    `reason`: `missing` (no such job or comparison for this tenant), `active` (`detail` is its state),
    `held` (ended, but its attempt still holds its lease) or `in_comparison` (`detail` is the comparison).
    """

    reason: str
    job_id: str
    detail: str


class Purges(RedisBacked):
    SCRIPTS = {"purge": PURGE}

    def purge(self, tenant: str, job_ids: Sequence[str], view_sizes: Iterable[int],
              comparison_id: str | None = None) -> PurgeRefusal | None:
        """Delete the jobs (with `comparison_id`: that comparison and its jobs) and every key and index
        entry of theirs, or nothing. Returns None once deleted, else why not."""
        sizes = sorted(view_sizes)
        keys = [RUNNING]
        if comparison_id is not None:
            keys += [comparison_key(comparison_id), comparison_index_key(tenant)]
        for job_id in job_ids:
            keys += job_keys(job_id, sizes)
        args = [tenant, JOB_INDEX_PREFIX, COMPARISON_PREFIX, len(job_keys("", sizes)), comparison_id or "",
                " ".join(s.value for s in JobState), " ".join(s.value for s in JobState if s.terminal), *job_ids]
        reason, job_id, detail = self._run("purge", keys, args)
        if reason != "ok":
            return PurgeRefusal(str(reason), str(job_id), str(detail))
        # Off the archive sweep's index too: a job id left there would only be dropped by the sweep,
        # which finds no record (app/store/retention.py), so this need not be in the script.
        self.redis.zrem(ENDED, *job_ids)
        return None
