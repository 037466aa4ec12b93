"""The bucketed metrics view is exact: raw (<= 4,096 steps) and rollup paths against a brute-force fold."""

from __future__ import annotations

import math
import random

import pytest

from app.store import RAW_BUCKET_LIMIT, JobStore
from app.store.rollup import ROLLUP_STEPS, Rollup
from mpjobs.contract.records import StepRecord


def write(store: JobStore, job_id: str, steps: int) -> list[StepRecord]:
    rng = random.Random(steps)
    records = [StepRecord(step=s, loss=None if s % 97 == 0 else rng.uniform(0, 3), loss_scale=2.0 ** rng.randint(0, 16),
                          grad_norm=rng.uniform(0, 10), grads_finite=s % 97 != 0, skipped=s % 97 == 0,
                          zero_grad_fraction=0.0, learning_rate=1e-3, examples_per_sec=1.0, step_time_ms=1.0,
                          time=float(s)) for s in range(1, steps + 1)]
    partial, rollups = Rollup(), []
    for r in records:  # as worker/telemetry/redis_reporter.py cuts them
        partial.add(r.model_dump())
        if r.step % ROLLUP_STEPS == 0:
            rollups.append((r.step // ROLLUP_STEPS, partial))
            partial = Rollup()
    store.streams.append_steps(job_id, records, rollups)
    return records


def expected(records: list[StepRecord], first: int, last: int) -> dict[str, tuple[float, float, float] | None]:
    chunk = [r for r in records if first <= r.step <= last]
    out: dict[str, tuple[float, float, float] | None] = {}
    for name in ("loss", "grad_norm", "loss_scale"):
        values = [getattr(r, name) for r in chunk if getattr(r, name) is not None]
        out[name] = (min(values), sum(values) / len(values), max(values)) if values else None
    return out


@pytest.mark.parametrize(("steps", "max_points"), [(10, 500), (1000, 7), (RAW_BUCKET_LIMIT, 500), (10_000, 500),
                                                   (10_000, 3)])
def test_buckets_cover_every_step_exactly(store: JobStore, steps: int, max_points: int) -> None:
    job_id = f"b{steps}-{max_points}"
    records = write(store, job_id, steps)
    view = store.history.read_buckets(job_id, max_points)
    assert view.total_steps == steps and 1 <= len(view.buckets) <= max_points
    assert view.buckets[0].first_step == 1 and view.buckets[-1].last_step == steps
    assert sum(b.steps for b in view.buckets) == steps
    for before, after in zip(view.buckets, view.buckets[1:], strict=False):
        assert after.first_step == before.last_step + 1
    for b in view.buckets:
        want = expected(records, b.first_step, b.last_step)
        assert b.skipped == sum(r.skipped for r in records if b.first_step <= r.step <= b.last_step)
        for name in ("loss", "grad_norm", "loss_scale"):
            stat, values = getattr(b, name), want[name]
            assert values is not None
            assert (stat.min, stat.max) == (values[0], values[2])
            assert math.isclose(stat.mean, values[1], rel_tol=1e-12)
