"""Retention: an ended job's history leaves Redis for its archive, in an order that loses nothing.

Order, for one job (`Archiver.archive`):
  1. claim it (SET NX with an expiry), so that two workers never archive it at once;
  2. stamp its streams (length, last id, entries ever added, greatest deleted id), read them whole;
  3. write the archive's files completely (app/store/archive.py: temp name, fsync, rename, fsync the folder);
  4. in one Lua script (TRIM): check the record still exists, has ended and is not archived, and each
     stream still has its stamp; then delete the metrics, rollup and layers streams, set the record's
     ARCHIVED_FIELD, and take the job off `ended`.
A crash before 4 leaves Redis whole: the files are ignored until the record names them, and the
next pass writes them again. After 4 the archive is whole. A stream written since 2 (a step written
late or rewound) or a record deleted meanwhile fails the check: nothing is removed (a deleted job's
new files are), and a later pass tries again. The job record and its events stream stay in Redis; so
do the cached views, until they expire.

Over `maxmemory` (noeviction) the archive still runs, since it is what frees memory: Redis refuses to
queue any command of a MULTI then, so step 4 is a script, not a WATCHed MULTI/EXEC, and Redis checks
memory only before a script's first write, which is its DEL; the claim is a script allowed to run
out of memory (a key of about 100 B, expiring). A script Redis refuses (NOREPLICAS, a disk error)
fails at its first write, the DEL, before any change: the history stays in Redis, and the log says why.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import time
import uuid
from collections.abc import Callable
from datetime import datetime
from typing import Any

import redis

from app.core import clock
from app.store import JobStore
from app.store.archive import ArchiveInfo, history_dir, write_history
from app.store.keys import (
    ARCHIVED_FIELD,
    ENDED,
    LAYERS_FIELD,
    ROLLUP_FIELD,
    STEP_FIELD,
    TENANTS,
    after,
    archive_claim_key,
    index_key,
    job_key,
    layers_key,
    metrics_key,
    number_of,
    rollup_key,
)
from mpjobs.contract.jobs import TERMINAL_STATES, JobState

log = logging.getLogger("mpjobs.archive")

ARCHIVE_CLAIM_S = 300.0
"""How long a worker's claim on archiving one job lasts: far longer than an archive takes (about a
second for 100k steps). A worker that dies holding it delays that job's archive by this much, no more."""
READ_BATCH = 10_000
"""Stream entries per XRANGE while a history is read for its archive."""
SWEEP_BATCH = 100
"""Due jobs taken from `ended` per query of a sweep."""

# Take the claim, over maxmemory too (SET alone is refused there): ARGV[1] the token, ARGV[2] its expiry in ms.
CLAIM = """#!lua flags=allow-oom
return redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2])
"""
# Drop the claim only if it is still ours (it may have expired and been taken by another worker).
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
# A stream's stamp: what changes with each write to it (XADD adds an entry, XDEL and XTRIM change its
# length, the rewind's XSETID its last id); '' when there is none.
STAMP = """
local function stamp(key)
  if redis.call('EXISTS', key) == 0 then return '' end
  local info, found = redis.call('XINFO', 'STREAM', key), {}
  for i = 1, #info, 2 do found[info[i]] = info[i + 1] end
  return table.concat({found['length'], found['last-generated-id'], found['entries-added'],
                       found['max-deleted-entry-id']}, ' ')
end
"""
# KEYS: the streams.
STAMPS = STAMP + """
local stamps = {}
for i = 1, #KEYS do stamps[i] = stamp(KEYS[i]) end
return stamps
"""
# KEYS: the job record, `ended`, the streams. ARGV: the job id, ARCHIVED_FIELD, the ArchiveInfo JSON ('' for no
# history), the ended states, the streams' stamps. No shebang, so no memory check past the first write: the DEL
# goes first, and the HSET after it runs over maxmemory too.
TRIM = STAMP + """
local state, archived = unpack(redis.call('HMGET', KEYS[1], 'state', ARGV[2]))
if not state then return 'missing' end
if archived or not string.find(' ' .. ARGV[4] .. ' ', ' ' .. state .. ' ', 1, true) then return 'changed' end
for i = 3, #KEYS do
  if stamp(KEYS[i]) ~= ARGV[i + 2] then return 'changed' end
end
redis.call('DEL', unpack(KEYS, 3))
if ARGV[3] ~= '' then redis.call('HSET', KEYS[1], ARGV[2], ARGV[3]) end
redis.call('ZREM', KEYS[2], ARGV[1])
return 'trimmed'
"""


