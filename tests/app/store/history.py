"""Ended jobs with a varied history, written as a worker writes them, for the archive's tests and its kill child."""

from __future__ import annotations

import random

from app.store import JobStore
from mpjobs.contract.jobs import JobState
from mpjobs.contract.records import LayerCheck, LayerNumerics, StepRecord, Summary
from mpjobs.contract.spec import JobSpec
from worker.telemetry.redis_reporter import RedisReporter

SPEC = JobSpec.model_validate({"model": {"name": "mlp"}, "training": {"steps": 10}})
AWKWARD = (0.1, 1 / 3, -0.0, 5e-324, 2.2250738585072014e-308, 1.7976931348623157e308, 65504.0, 2.0 ** -24)
"""Floats a lossy format would change: repeating binary fractions, negative zero, the smallest subnormal,
the extremes of float64, float16's largest and smallest."""


def records(steps: int, seed: int = 0, skip: frozenset[int] = frozenset()) -> list[StepRecord]:
    """Steps 1..`steps` (less `skip`), every field varied: nulls, skips, checked steps, awkward floats."""
    rng = random.Random(seed)

    def value() -> float:
        return rng.choice(AWKWARD) if rng.random() < 0.2 else rng.uniform(-1e3, 1e3) * 10 ** rng.randint(-12, 12)

    out = []
    for step in (s for s in range(1, steps + 1) if s not in skip):
        skipped = rng.random() < 0.05
        checked = step % 7 == 0
        out.append(StepRecord(
            step=step, loss=None if skipped else value(), loss_scale=2.0 ** rng.randint(-2, 24),
            grad_norm=None if skipped else abs(value()), grads_finite=not skipped, skipped=skipped,
            zero_grad_fraction=rng.random(), regularization_loss=value() if step % 3 else None,
            excess_zero_fraction=rng.random() if checked else None, grad_rel_error=value() if checked else None,
            learning_rate=rng.choice((1e-3, 0.1, 3e-4)), examples_per_sec=rng.uniform(1, 1e6),
            step_time_ms=rng.uniform(0.1, 100), time=1.8e9 + step * rng.random()))
    return out


def layer_checks(steps: list[StepRecord], every: int) -> list[LayerCheck]:
    return [LayerCheck(step=r.step, compute_dtype="float16", loss_scale=r.loss_scale, time=r.time,
                       underflow_layer="dense_1" if r.step % 2 else None,
                       layers=[LayerNumerics(name=f"dense_{i}", kind="Dense", values=64 * i,
                                             zero_fraction=r.zero_grad_fraction, grad_norm=r.grad_norm,
                                             activation_dtype="float16", activation_max=65504.0) for i in range(3)])
            for r in steps if r.step % every == 0]


def ended_job(store: JobStore, steps: int, seed: int = 0, check_every: int = 10, state: JobState = JobState.SUCCEEDED,
              skip: frozenset[int] = frozenset(), tenant: str = "t") -> tuple[str, list[StepRecord], list[LayerCheck]]:
    """A job created, run and ended through the store, its history written by the worker's RedisReporter."""
    job_id, _ = store.jobs.create(SPEC, tenant, "cpu", lambda _id, _pipe: None, store.redis.pipeline(transaction=True))
    # A lease as a worker holds one: without it a running reaper requeues the job while its history is written.
    store.leases.renew_lease(job_id, "tests:history", 3600)
    store.jobs.transition(job_id, JobState.RUNNING, [JobState.QUEUED], "attempt 1", attempt=1)
    written, checks = records(steps, seed, skip), []
    reporter = RedisReporter(store, job_id)
    for first in range(0, len(written), 256):
        batch = written[first:first + 256]
        batch_checks = layer_checks(batch, check_every)
        reporter.layers(batch_checks)
        reporter.steps(batch)
        checks += batch_checks
    reporter.drain()
    assert not reporter.pending
    summary = Summary(steps_done=steps, final_loss=0.5, skipped_steps=sum(r.skipped for r in written),
                      loss_scale_min=1.0, loss_scale_max=2.0, loss_scale_final=2.0, peak_zero_grad_fraction=0.1,
                      mean_examples_per_sec=1.0)
    moved, previous = store.jobs.transition(job_id, state, [JobState.RUNNING], "ended",
                                            summary=summary.model_dump_json())
    assert moved, previous
    store.leases.drop_lease(job_id)
    return job_id, written, checks
