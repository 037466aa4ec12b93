"""What every part of the store shares: the Redis connection (passed in, never owned) and its Lua scripts."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from redis import Redis
from redis.commands.core import Script

# Set fields of a hash that exists, and never create one: a late write (a cancel flag, a phase, a
# resumed attempt's step) must not bring back a job deleted meanwhile as a record of one field.
HSET_EXISTING = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
"""


class RedisBacked:
    """A part of the store, on the connection it is given. Its `SCRIPTS` (name -> Lua source, with those of the
    classes it derives from) are registered when it is made."""

    SCRIPTS: ClassVar[dict[str, str]] = {"hset_existing": HSET_EXISTING}

    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self._scripts: dict[str, Script] = {
            name: redis.register_script(lua)
            for cls in reversed(type(self).__mro__) for name, lua in vars(cls).get("SCRIPTS", {}).items()
        }

    def _run(self, script: str, keys: list[str], args: list[Any]) -> Any:
        return self._scripts[script](keys=keys, args=args)

    def _hset_existing(self, key: str, fields: Mapping[str, str | int]) -> bool:
        """HSET `fields` on `key` if that hash exists. Returns whether it did."""
        return bool(self._run("hset_existing", [key], [part for item in fields.items() for part in item]))
