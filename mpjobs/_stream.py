"""A job's Server-Sent Events, followed across dropped connections and API restarts by `Last-Event-ID`."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx

from mpjobs._exceptions import ServerError, Unreachable, WaitTimeout, raise_for

STREAM_READ_TIMEOUT_S = 30.0
"""A quiet stream (a queued job sends nothing) is reopened after this long; that is not an error."""
log = logging.getLogger("mpjobs")

GIVE_UP_S = 60.0
"""Reconnecting stops once the API has been unreachable (or answering 5xx) this long."""
RECONNECT_S = 0.5
"""The pause before a dropped stream is reopened."""
MAX_RETRY_AFTER_S = 30.0
"""The longest pause a 503's Retry-After may ask for before the stream is reopened."""


@dataclass(frozen=True)
class Event:
    """One Server-Sent Event: `kind` is `metrics` (its `id` the step), `layers`, `evaluation`, `state` or `end`
    (`follow` handles `error`, the API's word that the stream ended early, by resuming)."""

    kind: str
    data: str
    id: str | None = None

    def json(self) -> Any:
        return json.loads(self.data)


def parse(lines: Iterable[str]) -> Iterator[Event]:
    """Events from the lines of an SSE body (comments skipped, multi-line data joined).

    >>> list(parse(["id: 3", "event: metrics", 'data: {"step": 3}', "", ": keep-alive", ""]))
    [Event(kind='metrics', data='{"step": 3}', id='3')]
    """
    kind, data, event_id = "message", list[str](), None
    for line in lines:
        if not line:
            if data:
                yield Event(kind, "\n".join(data), event_id)
            kind, data, event_id = "message", [], None
        elif not line.startswith(":"):
            key, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if key == "event":
                kind = value
            elif key == "data":
                data.append(value)
            elif key == "id":
                event_id = value


def open_events(http: httpx.Client, job_id: str, after: int, read_timeout: float) -> Iterator[Event]:
    """One connection to the job's stream, from after step `after` (sent as `Last-Event-ID`)."""
    timeout = httpx.Timeout(http.timeout.connect, read=read_timeout, write=http.timeout.write,
                            pool=http.timeout.pool)
    with http.stream("GET", f"/jobs/{job_id}/metrics/stream", headers={"Last-Event-ID": str(after)},
                     timeout=timeout) as response:
        if response.status_code >= 400:
            response.read()
            raise_for(response)
        yield from parse(response.iter_lines())


def follow(http: httpx.Client, job_id: str, after: int = 0, deadline: float | None = None,
           give_up_s: float = GIVE_UP_S) -> Iterator[Event]:
    """Every event of the job from after step `after` until `end`, each step once and in order.

    A connection that drops (the API restarted, a proxy cut it) is reopened after the last step
    received, so no step is lost or sent twice; a state change seen before is not repeated. An API
    unreachable for `give_up_s` raises `Unreachable`; past `deadline` (time.monotonic()) `WaitTimeout`.
    """
    seen: set[tuple[Any, Any]] = set()
    heard = time.monotonic()
    url = str(http.base_url).rstrip("/")
    while True:
        left = _left(deadline, job_id)
        read_timeout = STREAM_READ_TIMEOUT_S if left is None else max(0.1, min(left, STREAM_READ_TIMEOUT_S))
        pause = RECONNECT_S
        try:
            for event in open_events(http, job_id, after, read_timeout):
                heard = time.monotonic()
                _left(deadline, job_id)
                if event.kind == "error":
                    # The API ended the stream early and said why (this client fell behind, Redis went away):
                    # resume after the last step received.
                    why = event.json()
                    log.info("the stream of job %s ended early (%s): %s; resuming after step %d", job_id,
                             why.get("reason"), why.get("detail"), after)
                    break
                if event.kind == "metrics":
                    step = int(event.id) if event.id is not None else event.json()["step"]
                    if step <= after:
                        continue
                    after = step
                elif event.kind == "state":
                    payload = event.json()
                    if (payload.get("state"), payload.get("at")) in seen:
                        continue
                    seen.add((payload.get("state"), payload.get("at")))
                yield event
                if event.kind == "end":
                    return
        except httpx.ReadTimeout:
            heard = time.monotonic()  # a quiet stream (a queued job), not a lost API
            continue
        except (httpx.TransportError, ServerError) as exc:
            if time.monotonic() - heard > give_up_s:
                raise Unreachable(f"lost the API at {url} for {give_up_s:.0f} s: {exc}") from exc
            if isinstance(exc, ServerError) and exc.retry_after is not None:
                pause = min(max(exc.retry_after, RECONNECT_S), MAX_RETRY_AFTER_S)  # e.g. its stream limit
        time.sleep(pause)  # the stream ended early or failed: reopen it after the last step received


def _left(deadline: float | None, job_id: str) -> float | None:
    """Seconds left before `deadline` (None: no deadline); `WaitTimeout` once it has passed."""
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise WaitTimeout(f"job {job_id} had not ended when the wait ran out")
    return left
