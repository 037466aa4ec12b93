"""The client's errors: one tree, and the one place an HTTP answer or an httpx error becomes one of them.

Error tree::

    MpjobsError
    ├── Unreachable          the API cannot be reached (connection refused, DNS, lost mid-stream for too long)
    │   └── Timeout          it did not answer within the client's timeout
    ├── BadResponse          it answered, but not what the mpjobs API answers (not JSON: is the url right?)
    ├── WaitTimeout          `Job.wait(timeout=...)` or `Comparison.wait(timeout=...)` ran out (also a TimeoutError)
    └── ApiError             the API refused the request: `status`, `reason`, `detail` (its body's "detail")
        ├── ClientError      4xx
        │   ├── Unauthorized 401 or 403: no API key, or not a valid one
        │   ├── NotFound     404: no such job or comparison (or another tenant's)
        │   ├── Conflict     409: already ended (`state`), Idempotency-Key reused, a delete refused
        │   └── InvalidSpec  422: `errors` lists each field and what is wrong with it
        └── ServerError      5xx
            └── Unavailable  503: Redis is unreachable or full; nothing was written, retrying later is safe

As with httpx's `HTTPStatusError`, the answer's status picks the class, and `detail` is the API's own words:

>>> import httpx
>>> error = error_for(httpx.Response(404, json={"detail": "No job with id 'x'."}))
>>> isinstance(error, NotFound), error.status, error.reason, str(error)
(True, 404, 'Not Found', "No job with id 'x'.")
"""

from __future__ import annotations

from typing import Any

import httpx


class MpjobsError(Exception):
    """Base of every error the client raises."""


class Unreachable(MpjobsError):
    """The API could not be reached; the message names its url."""


class Timeout(Unreachable):
    """A request got no answer within the client's `timeout`."""


class BadResponse(MpjobsError):
    """The server answered, but not as the mpjobs API does."""


class WaitTimeout(MpjobsError, TimeoutError):
    """A wait ran out before the job or comparison ended; it goes on running."""


class ApiError(MpjobsError):
    """The API answered with an error status. `detail` is its body's `detail`: a message, or for a 422 the
    list of validation errors; `body` is the whole body."""

    def __init__(self, status: int, reason: str, detail: Any, body: Any = None,
                 retry_after: float | None = None) -> None:
        super().__init__(detail if isinstance(detail, str) else f"{status} {reason}: {detail}")
        self.status, self.reason, self.detail, self.body = status, reason, detail, body
        self.retry_after = retry_after
        """Seconds the API asked the client to wait before trying again (its Retry-After), if it said."""


class ClientError(ApiError):
    """A 4xx: the request was refused as it stands."""


class Unauthorized(ClientError):
    """401 or 403: pass `api_key=` (or set MPJOBS_API_KEY)."""


class NotFound(ClientError):
    """404: no such job or comparison, or one of another tenant."""


class Conflict(ClientError):
    """409: a cancel of an ended job (`state` says how it ended), an Idempotency-Key reused with another
    spec, or a delete refused (nothing was deleted)."""

    @property
    def state(self) -> str | None:
        return self.body.get("state") if isinstance(self.body, dict) else None


class InvalidSpec(ClientError):
    """422: the spec (or a parameter) failed validation, or is over this deployment's limits."""

    @property
    def errors(self) -> list[tuple[str, str]]:
        """(field, message) per error, the field as a dotted path in the body: ("training.steps", "...")."""
        if not isinstance(self.detail, list):
            return [("body", str(self.detail))]
        found = []
        for error in self.detail:
            loc = [str(part) for part in error.get("loc", [])] if isinstance(error, dict) else []
            field = ".".join(loc[1:] if loc[:1] == ["body"] else loc) or "body"
            found.append((field, str(error.get("msg", error)) if isinstance(error, dict) else str(error)))
        return found

    def __str__(self) -> str:
        return "the API refused the request (422):\n" + "\n".join(f"  {f}: {m}" for f, m in self.errors)


class ServerError(ApiError):
    """A 5xx."""


class Unavailable(ServerError):
    """503: Redis is unreachable or over its memory high-water mark. Nothing was written."""


_BY_STATUS: dict[int, type[ApiError]] = {401: Unauthorized, 403: Unauthorized, 404: NotFound, 409: Conflict,
                                         422: InvalidSpec, 503: Unavailable}


def _body(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return None


def error_for(response: httpx.Response) -> ApiError:
    """The error an answer of status 400 or more stands for."""
    body = _body(response)
    detail = body.get("detail", body) if isinstance(body, dict) else (response.text.strip() or response.reason_phrase)
    code = response.status_code
    kind = _BY_STATUS.get(code, ClientError if code < 500 else ServerError)
    retry_after = response.headers.get("Retry-After", "")
    return kind(code, response.reason_phrase, detail, body, float(retry_after) if retry_after.isdigit() else None)


def raise_for(response: httpx.Response) -> None:
    if response.status_code >= 400:
        raise error_for(response)


def mapped(exc: httpx.HTTPError, url: str, timeout: float) -> MpjobsError:
    """An httpx error as the client's, naming the url (`raise mapped(exc, ...) from exc`)."""
    if isinstance(exc, httpx.TimeoutException):
        return Timeout(f"the API at {url} did not answer within {timeout:g} s")
    return Unreachable(f"cannot reach the API at {url}: {exc}")
