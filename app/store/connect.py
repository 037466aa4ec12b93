"""Redis clients, built in one place: a stale pooled connection is checked and retried once; Redis unavailable, named.

Every client the API and the worker make comes from here (`client`, `async_client`, and the worker's RQ
connection, `waiting_client`). Built with `Redis.from_url` alone, redis-py 8.1 gives a connection no
retry at all (`Retry(NoBackoff(), 0)`: the 10 retries of its default apply only to `Redis(host=...)`),
and the asyncio pool hands out a connection whose server has gone without noticing: after a Redis
restart the next command on it failed with "Connection closed by server", a 503 long after Redis was
back. So each connection idle HEALTH_CHECK_S is PINGed before it is used, and a command that meets a
closed connection is sent once more on a fresh one.

Only `ConnectionError` is retried (for the API and the store): it means the command found no live
server, or lost it. `TimeoutError` is not: a command that timed out may still run, and
a second INCR, XADD `*` or MULTI/EXEC would be written twice. A connection that drops after Redis ran a
command and before its reply is the one case a retry repeats: a WATCHed MULTI/EXEC (an Idempotency-Key)
is never repeated (redis-py raises WatchError, and the key is read again: app/store/idempotency.py), a
resent step batch counts once (app/store/streams.py), a transition or a reap script repeated finds
the state already moved; an unkeyed create repeated writes the same job id again, with a second
`queued` event and queue entry (the second run of it skips a job that is no longer queued).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio
from redis import Redis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialWithJitterBackoff, NoBackoff
from redis.exceptions import (
    ClusterDownError,
    ConnectionError,
    ReadOnlyError,
    TimeoutError,
    TryAgainError,
)
from redis.retry import Retry

log = logging.getLogger("mpjobs.redis")
T = TypeVar("T")

UNAVAILABLE: tuple[type[Exception], ...] = (ConnectionError, TimeoutError, ReadOnlyError, ClusterDownError,
                                            TryAgainError)
"""What redis-py raises while Redis starts, loads its data, or fails over: unreachable, refused or closed
(`ConnectionError`), still loading (`BusyLoadingError`, a ConnectionError, "LOADING"), too slow
(`TimeoutError`), a replica that does not take writes yet (`ReadOnlyError`), a primary not yet elected
(`ClusterDownError`, its `MasterDownError`), or a slot moving (`TryAgainError`). Each passes with time:
the API answers 503 with Retry-After (app/main.py), the worker waits (`waiting_client`)."""
HEALTH_CHECK_S = 1
"""A pooled connection idle this long is PINGed before its next command: one that Redis closed is
replaced before a command is sent on it (redis-py's `health_check_interval`)."""
CONNECT_TIMEOUT_S = 2.0
"""Longest a connect may take; a Redis host that drops packets is unavailable, not a hang."""
WAIT_CAP_S = 2.0
"""Longest pause between two tries of `waiting_client` while Redis is away."""


def shown(url: str) -> str:
    """The URL of a Redis for a log line: any password replaced by `***`.

    >>> shown("redis://:secret@redis:6379/0")
    'redis://:***@redis:6379/0'
    """
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def client(url: str, *, decode_responses: bool = True, socket_timeout: float | None = None) -> Redis:
    """A client whose pooled connections are checked when idle and whose command is sent once more on a
    fresh connection after a ConnectionError. `decode_responses=False` for RQ (it stores pickles)."""
    return Redis.from_url(url, decode_responses=decode_responses, socket_timeout=socket_timeout,
                          socket_connect_timeout=CONNECT_TIMEOUT_S, health_check_interval=HEALTH_CHECK_S,
                          retry=Retry(NoBackoff(), 1, supported_errors=(ConnectionError,)))


def async_client(url: str) -> redis.asyncio.Redis:
    """The asyncio client of the API's reads, on the same terms as `client` (an asyncio Retry: redis-py's
    synchronous one would hand back the coroutine unawaited, and so never retry)."""
    return redis.asyncio.Redis.from_url(url, decode_responses=True, socket_connect_timeout=CONNECT_TIMEOUT_S,
                                        health_check_interval=HEALTH_CHECK_S,
                                        retry=AsyncRetry(NoBackoff(), 1, supported_errors=(ConnectionError,)))


class UntilStopped(Retry):
    """Retries a command while Redis is unavailable, without limit, a pause of up to WAIT_CAP_S between
    tries; logs once when Redis goes and once when it answers again (a connection Redis closed, which one
    retry on a new connection mends, is not logged). Once `stop` is set (the process was asked to end),
    the next failure is raised instead.

    One instance serves every connection of its pool: redis-py deep-copies a client's Retry into each
    connection, and a copy of `stop` would never be set."""

    def __init__(self, url: str, stop: threading.Event) -> None:
        super().__init__(ExponentialWithJitterBackoff(cap=WAIT_CAP_S, base=0.05), -1,
                         supported_errors=(ConnectionError, TimeoutError))
        self.url, self.stop = url, stop
        self.waiting = False

    def __deepcopy__(self, memo: dict[int, Any]) -> UntilStopped:
        return self

    def call_with_retry(self, do: Callable[[], T], fail: Callable[..., Any],
                        is_retryable: Callable[[Exception], bool] | None = None,
                        with_failure_count: bool = False) -> T:
        failures = 0

        def failed(error: Exception, *count: int) -> None:
            nonlocal failures
            failures += 1
            fail(error, *count)  # redis-py's own: disconnect (and raise WatchError inside a WATCH)
            if self.stop.is_set():
                raise error
            if failures > 1 and not self.waiting:
                self.waiting = True
                log.warning("waiting for redis at %s: %s", shown(self.url), error)

        result = super().call_with_retry(do, failed, is_retryable, with_failure_count)
        if self.waiting:
            self.waiting = False
            log.info("redis at %s answers again", shown(self.url))
        return result


def waiting_client(url: str, stop: threading.Event) -> Redis:
    """The worker's RQ connection: every command waits for Redis (`UntilStopped`) instead of raising, so
    RQ's loop, which quits on a Redis error anywhere but its dequeue, never sees one. RQ's pickles: bytes."""
    return Redis.from_url(url, socket_connect_timeout=CONNECT_TIMEOUT_S, health_check_interval=HEALTH_CHECK_S,
                          retry=UntilStopped(url, stop))


LIVE_CLIENT = "mpjobs-live"
"""The CLIENT SETNAME of the API's live-stream connections (CLIENT LIST shows how many it holds)."""
POOL_WAIT_S = 10.0
"""Longest a live-stream read waits for one of its connections before it fails as Redis unavailable."""


def live_clients(url: str, read_connections: int) -> tuple[redis.asyncio.Redis, redis.asyncio.Redis]:
    """The live fan-out's clients, on the same terms as `async_client`: one connection for its XREAD of every
    watched stream (blocking, so no other command may wait behind it), and a pool of `read_connections` for
    viewers catching up. The pool blocks when all are busy: however many viewers, it holds no more."""
    common: dict[str, Any] = {
        "decode_responses": True, "socket_connect_timeout": CONNECT_TIMEOUT_S, "client_name": LIVE_CLIENT,
        "health_check_interval": HEALTH_CHECK_S,
        "retry": AsyncRetry(NoBackoff(), 1, supported_errors=(ConnectionError,))}
    reader = redis.asyncio.Redis.from_url(url, single_connection_client=True, **common)
    pool = redis.asyncio.BlockingConnectionPool.from_url(url, max_connections=read_connections, timeout=POOL_WAIT_S,
                                                         **common)
    return reader, redis.asyncio.Redis(connection_pool=pool)
