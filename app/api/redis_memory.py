"""Redis's memory as the API sees it: INFO memory, read at most once a second, and whether a new job fits."""

from __future__ import annotations

import time

from redis import Redis

from app.api.resources import RedisMemory
from app.core.errors import RedisFull


class MemoryGauge:
    """Redis's used memory against its `maxmemory`, for `/readyz`, `/metrics` and the check that
    refuses new jobs past `high_water` of it. A reading is reused for TTL_S, so that check costs
    no round trip on most requests."""

    TTL_S = 1.0

    def __init__(self, redis: Redis, high_water: float) -> None:
        self.redis, self.high_water = redis, high_water
        self._reading: tuple[float, RedisMemory] | None = None

    def read(self, max_age_s: float = TTL_S) -> RedisMemory:
        """The latest reading, if younger than `max_age_s`; else a fresh one."""
        now, reading = time.monotonic(), self._reading
        if reading is not None and now - reading[0] < max_age_s:
            return reading[1]
        info = self.redis.info("memory")
        used, limit = int(info["used_memory"]), int(info["maxmemory"])
        fraction = used / limit if limit else None
        memory = RedisMemory(used_memory_bytes=used, maxmemory_bytes=limit, used_fraction=fraction,
                             high_water=self.high_water, accepting_jobs=fraction is None or fraction < self.high_water)
        self._reading = (now, memory)
        return memory

    def require_room(self) -> None:
        """Raise RedisFull when Redis is past the high-water mark: before a new job writes anything."""
        memory = self.read()
        if not memory.accepting_jobs:
            raise RedisFull(memory.used_memory_bytes, memory.maxmemory_bytes, self.high_water)

    def refused(self) -> RedisFull:
        """The error for a write Redis refused as out of memory, with fresh figures."""
        memory = self.read(max_age_s=0)
        return RedisFull(memory.used_memory_bytes, memory.maxmemory_bytes or memory.used_memory_bytes,
                         self.high_water, refused=True)