class Archiver:
    """Moves ended jobs' histories into their archives under `artifacts_dir`, once `retention_s` has passed.

    Every worker runs a sweep (worker/service/reaper.py); a worker also archives the job it just finished when
    `retention_s` is 0 (worker/service/tasks.py). `before_trim(job_id)`, if given, runs after the files are
    written and before Redis is trimmed: the seam through which tests stop a process at that point.
    """

    def __init__(self, store: JobStore, retention_s: float, claim_s: float = ARCHIVE_CLAIM_S,
                 before_trim: Callable[[str], None] | None = None) -> None:
        if store.artifacts_dir is None:
            raise ValueError("Expected a JobStore built with artifacts_dir (where archives go). "
                             "Received: artifacts_dir=None")
        self.store, self.retention_s, self.claim_s, self.before_trim = store, retention_s, claim_s, before_trim
        self.artifacts_dir = store.artifacts_dir
        self._claim, self._release, self._stamps, self._trim = (
            store.redis.register_script(lua) for lua in (CLAIM, RELEASE, STAMPS, TRIM))
        self._indexed = False

    def index_ended(self) -> int:
        """Put on `ended` every ended job whose history is in Redis but that is not there: those that ended
        before mpjobs kept `ended`. Scored by their `finished_at`. Returns how many were added."""
        r, added = self.store.redis, 0
        for tenant in sorted(r.smembers(TENANTS)):
            for state in TERMINAL_STATES:
                job_ids: list[str] = list(r.zrange(index_key(tenant, state), 0, -1))
                with r.pipeline(transaction=False) as pipe:
                    for job_id in job_ids:
                        pipe.hmget(job_key(job_id), ["finished_at", ARCHIVED_FIELD])
                    found = pipe.execute()
                ended: dict[str, float] = {job_id: datetime.fromisoformat(at).timestamp()
                         for job_id, (at, archived) in zip(job_ids, found, strict=True) if at and archived is None}
                if ended:
                    added += int(r.zadd(ENDED, ended, nx=True))
        return added

    def due(self, limit: int = SWEEP_BATCH) -> list[str]:
        """Ended jobs whose retention has passed and whose history is still in Redis, oldest end first."""
        horizon = clock.now().timestamp() - self.retention_s
        return list(self.store.redis.zrangebyscore(ENDED, "-inf", horizon, start=0, num=limit))

    def sweep(self) -> list[str]:
        """Archive every due job this worker can claim; returns those it archived. A job that fails stays
        due (logged) and is tried again by the next sweep. The first sweep indexes older ended jobs first."""
        if not self._indexed:
            try:
                log.info("%d ended jobs from before the archive indexed", self.index_ended())
                self._indexed = True
            except redis.RedisError as error:  # over maxmemory, say: archive what is indexed, which frees memory
                log.warning("ended jobs from before the archive not indexed (%s); the next sweep tries again", error)
        archived: list[str] = []
        tried: set[str] = set()
        while True:
            batch = [job_id for job_id in self.due(SWEEP_BATCH + len(tried)) if job_id not in tried]
            if not batch:
                return archived
            for job_id in batch:
                tried.add(job_id)
                try:
                    if self.archive(job_id) == "archived":
                        archived.append(job_id)
                except Exception:
                    log.exception("archive of job %s failed; its history stays in Redis until the next sweep", job_id)

    def archive(self, job_id: str) -> str:
        """Archive one ended job's history. Returns what happened: "archived"; "already archived" or
        "missing" or "no history" (nothing to do); "not ended"; "claimed" (another worker is archiving it); "changed"
        (its record or streams changed while it was read: nothing removed, the next sweep tries again); "refused"
        (Redis refused the trim, logged with its reason: nothing removed, the next sweep tries again)."""
        claim, token = archive_claim_key(job_id), uuid.uuid4().hex
        if not self._claim(keys=[claim], args=[token, int(self.claim_s * 1000)]):
            return "claimed"
        try:
            return self._archive(job_id)
        finally:
            try:
                self._release(keys=[claim], args=[token])
            except redis.RedisError as error:  # what happened stands; the claim lapses after claim_s
                log.warning("job %s: archive claim not dropped (%s); it lapses in %.0f s", job_id, error,
                            self.claim_s)

    def _archive(self, job_id: str) -> str:
        r = self.store.redis
        streams = [metrics_key(job_id), rollup_key(job_id), layers_key(job_id)]
        state, archived = r.hmget(job_key(job_id), ["state", ARCHIVED_FIELD])
        if state is None or archived is not None:
            r.zrem(ENDED, job_id)  # deleted, or archived by an earlier pass
            return "missing" if state is None else "already archived"
        if not JobState(state).terminal:
            return "not ended"
        stamps: list[str] = self._stamps(keys=streams)
        if not any(stamps):  # no history (canceled before it ran): no files
            return "no history" if self._trim_streams(job_id, streams, stamps, "") == "trimmed" else "changed"
        started = time.monotonic()
        step_json = [f[STEP_FIELD] for _, f in _read_all(r, streams[0])]
        steps = _parse(step_json)
        stored = _read_all(r, streams[1])
        rollups = list(zip([number_of(i) for i, _ in stored], _parse([f[ROLLUP_FIELD] for _, f in stored]),
                           strict=True))
        layers = [(number_of(i), f[LAYERS_FIELD]) for i, f in _read_all(r, streams[2])]
        info = ArchiveInfo(dir=history_dir(job_id), steps=len(steps), rollups=len(rollups),
                           layer_checks=len(layers), archived_at=clock.iso())
        folder = self.artifacts_dir / info.dir
        write_history(folder, steps, step_json, rollups, layers)
        if self.before_trim is not None:
            self.before_trim(job_id)
        try:
            trimmed = self._trim_streams(job_id, streams, stamps, info.model_dump_json())
        except redis.ResponseError as error:
            log.warning("job %s: Redis refused to trim its archived history (%s); it stays in Redis, and the next "
                        "sweep tries again", job_id, error)
            return "refused"
        if trimmed != "trimmed":
            if trimmed == "missing":  # deleted meanwhile: leave no files behind, nor its folder if they were all
                shutil.rmtree(folder, ignore_errors=True)
                with contextlib.suppress(OSError):
                    folder.parent.rmdir()  # only if empty: the job's other files are the delete's to remove
            log.info("job %s changed while its history was archived; tried again by the next sweep", job_id)
            return "changed"
        log.info("job %s: %d steps, %d rollups, %d layer checks archived to %s in %.2f s", job_id, info.steps,
                 info.rollups, info.layer_checks, folder, time.monotonic() - started)
        return "archived"

    def _trim_streams(self, job_id: str, streams: list[str], stamps: list[str], info: str) -> str:
        """Run TRIM: "trimmed", or why not ("missing", "changed")."""
        terminal = " ".join(s.value for s in TERMINAL_STATES)
        return str(self._trim(keys=[job_key(job_id), ENDED, *streams],
                              args=[job_id, ARCHIVED_FIELD, info, terminal, *stamps]))


def _read_all(r: Any, key: str) -> list[tuple[str, dict[str, str]]]:
    """Every entry of stream `key`, READ_BATCH at a time."""
    entries: list[tuple[str, dict[str, str]]] = []
    low = "-"
    while True:
        batch = r.xrange(key, min=low, max="+", count=READ_BATCH)
        entries += batch
        if len(batch) < READ_BATCH:
            return entries
        low = after(number_of(batch[-1][0]))


def _parse(objects: list[str]) -> list[dict[str, Any]]:
    """JSON objects parsed in one call (one json.loads per object takes several times longer)."""
    parsed: list[dict[str, Any]] = json.loads(f"[{','.join(objects)}]")
    return parsed


def archive_at_once(store: JobStore, retention_s: float, job_id: str) -> str | None:
    """For a worker right after a job's last transition: with a retention of 0, archive its history now.
    Never raises (the job's outcome stands; the sweep retries). Returns what `Archiver.archive` did, or None."""
    if retention_s != 0:
        return None
    try:
        return Archiver(store, retention_s).archive(job_id)
    except Exception:
        log.exception("archive of job %s failed; its history stays in Redis until the next sweep", job_id)
        return None
