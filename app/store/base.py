"""What every part of the store shares: the Redis connection (passed in, never owned) and its Lua scripts."""

from __future__ import annotations

from typing import Any, ClassVar

from redis import Redis
from redis.commands.core import Script


class RedisBacked:
    """A part of the store. Its `SCRIPTS` (name -> Lua source) are registered once per store."""

    SCRIPTS: ClassVar[dict[str, str]] = {}

    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self._scripts: dict[str, Script] = {
            name: redis.register_script(lua)
            for cls in reversed(type(self).__mro__) for name, lua in vars(cls).get("SCRIPTS", {}).items()
        }

    def _run(self, script: str, keys: list[str], args: list[Any]) -> Any:
        return self._scripts[script](keys=keys, args=args)
