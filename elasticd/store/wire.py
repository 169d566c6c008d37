"""A lean HTTP/1.1 client for the store's JSON API: asyncio streams and a keep-alive pool.

Why not httpx here: the store client is on every hot path of a multi-node
job (rendezvous steps, job updates, event publication), and httpx spends
about 0.6 ms of CPU per request on this kind of machine, four times what
the store server spends answering it. This client does only what the store
needs: ``Content-Length`` bodies (and chunked ones, for robustness), JSON,
keep-alive. Anything unusual (https, an injected transport) still goes
through httpx.

A request that fails on a *reused* connection before a single byte of the
answer arrived is sent again once on a fresh connection: the server closed
that idle connection without reading the request (keep-alive expiry), so
nothing was applied. Any other failure is reported, never retried, because a
compare-and-set must not be applied twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode

#: Idle pooled connections kept per store (watches hold their own while they wait).
POOL_SIZE = 64
MAX_HEADER_BYTES = 64 * 1024


class WireError(Exception):
    """The connection failed; ``sent_nothing`` tells whether a retry is safe."""

    def __init__(self, message: str, *, safe_to_retry: bool = False) -> None:
        super().__init__(message)
        self.safe_to_retry = safe_to_retry


@dataclass
class WireResponse:
    """The parts of an answer the store client reads."""

    status_code: int
    reason_phrase: str
    headers: dict[str, str]
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")

    def json(self) -> Any:
        return json.loads(self.content)


@dataclass
class _Conn:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    reused: bool = False


@dataclass
class WireClient:
    """Requests to one ``host:port``, over a small pool of keep-alive connections."""

    host: str
    port: int
    headers: dict[str, str] = field(default_factory=dict)
    _idle: list[_Conn] = field(default_factory=list)

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, Any] | None = None,
        body: Any = None,
        timeout: float,
    ) -> WireResponse:
        target = path
        if params:
            target += "?" + urlencode(
                {k: (str(v).lower() if isinstance(v, bool) else v) for k, v in params.items()}
            )
        payload = b"" if body is None else json.dumps(body, separators=(",", ":")).encode()
        head = [f"{method} {target} HTTP/1.1", f"Host: {self.host}:{self.port}"]
        head += [f"{k}: {v}" for k, v in self.headers.items()]
        if body is not None:
            head.append("Content-Type: application/json")
        head.append(f"Content-Length: {len(payload)}")
        raw = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + payload
        async with asyncio.timeout(timeout):
            try:
                return await self._exchange(raw)
            except WireError as exc:
                if not exc.safe_to_retry:
                    raise
            return await self._exchange(raw, fresh=True)

    async def _exchange(self, raw: bytes, *, fresh: bool = False) -> WireResponse:
        conn = None if fresh else self._take()
        if conn is None:
            try:
                reader, writer = await asyncio.open_connection(self.host, self.port)
            except OSError as exc:
                # asyncio's strerror is "Connect call failed (...)"; say what the OS said.
                reason = os.strerror(exc.errno) if exc.errno else str(exc)
                raise WireError(reason) from exc
            conn = _Conn(reader, writer)
        done = False
        try:
            try:
                conn.writer.write(raw)
                await conn.writer.drain()
                line = await conn.reader.readline()
            except (OSError, asyncio.IncompleteReadError) as exc:
                raise WireError(str(exc) or type(exc).__name__, safe_to_retry=conn.reused) from exc
            if not line:
                raise WireError("the server closed the connection", safe_to_retry=conn.reused)
            response, keep = await self._read_rest(conn.reader, line)
            done = True
        finally:
            if done and keep and not conn.writer.is_closing():
                conn.reused = True
                self._give(conn)
            else:
                conn.writer.close()
        return response

    async def _read_rest(
        self, reader: asyncio.StreamReader, status_line: bytes
    ) -> tuple[WireResponse, bool]:
        try:
            _version, code, *reason = status_line.decode("latin-1").rstrip("\r\n").split(" ", 2)
            status = int(code)
        except ValueError as exc:
            raise WireError(f"not an HTTP answer: {status_line[:80]!r}") from exc
        headers: dict[str, str] = {}
        size = 0
        while True:
            line = await reader.readline()
            size += len(line)
            if size > MAX_HEADER_BYTES:
                raise WireError("the answer's headers are too large")
            if line in (b"\r\n", b"\n", b""):
                break
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        try:
            if headers.get("transfer-encoding", "").lower() == "chunked":
                content = await _read_chunked(reader)
            else:
                content = await reader.readexactly(int(headers.get("content-length", "0")))
        except (asyncio.IncompleteReadError, ValueError) as exc:
            raise WireError(f"the answer was cut short: {exc}") from exc
        keep = headers.get("connection", "").lower() != "close"
        return WireResponse(status, reason[0] if reason else "", headers, content), keep

    def _take(self) -> _Conn | None:
        while self._idle:
            conn = self._idle.pop()
            if not conn.writer.is_closing() and not conn.reader.at_eof():
                return conn
            conn.writer.close()
        return None

    def _give(self, conn: _Conn) -> None:
        if len(self._idle) < POOL_SIZE:
            self._idle.append(conn)
        else:
            conn.writer.close()

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.writer.close()
        for conn in idle:
            with contextlib.suppress(OSError):
                await conn.writer.wait_closed()


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    parts: list[bytes] = []
    while True:
        size_line = await reader.readline()
        size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
        if size == 0:
            while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                pass  # trailers
            return b"".join(parts)
        parts.append(await reader.readexactly(size))
        await reader.readexactly(2)
