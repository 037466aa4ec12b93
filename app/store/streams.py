"""Metric streams: a step (and a layer check) once per stream id, rollups beside them, read back as pages or buckets."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import redis
from redis import Redis
from redis.client import NEVER_DECODE

from app.store.base import RedisBacked
from app.store.keys import (
    ROLLUP_FIELD,
    STATS,
    STEP_FIELD,
    after,
    entry_id,
    evaluations_key,
    job_key,
    layer_check,
    layers_fields,
    layers_key,
    metrics_key,
    number_of,
    rollup_key,
    step_fields,
    step_record,
)
from app.store.pages import RawPage, stream_page, unparsed_xrange
from app.store.rollup import ROLLUP_STEPS, Rollup, raw_buckets, rollup_buckets
from mpjobs.contract.jobs import LayersPage, MetricsBuckets, MetricsPage
from mpjobs.contract.records import LayerCheck, StepRecord

RAW_BUCKET_LIMIT = 4096
"""Up to this many steps, buckets are cut from the raw series; beyond, from rollups."""

# Forget steps after `keep` (a lost attempt's, recomputed from the checkpoint) and let each
# stream (metrics, rollups, layer checks) accept them again: each step stays exactly once.
REWIND = """
local removed = 0
for i = 1, #KEYS do
  local gone = redis.call('XRANGE', KEYS[i], ARGV[2 * i - 1], '+')
  for _, entry in ipairs(gone) do redis.call('XDEL', KEYS[i], entry[1]) end
  removed = removed + #gone
  if redis.call('EXISTS', KEYS[i]) == 1 then redis.call('XSETID', KEYS[i], ARGV[2 * i]) end
