"""Idempotency keys: the first request with a key claims a job id for it; repeats get that job."""

from __future__ import annotations

import json
import uuid

from app.store.base import RedisBacked
from app.store.keys import idempotency_key

IDEMPOTENCY_TTL_S = 24 * 3600
"""How long an Idempotency-Key is remembered."""


class Idempotency(RedisBacked):
    def claim_idempotency_key(self, tenant: str, key: str, fingerprint: str) -> tuple[bool, str, str]:
        """SET NX a new job id under the key. Returns (claimed, fingerprint, job_id) of the holder."""
        job_id = uuid.uuid4().hex
        record = json.dumps({"fingerprint": fingerprint, "job_id": job_id})
        if self.redis.set(idempotency_key(tenant, key), record, nx=True, ex=IDEMPOTENCY_TTL_S):
            return True, fingerprint, job_id
        held = json.loads(self.redis.get(idempotency_key(tenant, key)) or record)
        return False, held["fingerprint"], held["job_id"]

    def release_idempotency_key(self, tenant: str, key: str) -> None:
        self.redis.delete(idempotency_key(tenant, key))
