"""The store's dataset records on a real redis-server: per tenant, one file's owners, deletes refused in use."""

from __future__ import annotations

import hashlib

import pytest

from app.store import DatasetInUseBy, JobStore
from mpjobs.contract.datasets import ArrayShape
from mpjobs.contract.jobs import JobState
from mpjobs.contract.spec import JobSpec

X = ArrayShape(shape=[10, 4], dtype="<f4", low=-1.0, high=1.0)
Y = ArrayShape(shape=[10], dtype="<i8", low=0.0, high=3.0)


def _id(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def test_a_record_is_written_once_per_tenant_and_read_back(store: JobStore) -> None:
    dataset_id = _id("once")
    first, created = store.datasets.create("a", dataset_id, 1234, X, Y)
    again, created_again = store.datasets.create("a", dataset_id, 1234, X, Y)
    assert (created, created_again) == (True, False)
    assert first == again and first.id == first.sha256 == dataset_id
    assert (first.bytes, first.x, first.y, first.jobs) == (1234, X, Y, [])
    assert store.datasets.get("b", dataset_id) is None  # another tenant's is none
    assert [d.id for d in store.datasets.list_datasets("a")] == [dataset_id]
    assert store.datasets.list_datasets("b") == []


def test_two_tenants_share_a_file_and_the_last_delete_says_so(store: JobStore) -> None:
    dataset_id = _id("shared")
    store.datasets.create("a", dataset_id, 10, X, Y)
    store.datasets.create("b", dataset_id, 10, X, Y)
    assert store.datasets.owners(dataset_id) == {"a", "b"}
    assert store.datasets.delete("a", dataset_id) == 1  # b still holds it: keep the file
    assert store.datasets.get("a", dataset_id) is None and store.datasets.get("b", dataset_id) is not None
    assert store.datasets.delete("a", dataset_id) is None
    assert store.datasets.delete("b", dataset_id) == 0
    assert store.datasets.owners(dataset_id) == set()


def test_a_delete_is_refused_while_a_queued_job_uses_it_and_allowed_once_it_ended(store: JobStore) -> None:
    dataset_id = _id("in use")
    store.datasets.create("a", dataset_id, 10, X, Y)
    spec = JobSpec.model_validate({"model": {"name": "mlp", "input_dim": 4, "classes": 4},
                                   "dataset": {"kind": "uploaded", "id": dataset_id}})
    job_id, _ = store.jobs.create(spec, "a", "cpu", lambda jid, pipe: None, store.redis.pipeline(transaction=True))
    assert store.datasets.add_job("a", dataset_id, job_id)
    assert store.datasets.get("a", dataset_id).jobs == [job_id]  # type: ignore[union-attr]
    with pytest.raises(DatasetInUseBy) as refused:
        store.datasets.delete("a", dataset_id)
    assert (refused.value.job_id, refused.value.state) == (job_id, "queued")
    assert store.datasets.get("a", dataset_id) is not None  # nothing deleted
    store.jobs.transition(job_id, JobState.CANCELED, [JobState.QUEUED], "canceled")
    assert store.datasets.delete("a", dataset_id) == 0
    assert not store.datasets.add_job("a", dataset_id, job_id)  # the record is gone: nothing to add to
