"""The lean HTTP/1.1 client against scripted loopback servers: streams, retries, broken answers."""

from __future__ import annotations

import asyncio
import socket

import pytest

from elasticd.store.wire import WireClient, WireConnectError, WireError

from .etcd_server import free_port
from .fake_http import CHUNKED_HEAD, FakeConn, FakeServer, chunk, fake_http

pytestmark = pytest.mark.timeout(30)


def client_of(server: FakeServer) -> WireClient:
    host, _, port = server.address.rpartition(":")
    return WireClient(host.strip("[]"), int(port))


async def test_stream_yields_each_line_as_it_arrives() -> None:
    """A chunked answer's lines come out as they arrive, also when a line spans chunks."""
    first_read = asyncio.Event()
    closed = asyncio.Event()

    async def handler(conn: FakeConn) -> None:
        await conn.request()
        await conn.send(CHUNKED_HEAD + chunk(b'{"n":1}\n{"n"'))
        await first_read.wait()  # the client has the first line before the rest exists
        await conn.send(chunk(b":2}\r\n") + chunk(b"\n\nlast") + b"0\r\n\r\n")
        await conn.until_eof()
        closed.set()

    async with asyncio.timeout(10), fake_http(handler) as server:
        client = client_of(server)
        async with client.stream(
            "POST", "/v3/watch", body={"a": 1}, connect_timeout=5, read_timeout=5
        ) as stream:
            assert stream.status_code == 200
            assert stream.headers["transfer-encoding"] == "chunked"
            lines = stream.aiter_lines()
            assert await anext(lines) == '{"n":1}'
            first_read.set()
            assert [line async for line in lines] == ['{"n":2}', "", "", "last"]
        await closed.wait()  # leaving the block closed the stream's connection
        await client.aclose()
    assert server.requests[0][0] == "POST /v3/watch HTTP/1.1"
    assert server.requests[0][2] == b'{"a":1}'


@pytest.mark.parametrize("framing", ["length", "until-close"])
async def test_stream_bodies_without_chunks(framing: str) -> None:
    """A streamed answer framed by Content-Length, or by the end of the connection, reads whole."""
    body = b"one\ntwo\n"

    async def handler(conn: FakeConn) -> None:
        await conn.request()
        if framing == "length":
            await conn.answer(body)
            await conn.until_eof()
        else:
            await conn.send(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + body)

    async with asyncio.timeout(10), fake_http(handler) as server:
        client = client_of(server)
        async with client.stream("POST", "/s", connect_timeout=5, read_timeout=5) as stream:
            assert [line async for line in stream.aiter_lines()] == ["one", "two"]


async def test_stream_error_answer_is_read_whole() -> None:
    """An error answer on a stream gives its status and its whole body."""

    async def handler(conn: FakeConn) -> None:
        await conn.request()
        await conn.answer(b'{"error":"nope","code":5}', status=404)
        await conn.until_eof()

    async with asyncio.timeout(10), fake_http(handler) as server:
        client = client_of(server)
        async with client.stream("POST", "/s", connect_timeout=5, read_timeout=5) as stream:
            assert stream.status_code == 404
            assert await stream.aread() == b'{"error":"nope","code":5}'


async def test_stream_cut_short_is_a_wire_error() -> None:
    """A chunked stream that ends without its last chunk raises WireError after the lines it had."""

    async def handler(conn: FakeConn) -> None:
        await conn.request()
        await conn.send(CHUNKED_HEAD + chunk(b"line\n"))  # then the connection closes

    async with asyncio.timeout(10), fake_http(handler) as server:
        client = client_of(server)
        async with client.stream("POST", "/s", connect_timeout=5, read_timeout=5) as stream:
            lines = stream.aiter_lines()
            assert await anext(lines) == "line"
            with pytest.raises(WireError, match="cut short"):
                await anext(lines)


async def test_stream_read_timeout() -> None:
    """A stream whose server goes silent raises TimeoutError after read_timeout."""

    async def handler(conn: FakeConn) -> None:
        await conn.request()
        await conn.send(CHUNKED_HEAD)
        await conn.server.release.wait()

    async with asyncio.timeout(10), fake_http(handler) as server:
        client = client_of(server)
        async with client.stream("POST", "/s", connect_timeout=5, read_timeout=0.2) as stream:
            with pytest.raises(TimeoutError):
                await anext(stream.aiter_lines())


async def test_connect_failure_is_a_connect_error() -> None:
    """A refused connection raises WireConnectError with the OS's reason, for both kinds of call."""
    client = WireClient("127.0.0.1", free_port())
    with pytest.raises(WireConnectError, match="Connection refused"):
        await client.request("POST", "/x", body={}, timeout=5, connect_timeout=5)
    with pytest.raises(WireConnectError, match="Connection refused"):
        await client.request("POST", "/x", body={}, timeout=5)
    with pytest.raises(WireConnectError, match="Connection refused"):
        async with client.stream("POST", "/x", connect_timeout=5, read_timeout=5):
            pass


