"""Idempotency keys: written in the same MULTI/EXEC as what they name, so a key exists exactly when its record does."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass

from redis.client import Pipeline
from redis.exceptions import WatchError

from app.core.errors import IdempotencyConflict, IdempotencyKeyContended
from app.store.keys import comparison_idempotency_key, idempotency_key

IDEMPOTENCY_TTL_S = 24 * 3600
"""How long an Idempotency-Key is remembered."""
MAX_RACES = 8
"""Most reads of one key per request. A read is repeated only when another request wrote the key
between this one's read and its write (and so created what it names): the next read returns that."""


@dataclass(frozen=True)
class IdempotencyKey:
    """A request's Idempotency-Key as stored: its Redis key, the request's fingerprint (a hash of its
    spec) and the field of the stored record that names what the first request created."""

    redis_key: str
    fingerprint: str
    names: str
    what: str
    """The request's body in words, for the conflict's message: "job spec", "comparison spec"."""

    @classmethod
    def for_job(cls, tenant: str, key: str, spec_json: str) -> IdempotencyKey:
        return cls(idempotency_key(tenant, key), _fingerprint(spec_json), "job_id", "job spec")

    @classmethod
    def for_comparison(cls, tenant: str, key: str, spec_json: str) -> IdempotencyKey:
        return cls(comparison_idempotency_key(tenant, key), _fingerprint(spec_json), "comparison_id",
                   "comparison spec")


def _fingerprint(spec_json: str) -> str:
    return hashlib.sha256(spec_json.encode()).hexdigest()


def write_once(pipe: Pipeline, key: IdempotencyKey | None, exists: Callable[[str], bool],
               write: Callable[[Pipeline], str]) -> tuple[str, bool]:
    """Run `write` (it queues a record's writes on `pipe`, inside its MULTI, and returns the record's
    id) and EXEC it with the key; or, if the key already names a record that `exists`, return that.
    Returns (id, created).

    The key is WATCHed, read, then set in the MULTI/EXEC that writes the record: a crash at any point
    leaves both or neither, and of concurrent requests with one key one EXECs, the others see the key
    changed, read it again and return its record. A key that names no record (one an older version
    left, a record deleted by hand) names nothing that was made: the request reclaims it.

    Only EXEC's WatchError is a race, or a connection lost at EXEC, which may have written the record:
    either way the key is read again. One from WATCH or GET is redis-py wrapping an error of Redis itself
    ("A BusyLoadingError occurred while watching one or more keys"): it propagates, a 503 (app/main.py).

    Raises IdempotencyConflict when the key names a record made from another fingerprint.
    """
    with pipe:
        for _ in range(MAX_RACES):
            if key is not None:
                pipe.watch(key.redis_key)  # type: ignore[no-untyped-call]  # redis-py leaves it untyped
                held = pipe.get(key.redis_key)
                record = json.loads(held) if held else {}
                made = record.get(key.names)
                if made is not None and exists(made):
                    if record.get("fingerprint") != key.fingerprint:
                        raise IdempotencyConflict(key.what)
                    return str(made), False
            pipe.multi()
            created = write(pipe)
            if key is not None:
                pipe.set(key.redis_key, json.dumps({"fingerprint": key.fingerprint, key.names: created}),
                         ex=IDEMPOTENCY_TTL_S)
            try:
                pipe.execute()
            except WatchError:
                continue  # another request wrote the key first: read what it made
            return created, True
    raise IdempotencyKeyContended(MAX_RACES)