end
return removed
"""

# The last step s such that the stream holds every step 1..s. Stream ids are distinct steps from 1, so a
# stream of n entries whose last is step n has no gap; only one that has a gap is walked.
HELD_STEPS = """
local n = redis.call('XLEN', KEYS[1])
if n == 0 then return 0 end
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
if tonumber(string.match(last[1][1], '^(%d+)')) == n then return n end
local expected, start = 1, '-'
while true do
  local page = redis.call('XRANGE', KEYS[1], start, '+', 'COUNT', 1000)
  if #page == 0 then return expected - 1 end
  for _, entry in ipairs(page) do
    if tonumber(string.match(entry[1], '^(%d+)')) ~= expected then return expected - 1 end
    expected = expected + 1
  end
  start = '(' .. page[#page][1]
end
"""


class MetricStreams(RedisBacked):
    """`job:{id}:metrics` (one entry per step), `job:{id}:rollup` (one per ROLLUP_STEPS steps) and
    `job:{id}:layers` (one per layer check).

    Its reads see what Redis holds, and nothing of an archived history: `MetricHistory` (app/store/history.py)
    reads wherever the history is, these first."""

    SCRIPTS = {"rewind": REWIND, "held_steps": HELD_STEPS}

    def __init__(self, redis: Redis) -> None:
        super().__init__(redis)
        self._unparsed: Redis | None = None

    def append_steps(self, job_id: str, records: Sequence[StepRecord], rollups: Sequence[tuple[int, Rollup]],
                     layers: Sequence[LayerCheck] = ()) -> None:
        """One round trip: the layer checks, the steps, finished rollups, progress and the step counters.
        A resent batch whose steps Redis already holds takes them back off the counters.

        The checks go first, so a reader that sees step `s` sees every check up to `s` (app/api/sse.py)."""
        with self.redis.pipeline(transaction=False) as pipe:
            for check in layers:
                pipe.xadd(layers_key(job_id), layers_fields(check), id=entry_id(check.step))
            for r in records:
                pipe.xadd(metrics_key(job_id), step_fields(r), id=entry_id(r.step))
            for index, rollup in rollups:
                pipe.xadd(rollup_key(job_id), {ROLLUP_FIELD: json.dumps(rollup.to_json())}, id=entry_id(index))
            if records:
                pipe.hset(job_key(job_id), "step", records[-1].step)
            if records:
                pipe.hincrby(STATS, "steps", len(records))
                pipe.hincrby(STATS, "skipped_steps", sum(r.skipped for r in records))
            results = pipe.execute(raise_on_error=False)
        for result in results:
            # A resent batch: a step id Redis already holds was written the first time.
            if isinstance(result, redis.ResponseError) and "equal or smaller" not in str(result):
                raise result
        step_results = results[len(layers):len(layers) + len(records)]
        held = [r for r, result in zip(records, step_results, strict=True) if isinstance(result, Exception)]
        if held:
            with self.redis.pipeline(transaction=False) as pipe:
                pipe.hincrby(STATS, "steps", -len(held))
                pipe.hincrby(STATS, "skipped_steps", -sum(r.skipped for r in held))
                pipe.execute()

    def rewind_metrics(self, job_id: str, keep_step: int) -> int:
        """Drop steps after `keep_step` (their rollups, layer checks and evaluations too) so a resumed attempt rewrites
        them once. Returns how many entries went."""
        keys = [metrics_key(job_id), rollup_key(job_id), layers_key(job_id), evaluations_key(job_id)]
        kept_rollups = keep_step // ROLLUP_STEPS
        args = [after(keep_step), entry_id(keep_step), after(kept_rollups), entry_id(kept_rollups),
                after(keep_step), entry_id(keep_step), after(keep_step), entry_id(keep_step)]
        removed = int(self._run("rewind", keys, args))
        self._hset_existing(job_key(job_id), {"step": keep_step})
        return removed

    def held_steps(self, job_id: str) -> int:
        """The last step `s` such that Redis holds every step 1..s of the job (0: none). A crash of Redis can
        lose a batch of steps that later batches follow: a resumed attempt starts at or before this step, and
        a job whose stored steps fall short of its last one is not done."""
        return int(self._run("held_steps", [metrics_key(job_id)], []))

    def unrolled_steps(self, job_id: str) -> list[dict[str, Any]]:
        """The stored steps after the last whole rollup (every ROLLUP_STEPS steps), parsed: what a resumed
        attempt's unfinished rollup holds."""
        last = self.redis.xrevrange(metrics_key(job_id), count=1)
        if not last:
            return []
        last_step = number_of(last[0][0])
        first = last_step - last_step % ROLLUP_STEPS
        return [json.loads(fields[STEP_FIELD])
                for _, fields in self.redis.xrange(metrics_key(job_id), min=after(first), max="+")]

    def latest_records(self, job_ids: Sequence[str]) -> dict[str, StepRecord]:
        """Each job's newest step record, for those that have one."""
        with self.redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.xrevrange(metrics_key(job_id), count=1)
            found = pipe.execute()
        return {job_id: step_record(last[0][1]) for job_id, last in zip(job_ids, found, strict=True) if last}

    def read_metrics(self, job_id: str, after_step: int, limit: int) -> MetricsPage:
        # One more than asked: whether another page follows, in the same read.
        entries = self.redis.xrange(metrics_key(job_id), min=after(after_step), max="+", count=limit + 1)
        return metrics_page(job_id, after_step, [step_record(fields) for _, fields in entries[:limit]],
                            len(entries) > limit)

    def read_metrics_raw(self, job_id: str, after_step: int, limit: int) -> RawPage:
        """The same page as `read_metrics`, its records as stored: XRANGE's reply as hiredis parsed it (bytes,
        no dict per entry), the records joined as they are, with no parse and no validation."""
        if self._unparsed is None:  # the same connections, XRANGE's reply left unparsed
            self._unparsed = Redis(connection_pool=self.redis.connection_pool)
            self._unparsed.set_response_callback("XRANGE", unparsed_xrange)
        entries = self._unparsed.execute_command(  # type: ignore[no-untyped-call]
            "XRANGE", metrics_key(job_id), after(after_step), "+", "COUNT", limit + 1, **{NEVER_DECODE: []})
        return stream_page(after_step, entries, limit)

    def read_layers(self, job_id: str, after_step: int, limit: int) -> LayersPage:
        """Layer checks after step `after_step`, in step order, at most `limit`."""
        entries = self.redis.xrange(layers_key(job_id), min=after(after_step), max="+", count=limit + 1)
        checks = [layer_check(fields) for _, fields in entries[:limit]]
        return LayersPage(job_id=job_id, checks=checks, next_after=checks[-1].step if len(entries) > limit else None)

    def read_buckets(self, job_id: str, max_points: int) -> MetricsBuckets:
        last = self.redis.xrevrange(metrics_key(job_id), count=1)
        total = number_of(last[0][0]) if last else 0
        if total <= RAW_BUCKET_LIMIT:
            records = [json.loads(fields[STEP_FIELD]) for _, fields in self.redis.xrange(metrics_key(job_id))]
            return MetricsBuckets(job_id=job_id, total_steps=total, buckets=raw_buckets(records, max_points))
        # One json.loads for all stored rollups; they are merged in their JSON form.
        raw = [f[ROLLUP_FIELD] for _, f in self.redis.xrange(rollup_key(job_id))]
        stored: list[dict[str, Any]] = json.loads(f"[{','.join(raw)}]")
        covered = stored[-1]["last_step"] if stored else 0
        tail = (json.loads(f[STEP_FIELD]) for _, f in self.redis.xrange(metrics_key(job_id), min=after(covered)))
        return MetricsBuckets(job_id=job_id, total_steps=total, buckets=rollup_buckets(stored, tail, max_points))


def metrics_page(job_id: str, after_step: int, points: list[StepRecord], more: bool) -> MetricsPage:
    """A page of `points` (the steps after `after_step`, in order), with the gaps inside it."""
    missing, expected = [], after_step + 1
    for point in points:
        if point.step > expected:
            missing.append((expected, point.step - 1))
        expected = point.step + 1
    return MetricsPage(job_id=job_id, points=points, next_after=points[-1].step if more else None,
                       missing_steps=missing)