async def test_chunked_answer_cut_at_a_chunk_boundary_is_an_error() -> None:
    """A chunked answer that stops between chunks is an error, not a shorter body."""

    async def handler(conn: FakeConn) -> None:
        await conn.request()
        await conn.send(CHUNKED_HEAD + chunk(b"hello"))

    async with asyncio.timeout(10), fake_http(handler) as server:
        client = client_of(server)
        with pytest.raises(WireError, match="cut short"):
            await client.request("POST", "/x", body={}, timeout=5)


async def test_stale_keep_alive_connection_is_retried_once() -> None:
    """A reused connection the server closed unread is retried on a fresh one; nothing runs twice."""

    async def handler(conn: FakeConn) -> None:
        await conn.request()
        await conn.answer(b"{}")  # keep-alive, but ...
        await conn.reader.read(1)  # ... the next request is dropped unread, as at idle expiry

    async with asyncio.timeout(10), fake_http(handler) as server:
        client = client_of(server)
        assert (await client.request("POST", "/a", body={}, timeout=5)).json() == {}
        assert (await client.request("POST", "/b", body={}, timeout=5)).json() == {}
        await client.aclose()
    assert [r[0] for r in server.requests] == ["POST /a HTTP/1.1", "POST /b HTTP/1.1"]
    assert server.connections == 2


async def test_failure_on_a_fresh_connection_is_not_retried() -> None:
    """A request whose fresh connection breaks after sending raises WireError, sent only once."""

    async def handler(conn: FakeConn) -> None:
        await conn.request()  # read, then close without answering

    async with asyncio.timeout(10), fake_http(handler) as server:
        client = client_of(server)
        with pytest.raises(WireError, match="closed the connection") as caught:
            await client.request("POST", "/cas", body={}, timeout=5)
    assert not caught.value.safe_to_retry
    assert len(server.requests) == 1


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback")
async def test_ipv6_host_header_is_bracketed() -> None:
    """The Host header of an IPv6 address is written [addr]:port."""

    async def handler(conn: FakeConn) -> None:
        await conn.request()
        await conn.answer(b"{}")

    async with asyncio.timeout(10), fake_http(handler, host="::1") as server:
        client = client_of(server)
        await client.request("GET", "/x", timeout=5)
        await client.aclose()
    assert server.requests[0][1]["host"] == server.address


async def _head(data: bytes, *, eof: bool = True) -> tuple[int, str, dict[str, str], bytes]:
    """``_read_head`` over ``data`` (after its status line); also what it left unread."""
    from elasticd.store.wire import _read_head

    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    status_line = await reader.readline()
    status, reason, headers = await _read_head(reader, status_line)
    return status, reason, headers, await reader.read(100) if eof else b""


@pytest.mark.parametrize(
    ("head", "expected"),
    [
        (b"HTTP/1.1 200 OK\r\n\r\n", {}),
        (b"HTTP/1.1 200 OK\r\nA: 1\r\n\r\n", {"a": "1"}),
        (b"HTTP/1.1 200 OK\r\nA: 1\r\nB:2\r\n\r\n", {"a": "1", "b": "2"}),
        (b"HTTP/1.1 200 OK\r\nA: 1\r\nX:\r\nC: x y\r\n\r\n", {"a": "1", "x": "", "c": "x y"}),
        (b"HTTP/1.1 200 OK\r\nA: 1\r\nB\r\n\r\n", {"a": "1", "b": ""}),
        (b"HTTP/1.1 200 OK\nA: 1\nB: 2\n\n", {"a": "1", "b": "2"}),  # bare LF line ends
        (
            b"HTTP/1.1 200 OK\r\n"
            + b"".join(b"H%d: v%d\r\n" % (i, i) for i in range(12))
            + b"\r\n",
            {f"h{i}": f"v{i}" for i in range(12)},
        ),
    ],
)
async def test_answer_heads_are_read_whole_and_no_further(
    head: bytes, expected: dict[str, str]
) -> None:
    """However many fields, the head ends at its empty line; the body is left to read."""
    status, reason, headers, rest = await _head(head + b"BODY\r\n\r\nmore")
    assert (status, reason, headers) == (200, "OK", expected)
    assert rest == b"BODY\r\n\r\nmore"


async def test_answer_head_over_the_limit_is_an_error() -> None:
    big = b"HTTP/1.1 200 OK\r\nA: 1\r\n" + b"X: " + b"y" * 70_000 + b"\r\n\r\n"
    with pytest.raises((WireError, ValueError)):
        await _head(big)
    many = b"HTTP/1.1 200 OK\r\nA: 1\r\n" + b"X: y\r\n" * 12_000 + b"\r\n"
    with pytest.raises(WireError, match="too large"):
        await _head(many)


async def test_answer_head_cut_short_is_an_incomplete_read() -> None:
    with pytest.raises(asyncio.IncompleteReadError):
        await _head(b"HTTP/1.1 200 OK\r\nA: 1\r\nB: 2\r\n")
