"""`held_steps`: the last step s such that Redis holds every step 1..s, which a resumed attempt starts at or before."""

from __future__ import annotations

from app.store import JobStore
from app.store.keys import metrics_key
from tests.app.store.test_missing_steps import job_with_steps, record


def test_no_steps_hold_nothing(store: JobStore) -> None:
    assert store.streams.held_steps(job_with_steps(store, [])) == 0


def test_every_step_from_the_first_is_held(store: JobStore) -> None:
    job_id = job_with_steps(store, [])
    store.streams.append_steps(job_id, [record(s) for s in range(1, 8)], [])
    assert store.streams.held_steps(job_id) == 7


def test_a_gap_ends_what_is_held_whatever_follows_it(store: JobStore) -> None:
    """A Redis crash lost steps 5-6 (AOF everysec), and later batches came after it: 4 are held, not 9."""
    job_id = job_with_steps(store, [])
    store.streams.append_steps(job_id, [record(s) for s in (*range(1, 5), *range(7, 10))], [])
    assert store.streams.held_steps(job_id) == 4


def test_a_gap_past_the_first_page_is_found(store: JobStore) -> None:
    """The walk reads the stream 1,000 entries at a time: a gap at step 2,501 of 3,000."""
    job_id = job_with_steps(store, [])
    store.streams.append_steps(job_id, [record(s) for s in range(1, 3001)], [])
    store.redis.xdel(metrics_key(job_id), "2501-0")
    assert store.streams.held_steps(job_id) == 2500


def test_the_first_step_missing_holds_nothing(store: JobStore) -> None:
    job_id = job_with_steps(store, [])
    store.streams.append_steps(job_id, [record(s) for s in range(2, 5)], [])
    assert store.streams.held_steps(job_id) == 0
