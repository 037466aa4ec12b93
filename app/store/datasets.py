"""Uploaded datasets' records: per tenant, by the SHA-256 of their bytes, with the jobs that train on them.

The file itself (`<ARTIFACTS_DIR>/datasets/{sha256}.npz`) is shared by every tenant that uploaded the same
bytes; `dataset-owners:{id}` says who still holds a record of it, so the last delete removes the file.
"""

from __future__ import annotations

import json
from typing import Any

from app.core import clock
from app.store.base import RedisBacked
from app.store.keys import dataset_index_key, dataset_jobs_key, dataset_key, dataset_owners_key, job_key
from mpjobs.contract.datasets import ArrayShape, DatasetRecord
from mpjobs.contract.jobs import JobState

# Delete a tenant's record unless one of its jobs that is queued or running trains on it: {'missing'},
# {'in_use', job id, state}, or {'deleted', tenants still holding a record of the same file}.
DELETE_DATASET = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {'missing'} end
for _, job in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  local state = redis.call('HGET', ARGV[3] .. job, 'state')
  if state == ARGV[4] or state == ARGV[5] then return {'in_use', job, state} end
end
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('SREM', KEYS[4], ARGV[2])
return {'deleted', tostring(redis.call('SCARD', KEYS[4]))}
"""

# Record a tenant's dataset unless it has one of the same bytes: 1 if this wrote it, 0 if it was there.
CREATE_DATASET = """
redis.call('SADD', KEYS[3], ARGV[1])
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 4))
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[2])
return 1
"""

# Add a job to the dataset's users only while the record exists: 1 if it did.
ADD_JOB = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('SADD', KEYS[2], ARGV[1])
return 1
"""


class DatasetInUseBy(Exception):
    """The delete found a queued or running job training on the dataset: nothing was deleted."""

    def __init__(self, job_id: str, state: str) -> None:
        super().__init__(job_id, state)
        self.job_id, self.state = job_id, state


class Datasets(RedisBacked):
    """Dataset records, `(tenant, id)` each; the id is the SHA-256 of the `.npz` bytes."""

    SCRIPTS = {"create_dataset": CREATE_DATASET, "delete_dataset": DELETE_DATASET, "add_job": ADD_JOB}

    def create(self, tenant: str, dataset_id: str, size: int, x: ArrayShape, y: ArrayShape
               ) -> tuple[DatasetRecord, bool]:
        """Record the tenant's dataset, unless it already has one of these bytes. Returns (record, created)."""
        record = {"id": dataset_id, "bytes": size, "x": x.model_dump_json(), "y": y.model_dump_json(),
                  "created_at": clock.iso()}
        keys = [dataset_key(tenant, dataset_id), dataset_index_key(tenant), dataset_owners_key(dataset_id)]
        fields = [part for item in record.items() for part in item]
        created = bool(self._run("create_dataset", keys, [tenant, dataset_id, clock.now().timestamp(), *fields]))
        found = self.get(tenant, dataset_id)
        assert found is not None  # written above, and deletes of it are this tenant's own
        return found, created

    def get(self, tenant: str, dataset_id: str) -> DatasetRecord | None:
        """The tenant's dataset, or None: another tenant's is none."""
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(dataset_key(tenant, dataset_id))
            pipe.smembers(dataset_jobs_key(tenant, dataset_id))
            raw, jobs = pipe.execute()
        if not raw:
            return None
        return self._record(raw, self._existing(sorted(jobs)))

    def list_datasets(self, tenant: str) -> list[DatasetRecord]:
        """The tenant's datasets, newest first."""
        ids = self.redis.zrevrange(dataset_index_key(tenant), 0, -1)
        found = (self.get(tenant, str(dataset_id)) for dataset_id in ids)
        return [record for record in found if record is not None]

    def add_job(self, tenant: str, dataset_id: str, job_id: str) -> bool:
        """Note that `job_id` trains on the dataset. Returns False when the record is gone."""
        keys = [dataset_key(tenant, dataset_id), dataset_jobs_key(tenant, dataset_id)]
        return bool(self._run("add_job", keys, [job_id]))

    def delete(self, tenant: str, dataset_id: str) -> int | None:
        """Delete the tenant's record. Returns how many tenants still hold one of the same file (0: remove it),
        or None when there was none.

        Raises:
            DatasetInUseBy: a queued or running job of the tenant trains on it; nothing was deleted.
        """
        keys = [dataset_key(tenant, dataset_id), dataset_jobs_key(tenant, dataset_id),
                dataset_index_key(tenant), dataset_owners_key(dataset_id)]
        answer = self._run("delete_dataset", keys, [dataset_id, tenant, job_key(""), JobState.QUEUED.value,
                                                    JobState.RUNNING.value])
        if answer[0] == "missing":
            return None
        if answer[0] == "in_use":
            raise DatasetInUseBy(str(answer[1]), str(answer[2]))
        return int(answer[1])

    def owners(self, dataset_id: str) -> set[str]:
        """The tenants holding a record of the file."""
        return {str(tenant) for tenant in self.redis.smembers(dataset_owners_key(dataset_id))}

    def _existing(self, job_ids: list[str]) -> list[str]:
        if not job_ids:
            return []
        with self.redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.exists(job_key(job_id))
            alive = pipe.execute()
        return [job_id for job_id, there in zip(job_ids, alive, strict=True) if there]

    @staticmethod
    def _record(raw: dict[str, Any], jobs: list[str]) -> DatasetRecord:
        return DatasetRecord(id=raw["id"], sha256=raw["id"], bytes=int(raw["bytes"]),
                             x=ArrayShape(**json.loads(raw["x"])), y=ArrayShape(**json.loads(raw["y"])),
                             created_at=raw["created_at"], jobs=jobs)
