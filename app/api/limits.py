"""Refuse request bodies over a size limit with 413, before any route reads them."""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

MAX_BODY_BYTES = 1 * 2**20
"""1 MiB: a job spec, keras_json included, is far smaller."""


class BodySizeLimit:
    """Checks Content-Length up front, and counts the bytes of chunked bodies. A POST to one of the `streamed`
    paths is passed through untouched: its route reads the body as a stream, under a limit of its own."""

    def __init__(self, app: ASGIApp, max_bytes: int = MAX_BODY_BYTES, streamed: frozenset[str] = frozenset()) -> None:
        self.app, self.max_bytes, self.streamed = app, max_bytes, streamed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (scope["method"] == "POST" and scope["path"] in self.streamed):
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(send)
            return
        # Read the whole body first (routes buffer it anyway), so an oversized
        # stream is refused before any route or parser sees a byte of it.
        messages, received = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                await self._refuse(send)
                return
            if not message.get("more_body", False):
                break
        replay = iter(messages)

        async def replayed() -> Message:
            return next(replay, None) or await receive()

        await self.app(scope, replayed, send)

    async def _refuse(self, send: Send) -> None:
        body = json.dumps({"detail": f"Request body is larger than {self.max_bytes} bytes."}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
