"""A resent step batch carrying a layer check not sent before: each step counted once, the check stored once."""

from __future__ import annotations

import pytest

from app.store import JobStore
from app.store.keys import layers_key
from tests.app.store.test_layer_checks import check
from tests.app.store.test_missing_steps import job_with_steps, record


@pytest.mark.parametrize("new_checks", [[2], [1, 3]], ids=["one-new-check", "two-new-checks"])
def test_a_resent_batch_with_checks_not_sent_before_counts_its_steps_once(store: JobStore,
                                                                           new_checks: list[int]) -> None:
    job_id = job_with_steps(store, [])
    batch = [record(1).model_copy(update={"skipped": True}), record(2), record(3)]
    before = store.counters.stats()
    store.streams.append_steps(job_id, batch, [])  # written; the reply lost in a Redis blip
    # Resent with the next batch's checks, which the worker held while Redis was away.
    store.streams.append_steps(job_id, batch, [], [check(step) for step in new_checks])
    after = store.counters.stats()
    assert after["steps"] - before.get("steps", 0) == 3
    assert after["skipped_steps"] - before.get("skipped_steps", 0) == 1
    assert [c.step for c in store.history.read_layers(job_id, 0, 100).checks] == new_checks
    assert store.redis.xlen(layers_key(job_id)) == len(new_checks)
