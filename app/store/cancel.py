"""Cancel flags: the API raises one on a running job; its worker reads it between steps and stops."""

from __future__ import annotations

from app.store.base import RedisBacked
from app.store.keys import job_key


class CancelFlags(RedisBacked):
    def request_cancel(self, job_id: str) -> None:
        self.redis.hset(job_key(job_id), "cancel_requested", 1)

    def cancel_requested(self, job_id: str) -> bool:
        return self.redis.hget(job_key(job_id), "cancel_requested") == "1"
