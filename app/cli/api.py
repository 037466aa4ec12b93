"""The mpjobs API over HTTP (httpx), and the one place its errors become exit codes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx

from app.cli.errors import CliError, Exit

STREAM_READ_TIMEOUT_S = 30.0
"""A quiet stream (a queued job) is reopened after this long; that is not an error."""


def _detail(response: httpx.Response) -> Any:
    try:
        return response.json().get("detail", response.text)
    except (ValueError, AttributeError):
        return response.text.strip() or response.reason_phrase


def _raise_for(response: httpx.Response) -> None:
    """The one place an HTTP error becomes an exit code and a message."""
    code = response.status_code
    if code < 400:
        return
    detail = _detail(response)
    if code == 422 and isinstance(detail, list):
        lines = []
        for error in detail:
            loc = [str(part) for part in error.get("loc", [])]
            field = ".".join(loc[1:] if loc[:1] == ["body"] else loc) or "body"
            lines.append(f"  {field}: {error.get('msg', error)}")
        raise CliError(Exit.USAGE, "the API refused the request (422):\n" + "\n".join(lines))
    if code == 404:
        raise CliError(Exit.NOT_FOUND, str(detail))
    if code in (401, 403):
        raise CliError(Exit.UNAVAILABLE, f"{detail} ({code}; pass --api-key or set MPJOBS_API_KEY)")
    if 400 <= code < 500:
        raise CliError(Exit.USAGE, f"{detail} ({code})")
    raise CliError(Exit.UNAVAILABLE, f"the API answered {code}: {detail}")


class Api:
    """The mpjobs API at `url`. `transport` is the test seam (e.g. httpx.MockTransport)."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 30.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.url = url
        self.timeout = timeout
        self.client = httpx.Client(base_url=url, headers=headers, timeout=timeout, transport=transport)

    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self.client.request(method, path, **kwargs)
        except httpx.TimeoutException as exc:
            raise CliError(Exit.UNAVAILABLE, f"the API at {self.url} did not answer within {self.timeout:g} s "
                                             "(--timeout)") from exc
        except httpx.HTTPError as exc:
            raise CliError(Exit.UNAVAILABLE, f"cannot reach the API at {self.url}: {exc}") from exc
        _raise_for(response)
        if response.status_code == 204:  # done, nothing to say: a delete
            return None
        try:
            return response.json()
        except ValueError as exc:
            raise CliError(Exit.UNAVAILABLE, f"{self.url}{path} did not answer JSON; is --url right?") from exc

    def events(self, job_id: str, after: int) -> Iterator[tuple[str, str]]:
        """(event, data) from the job's Server-Sent Events, starting after step `after`."""
        timeout = httpx.Timeout(self.timeout, read=max(self.timeout, STREAM_READ_TIMEOUT_S))
        with self.client.stream("GET", f"/jobs/{job_id}/metrics/stream", params={"after": after},
                                timeout=timeout) as response:
            if response.status_code >= 400:
                response.read()
                _raise_for(response)
            event, data = "message", list[str]()
            for line in response.iter_lines():
                if not line:
                    if data:
                        yield event, "\n".join(data)
                    event, data = "message", []
                elif not line.startswith(":"):
                    key, _, value = line.partition(":")
                    value = value.removeprefix(" ")
                    if key == "event":
                        event = value
                    elif key == "data":
                        data.append(value)
