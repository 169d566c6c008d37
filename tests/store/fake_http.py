"""A scripted HTTP/1.1 server on loopback, for client tests that need a misbehaving peer.

Each accepted connection runs the test's handler with a :class:`FakeConn`; the
server records every request it read. Handlers that wait (to hang, or to let
the client read a first part) wait on ``server.release``, which teardown sets,
so no handler outlives the test.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

#: The head of a 200 answer whose body is streamed in chunks (see :func:`chunk`).
CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


def chunk(data: bytes) -> bytes:
    """``data`` as one chunk of a chunked body."""
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


@dataclass
class FakeConn:
    """One accepted connection."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    server: FakeServer

    async def request(self) -> tuple[str, dict[str, str], bytes] | None:
        """The next request: its request line, headers (lower-cased names) and body; None at EOF."""
        line = await self.reader.readline()
        if not line:
            return None
        headers: dict[str, str] = {}
        while (header := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = header.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        body = await self.reader.readexactly(int(headers.get("content-length", "0")))
        request = (line.decode("latin-1").rstrip("\r\n"), headers, body)
        self.server.requests.append(request)
        return request

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def answer(self, body: bytes, *, status: int = 200) -> None:
        """An answer with a Content-Length body, keeping the connection open."""
        head = f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
        await self.send(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)

    async def until_eof(self) -> None:
        """Wait until the client closes the connection."""
        while await self.reader.read(1024):
            pass


@dataclass
class FakeServer:
    """What the server saw; ``address`` is ``127.0.0.1:port``."""

    address: str
    requests: list[tuple[str, dict[str, str], bytes]] = field(default_factory=list)
    connections: int = 0
    release: asyncio.Event = field(default_factory=asyncio.Event)


@contextlib.asynccontextmanager
async def fake_http(
    handler: Callable[[FakeConn], Awaitable[None]], host: str = "127.0.0.1"
) -> AsyncIterator[FakeServer]:
    """Serve ``handler`` on a free port of ``host``; yields the server's record."""
    tasks: set[asyncio.Task[None]] = set()

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        tasks.add(task)
        record.connections += 1
        try:
            await handler(FakeConn(reader, writer, record))
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away: that is what many tests do
        finally:
            writer.close()

    server = await asyncio.start_server(accept, host, 0)
    port = server.sockets[0].getsockname()[1]
    record = FakeServer(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    try:
        yield record
    finally:
        record.release.set()
        server.close()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=5)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        await server.wait_closed()
