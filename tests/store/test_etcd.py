"""EtcdStore's two HTTP clients: the lean one for http(s), httpx when a transport is injected."""

from __future__ import annotations

import asyncio
import base64
import json
import ssl
from typing import Any

import httpx
import pytest

from elasticd.errors import StoreCompacted, StoreUnavailable
from elasticd.store.base import WatchEvent
from elasticd.store.etcd import EtcdStore

from .fake_http import CHUNKED_HEAD, FakeConn, chunk, fake_http

pytestmark = pytest.mark.timeout(30)


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def watch_line(result: dict[str, Any]) -> bytes:
    """One message of the gateway's watch stream."""
    header = {"revision": "9"}
    return json.dumps({"result": {"header": header, **result}}).encode() + b"\n"


CREATED = watch_line({"created": True})
PUT_K = watch_line(
    {"events": [{"kv": {"key": _b64("/k"), "value": _b64("v"), "mod_revision": "5"}}]}
)


async def test_http_and_https_endpoints_use_the_lean_client() -> None:
    """http(s) endpoints get the lean client, https ones with verified TLS; with a transport, httpx."""
    async with EtcdStore(["h1:2379", "https://h2:2379", "http://h3:2379/base"]) as store:
        clients = store._wires
        assert all(wire is not None for wire in clients)
        assert [wire[0].tls is not None for wire in clients if wire] == [False, True, False]
        tls = clients[1][0].tls if clients[1] else None
        assert tls is not None and tls.check_hostname and tls.verify_mode == ssl.CERT_REQUIRED
        assert clients[2] is not None and clients[2][1] == "/base"
    transport = httpx.MockTransport(lambda request: httpx.Response(500))
    async with EtcdStore(["h1:2379"], transport=transport) as store:
        assert store._wires == [None]


async def test_watch_has_a_connection_of_its_own() -> None:
    """A watch over the lean client returns the first events and closes its connection."""
    closed = asyncio.Event()

    async def handler(conn: FakeConn) -> None:
        request = await conn.request()
        assert request is not None and request[0] == "POST /v3/watch HTTP/1.1"
        await conn.send(CHUNKED_HEAD + chunk(CREATED))
        await conn.send(chunk(PUT_K[:20]) + chunk(PUT_K[20:]))
        await conn.until_eof()  # etcd would keep streaming: the client must hang up
        closed.set()

    async with asyncio.timeout(10), fake_http(handler) as fake, EtcdStore([fake.address]) as store:
        events = await store.watch("/k", 4, 5)
        assert events == [WatchEvent(kind="put", key="/k", value=b"v", revision=5)]
        await closed.wait()
    body = json.loads(fake.requests[0][2])
    assert body == {"create_request": {"key": _b64("/k"), "start_revision": "5"}}


@pytest.mark.parametrize(
    ("status", "answer", "error", "match"),
    [
        (
            200,
            CREATED + watch_line({"canceled": True, "compact_revision": "7"}),
            StoreCompacted,
            "7",
        ),
        (503, b'{"error":"etcdserver: no leader","code":14}', StoreUnavailable, "no leader"),
        (404, b"404 page not found", StoreUnavailable, "api_prefix"),
    ],
)
async def test_watch_refusals_over_the_lean_client(
    status: int, answer: bytes, error: type[Exception], match: str
) -> None:
    """A cancelled watch, or an error answer to it, raises what the httpx path raised."""

    async def handler(conn: FakeConn) -> None:
        await conn.request()
        if status == 200:
            await conn.send(CHUNKED_HEAD + chunk(answer))
        else:
            await conn.answer(answer, status=status)
        await conn.until_eof()

    async with asyncio.timeout(10), fake_http(handler) as fake, EtcdStore([fake.address]) as store:
        with pytest.raises(error, match=match) as caught:
            await store.watch("/k", 4, 5)
    if isinstance(caught.value, StoreCompacted):
        assert caught.value.revision == 6


async def test_silent_watch_times_out_empty() -> None:
    """A watch whose stream stays open without events returns [] at its timeout."""

    async def handler(conn: FakeConn) -> None:
        await conn.request()
        await conn.send(CHUNKED_HEAD + chunk(CREATED))
        await conn.until_eof()

    async with asyncio.timeout(10), fake_http(handler) as fake, EtcdStore([fake.address]) as store:
        assert await store.watch("/k", 4, 0.3) == []


async def test_watch_through_an_injected_transport_uses_it() -> None:
    """With an injected transport, requests and the streamed watch go through httpx."""
    paths: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        paths.append(request.url.path)
        return httpx.Response(200, content=CREATED + PUT_K)

    async with asyncio.timeout(10):
        transport = httpx.MockTransport(handler)
        async with EtcdStore(["etcd.test:2379"], transport=transport) as store:
            events = await store.watch("/k", 4, 5)
    assert [e.revision for e in events] == [5]
    assert paths == ["/v3/watch"]
