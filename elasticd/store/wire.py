"""A lean HTTP/1.1 client for the store's JSON API: asyncio streams and a keep-alive pool.

Why not httpx here: the store client is on every hot path of a multi-node
job (rendezvous steps, job updates, event publication), and httpx spends
about 0.6 ms of CPU per request on this kind of machine, four times what
the store server spends answering it; and httpcore's pool walks every open
connection on each request, so with a thousand requests and watches in
flight in one process most of the CPU goes to the pool's bookkeeping. This
client does only what the store needs: ``Content-Length`` bodies (and
chunked ones, for robustness), JSON, keep-alive, and streamed answers read
line by line (etcd's watch), and TLS when given an ``ssl.SSLContext``
(certificates verified as the context says; the server's name is the host
connected to). Anything unusual (an injected transport) still goes through
httpx.

A request that fails on a *reused* connection before a single byte of the
answer arrived is sent again once on a fresh connection: the server closed
that idle connection without reading the request (keep-alive expiry), so
nothing was applied. Any other failure is reported, never retried, because a
compare-and-set must not be applied twice. A connection that could not be
opened raises :class:`WireConnectError`: nothing was sent, so a caller may
try elsewhere. So does a TLS alert on the first read of a fresh connection
(the server refused the handshake, e.g. for a missing client certificate:
with TLS 1.3 the client learns it only then), because the server never
handed the request to its application.

A streamed answer (:meth:`WireClient.stream`) has a connection of its own,
closed when the stream is left, never pooled: it is usually abandoned
half-read.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import ssl
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode

#: Idle pooled connections kept per store (watches hold their own while they wait).
POOL_SIZE = 64
MAX_HEADER_BYTES = 64 * 1024
#: Largest piece read at once from a streamed answer without ``Transfer-Encoding: chunked``.
READ_SIZE = 64 * 1024


class WireError(Exception):
    """The connection failed; ``safe_to_retry`` tells whether sending again is safe."""

    def __init__(self, message: str, *, safe_to_retry: bool = False) -> None:
        super().__init__(message)
        self.safe_to_retry = safe_to_retry


class WireConnectError(WireError):
    """No connection could be opened (refused, unreachable, timed out): nothing was sent."""


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
class WireStream:
    """A streamed answer: its status and headers, and a body read as it arrives.

    Each read from the socket waits at most ``read_timeout`` seconds, and a
    read that waits longer raises ``TimeoutError``. The body can be read
    once, with :meth:`aread` or :meth:`aiter_lines`.
    """

    status_code: int
    reason_phrase: str
    headers: dict[str, str]
    read_timeout: float | None
    _reader: asyncio.StreamReader

    async def aiter_bytes(self) -> AsyncGenerator[bytes, None]:
        """The body in the pieces it arrives in, without the chunked framing."""
        chunked = self.headers.get("transfer-encoding", "").lower() == "chunked"
        left: int | None = None  # bytes still due, or None: until the server closes
        if not chunked and "content-length" in self.headers:
            try:
                left = int(self.headers["content-length"])
            except ValueError as exc:
                raise WireError(f"the answer's length is not a number: {exc}") from exc
        while left != 0:
            async with asyncio.timeout(self.read_timeout):
                try:
                    if chunked:
                        piece = await _read_chunk(self._reader)
                    else:
                        piece = await self._reader.read(
                            READ_SIZE if left is None else min(left, READ_SIZE)
                        )
                        if not piece and left is not None:
                            raise asyncio.IncompleteReadError(b"", left)
                except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
                    raise WireError(f"the answer was cut short: {_reason(exc)}") from exc
            if not piece:  # the last chunk, or the end of the connection
                return
            if left is not None:
                left -= len(piece)
            yield piece

    async def aiter_lines(self) -> AsyncGenerator[str, None]:
        """The body's lines (UTF-8, without their line break), each as soon as it is complete."""
        partial: list[bytes] = []  # the pieces of a line not yet complete
        async with contextlib.aclosing(self.aiter_bytes()) as pieces:
            async for piece in pieces:
                *complete, rest = piece.split(b"\n")
                if complete:
                    complete[0] = b"".join([*partial, complete[0]])
                    partial.clear()
                    for line in complete:
                        yield _text(line)
                if rest:
                    partial.append(rest)
        if partial:
            yield _text(b"".join(partial))

    async def aread(self) -> bytes:
        """The whole (rest of the) body."""
        async with contextlib.aclosing(self.aiter_bytes()) as pieces:
            return b"".join([piece async for piece in pieces])


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
    #: TLS for every connection when set (``None``: plain TCP).
    tls: ssl.SSLContext | None = None
    _idle: list[_Conn] = field(default_factory=list)

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, Any] | None = None,
        body: Any = None,
        headers: dict[str, str] | None = None,
        timeout: float,
        connect_timeout: float | None = None,
    ) -> WireResponse:
        """Send one request and read its answer.

        Without ``connect_timeout``, ``timeout`` bounds the whole request and
        its expiry raises ``TimeoutError`` whatever it interrupted. With it,
        opening a connection is bounded by ``connect_timeout`` alone (its
        expiry raises :class:`WireConnectError`: nothing was sent) and
        ``timeout`` bounds the rest (its expiry raises ``TimeoutError``: the
        request may have been received). ``headers`` are sent with this request
        only, after the client's own.
        """
        raw = self._encode(method, path, params, body, headers)
        if connect_timeout is None:
            async with asyncio.timeout(timeout):
                return await self._send(raw, None, None)
        return await self._send(raw, connect_timeout, timeout)

    async def _send(
        self, raw: bytes, connect_timeout: float | None, timeout: float | None
    ) -> WireResponse:
        try:
            return await self._exchange(raw, connect_timeout, timeout)
        except WireError as exc:
            if not exc.safe_to_retry:
                raise
        return await self._exchange(raw, connect_timeout, timeout, fresh=True)

    @contextlib.asynccontextmanager
    async def stream(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, Any] | None = None,
        body: Any = None,
        headers: dict[str, str] | None = None,
        connect_timeout: float,
        read_timeout: float | None,
    ) -> AsyncIterator[WireStream]:
        """Send one request on a fresh connection and yield its answer, body unread.

        The connection is closed when the block is left, however much of the
        body was read. A connection that cannot be opened within
        ``connect_timeout`` raises :class:`WireConnectError`; sending and each
        read of the answer wait at most ``read_timeout`` (``TimeoutError``).
        """
        raw = self._encode(method, path, params, body, headers)
        conn = await self._connect(connect_timeout)
        try:
            async with asyncio.timeout(read_timeout):
                try:
                    conn.writer.write(raw)
                    await conn.writer.drain()
                    line = await conn.reader.readline()
                    if not line:
                        raise WireError("the server closed the connection")
                    status, reason, answer = await _read_head(conn.reader, line)
                except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
                    if _tls_refused(exc):
                        raise WireConnectError(_reason(exc)) from exc
                    raise WireError(_reason(exc)) from exc
            yield WireStream(status, reason, answer, read_timeout, conn.reader)
        finally:
            conn.writer.close()

    def _encode(
        self,
        method: str,
        path: str,
        params: dict[str, Any] | None,
        body: Any,
        headers: dict[str, str] | None = None,
    ) -> bytes:
        target = path
        if params:
            target += "?" + urlencode(
                {k: (str(v).lower() if isinstance(v, bool) else v) for k, v in params.items()}
            )
        payload = b"" if body is None else json.dumps(body, separators=(",", ":")).encode()
        host = f"[{self.host}]" if ":" in self.host else self.host  # an IPv6 address
        head = [f"{method} {target} HTTP/1.1", f"Host: {host}:{self.port}"]
        head += [f"{k}: {v}" for k, v in self.headers.items()]
        head += [f"{k}: {v}" for k, v in (headers or {}).items()]
        if body is not None:
            head.append("Content-Type: application/json")
        head.append(f"Content-Length: {len(payload)}")
        return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + payload

    async def _connect(self, timeout: float | None) -> _Conn:
        try:
            async with asyncio.timeout(timeout):
                if self.tls is None:
                    reader, writer = await asyncio.open_connection(self.host, self.port)
                else:
                    reader, writer = await asyncio.open_connection(
                        self.host, self.port, ssl=self.tls, server_hostname=self.host
                    )
        except TimeoutError as exc:  # ours or the OS's (an enclosing one's is raised outside)
            raise WireConnectError("timed out") from exc
        except OSError as exc:
            raise WireConnectError(_reason(exc)) from exc
        return _Conn(reader, writer)

    async def _exchange(
        self,
        raw: bytes,
        connect_timeout: float | None,
        timeout: float | None,
        *,
        fresh: bool = False,
    ) -> WireResponse:
        conn = None if fresh else self._take()
        if conn is None:
            conn = await self._connect(connect_timeout)
        done = False
        try:
            async with asyncio.timeout(timeout):
                try:
                    conn.writer.write(raw)
                    await conn.writer.drain()
                    line = await conn.reader.readline()
                except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
                    # An OS-level TimeoutError (ETIMEDOUT) lands here too: only
                    # the expiry of our own timeout is raised as TimeoutError.
                    if not conn.reused and _tls_refused(exc):
                        raise WireConnectError(_reason(exc)) from exc
                    raise WireError(_reason(exc), safe_to_retry=conn.reused) from exc
                if not line:
                    raise WireError("the server closed the connection", safe_to_retry=conn.reused)
                try:
                    response, keep = await self._read_rest(conn.reader, line)
                except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
                    raise WireError(f"the answer was cut short: {_reason(exc)}") from exc
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
        """The answer after its status line, and whether the connection may be reused."""
        status, reason, headers = await _read_head(reader, status_line)
        if headers.get("transfer-encoding", "").lower() == "chunked":
            content = await _read_chunked(reader)
        else:
            content = await reader.readexactly(int(headers.get("content-length", "0")))
        keep = headers.get("connection", "").lower() != "close"
        return WireResponse(status, reason, headers, content), keep

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


