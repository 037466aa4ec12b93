"""Layer checks in the store: written with their steps' batch, each once, rewound with them, read back in pages."""

from __future__ import annotations

import pytest

from app.api import services
from app.core.errors import JobNotFound
from app.store import JobStore
from app.store.keys import STATS, layers_key
from mpjobs.contract.records import LayerCheck, LayerNumerics
from tests.app.store.test_missing_steps import TENANT, job_with_steps, record


def check(step: int, underflow: str | None = "conv3d_1") -> LayerCheck:
    """Two layers: one that trains (its gradient half lost at this step) and one with nothing to train."""
    conv = LayerNumerics(name="conv3d_1", kind="Conv3D", values=432, zero_fraction=0.5, excess_zero_fraction=0.5,
                         grad_norm=2.0**-20, grad_max_log2=-21.0, grad_min_log2=-24.0, lost_min_log2=-30.5,
                         grad_rel_error=0.75,
                         signal_values=1728, signal_zero_fraction=0.25, signal_excess_zero_fraction=0.25,
                         activation_dtype="float16", activation_max=3.5, activation_headroom_log2=14.1,
                         activation_subnormal_fraction=0.25, activation_zero_fraction=0.125)
    pool = LayerNumerics(name="max_pooling3d", kind="MaxPooling3D", values=0, activation_dtype="float32",
                         activation_max=3.5, activation_headroom_log2=126.2, activation_subnormal_fraction=0.0,
                         activation_zero_fraction=0.0)
    return LayerCheck(step=step, compute_dtype="float16", loss_scale=1.0, layers=[conv, pool],
                      underflow_layer=underflow, time=1_700_000_000.0 + step)


def test_checks_are_written_with_their_batch_and_read_back_in_step_order(store: JobStore) -> None:
    job_id = job_with_steps(store, [])
    store.streams.append_steps(job_id, [record(s) for s in range(1, 4)], [], [check(1)])
    store.streams.append_steps(job_id, [record(s) for s in range(4, 7)], [], [check(5, underflow=None)])
    page = store.history.read_layers(job_id, after_step=0, limit=100)
    assert page.checks == [check(1), check(5, underflow=None)] and page.next_after is None
    assert [c.step for c in store.history.read_layers(job_id, after_step=1, limit=100).checks] == [5]
    assert store.history.read_layers(job_id, after_step=5, limit=100).checks == []


def test_a_resent_batch_writes_each_check_and_step_once(store: JobStore) -> None:
    job_id = job_with_steps(store, [])
    batch = [record(s) for s in range(1, 4)]
    steps_before = int(store.redis.hget(STATS, "steps") or 0)
    store.streams.append_steps(job_id, batch, [], [check(1)])
    store.streams.append_steps(job_id, batch, [], [check(1)])  # the connection dropped after Redis wrote it
    store.streams.append_steps(job_id, [*batch, record(4)], [], [check(1), check(4)])  # held, then sent with the next
    assert [c.step for c in store.history.read_layers(job_id, 0, 100).checks] == [1, 4]
    assert store.redis.xlen(layers_key(job_id)) == 2
    assert int(store.redis.hget(STATS, "steps") or 0) - steps_before == 4


def test_a_rewind_drops_the_checks_after_the_checkpoint_and_the_resumed_attempt_writes_them_once(
        store: JobStore) -> None:
    job_id = job_with_steps(store, [])
    store.streams.append_steps(job_id, [record(s) for s in range(1, 31)], [],
                               [check(1), check(10), check(20), check(30)])
    removed = store.streams.rewind_metrics(job_id, keep_step=15)
    assert removed == 15 + 2  # steps 16-30 and the checks at 20 and 30
    assert [c.step for c in store.history.read_layers(job_id, 0, 100).checks] == [1, 10]
    store.streams.append_steps(job_id, [record(s) for s in range(16, 31)], [], [check(20, underflow=None), check(30)])
    checks = store.history.read_layers(job_id, 0, 100).checks
    assert [c.step for c in checks] == [1, 10, 20, 30]
    assert checks[2].underflow_layer is None, "the resumed attempt's check, not the lost one's"


def test_pages_follow_next_after_to_the_last_check(store: JobStore) -> None:
    job_id = job_with_steps(store, [])
    steps = [1, 100, 200, 300, 400]
    store.streams.append_steps(job_id, [record(s) for s in range(1, 401)], [], [check(s) for s in steps])
    seen, after, pages = [], 0, 0
    while after is not None:
        page = services.layers(store, job_id, TENANT, after, limit=2)
        seen += [c.step for c in page.checks]
        after, pages = page.next_after, pages + 1
    assert seen == steps and pages == 3
    exact = services.layers(store, job_id, TENANT, after=200, limit=3)
    assert [c.step for c in exact.checks] == [300, 400] and exact.next_after is None


def test_another_tenant_s_job_has_no_layers(store: JobStore) -> None:
    job_id = job_with_steps(store, [1])
    store.streams.append_steps(job_id, [record(2)], [], [check(2)])
    with pytest.raises(JobNotFound):
        services.layers(store, job_id, "someone-else", 0, 100)
    with pytest.raises(JobNotFound):
        services.layers(store, "no-such-job", TENANT, 0, 100)
