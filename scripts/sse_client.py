"""A lean asyncio SSE client for many streams at once (tests, benchmarks): raw HTTP/1.1, chunked bodies, each
body checked whole, every event stamped with its arrival time."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Received:
    """One event as it arrived."""

    kind: str
    id: str | None
    data: str
    at: float
    """time.time() when it was parsed."""


@dataclass
class Stream:
    """One open stream: its status and headers, then its events as `events()` reads them. `whole` is True once
    the body ended with its last chunk, False if the connection was cut before."""

    status: int
    headers: dict[str, str]
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    whole: bool | None = None
    body: bytes = b""
    """A response that is not an event stream (a 503, a 404): its body."""
    received: list[Received] = field(default_factory=list)

    async def events(self) -> AsyncIterator[Received]:
        """Each event of the body, in order, until it ends (whole or cut)."""
        buffer = ""
        try:
            while True:
                size = int((await self.reader.readline()).split(b";")[0] or b"x", 16)
                if size == 0:
                    await self.reader.readline()
                    self.whole = True
                    return
                chunk = await self.reader.readexactly(size + 2)
                buffer += chunk[:-2].decode()
                while "\n\n" in buffer:
                    block, buffer = buffer.split("\n\n", 1)
                    event = _parse(block)
                    if event is not None:
                        self.received.append(event)
                        yield event
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            self.whole = False
        finally:
            self.close()

    def close(self) -> None:
        self.writer.close()

    def steps(self) -> list[int]:
        return [int(e.id) for e in self.received if e.kind == "metrics" and e.id is not None]


def _parse(block: str) -> Received | None:
    kind, event_id, data = "message", None, []
    for line in block.split("\n"):
        if line.startswith(":") or not line:
            continue
        key, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if key == "event":
            kind = value
        elif key == "id":
            event_id = value
        elif key == "data":
            data.append(value)
    return Received(kind, event_id, "\n".join(data), time.time()) if data else None


async def open_stream(host: str, port: int, path: str, headers: dict[str, str] | None = None,
                      receive_buffer: int | None = None) -> Stream:
    """GET `path` and read the status line and headers; a non-2xx answer's body is read whole (`body`).
    `receive_buffer` sets the socket's SO_RCVBUF (a small one makes a client that stops reading slow at once)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if receive_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, port))
    reader, writer = await asyncio.open_connection(sock=sock)
    lines = [f"GET {path} HTTP/1.1", f"Host: {host}:{port}", "Accept: text/event-stream",
             *(f"{k}: {v}" for k, v in (headers or {}).items())]
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
    head = (await reader.readuntil(b"\r\n\r\n")).decode().split("\r\n")
    status = int(head[0].split()[1])
    fields = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in head[1:] if line)}
    stream = Stream(status, fields, reader, writer)
    if status >= 300:
        if "content-length" in fields:
            stream.body = await reader.readexactly(int(fields["content-length"]))
        stream.close()
    return stream