def _text(line: bytes) -> str:
    return line.removesuffix(b"\r").decode("utf-8", errors="replace")


def _tls_refused(exc: BaseException) -> bool:
    """Whether ``exc`` is a TLS alert from the server: it refused the handshake."""
    return isinstance(exc, ssl.SSLError) and "ALERT" in (exc.reason or "").upper()


def _reason(exc: BaseException) -> str:
    """What the OS said ("Connection refused"), not asyncio's "Connect call failed (...)"."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"TLS: the server's certificate is not trusted ({exc.verify_message})"
    if isinstance(exc, ssl.SSLError):  # its errno is OpenSSL's, not errno's
        return f"TLS: {(exc.reason or str(exc)).lower().replace('_', ' ')}"
    if isinstance(exc, OSError):
        if exc.errno and exc.errno > 0:
            return os.strerror(exc.errno)
        if exc.strerror:  # a resolver error: its errno is the resolver's, not errno's
            return exc.strerror
    return str(exc) or type(exc).__name__


async def _read_head(
    reader: asyncio.StreamReader, status_line: bytes
) -> tuple[int, str, dict[str, str]]:
    """The status, reason phrase and headers (names lower-cased) of an answer."""
    try:
        _version, code, *reason = status_line.decode("latin-1").rstrip("\r\n").split(" ", 2)
        status = int(code)
    except ValueError as exc:
        raise WireError(f"not an HTTP answer: {status_line[:80]!r}") from exc
    headers: dict[str, str] = {}
    line = await reader.readline()
    if line.endswith(b"\r\n") and line != b"\r\n":
        # The usual CRLF head: the rest of it in two reads, not a read per line (a
        # gateway's answer has ten header lines; each read is a coroutine step).
        # After a line, the next two bytes are the empty line that ends the head,
        # or the start of one more field whose end "\n\r\n" (its CRLF, then the
        # empty line) ends the head.
        block = line
        start = await reader.readexactly(2)
        if start != b"\r\n":
            try:
                block += start + await reader.readuntil(b"\n\r\n")
            except asyncio.LimitOverrunError as exc:  # over the reader's limit (64 KiB)
                raise WireError("the answer's headers are too large") from exc
            block = block[:-2]
        if len(block) > MAX_HEADER_BYTES:
            raise WireError("the answer's headers are too large")
        for field_line in block[:-2].split(b"\r\n"):
            _header(headers, field_line)
        return status, reason[0] if reason else "", headers
    size = 0
    while True:  # bare LF line ends (or no header at all): line by line
        size += len(line)
        if size > MAX_HEADER_BYTES:
            raise WireError("the answer's headers are too large")
        if line in (b"\r\n", b"\n", b""):
            break
        _header(headers, line)
        line = await reader.readline()
    return status, reason[0] if reason else "", headers


def _header(headers: dict[str, str], line: bytes) -> None:
    name, _, value = line.decode("latin-1").partition(":")
    headers[name.strip().lower()] = value.strip()


async def _read_chunk(reader: asyncio.StreamReader) -> bytes | None:
    """One chunk of a chunked body; ``None`` after the last one (and its trailers)."""
    size_line = await reader.readline()
    if not size_line.endswith(b"\n"):  # the connection ended where a chunk should start
        raise asyncio.IncompleteReadError(size_line, None)
    size = int(size_line.split(b";", 1)[0].strip(), 16)
    if size == 0:
        while (await reader.readline()) not in (b"\r\n", b"\n", b""):
            pass  # trailers
        return None
    chunk = await reader.readexactly(size)
    await reader.readexactly(2)
    return chunk


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    parts: list[bytes] = []
    while (chunk := await _read_chunk(reader)) is not None:
        parts.append(chunk)
    return b"".join(parts)
