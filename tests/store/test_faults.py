"""Faults at the store's IO boundaries: dead peers, bad credentials, bad bodies, killed etcd."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from api.store_server import create_store_app
from elasticd.errors import InvalidKey, StoreError, StoreUnavailable, ValueTooLarge
from elasticd.store.embedded import EmbeddedStore
from elasticd.store.etcd import EtcdStore
from elasticd.store.http import HttpStore
from elasticd.store.memory import MemoryStore

from .conftest import TOKEN, serving
from .etcd_server import EtcdProcess, free_port
from .fake_http import FakeConn, fake_http

pytestmark = pytest.mark.timeout(60)

AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
async def app(tmp_path: Path) -> AsyncIterator[FastAPI]:
    """The store app over an embedded store with a small (64 KiB) value limit."""
    store = EmbeddedStore(tmp_path / "store.sqlite3", max_value_bytes=64 * 1024)
    try:
        yield create_store_app(store, TOKEN)
    finally:
        await store.close()


@pytest.fixture
async def raw(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """A plain HTTP client of the app, for requests HttpStore would never send."""
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://store.test"
    ) as client:
        yield client


# -- unreachable peers -------------------------------------------------------


async def test_dead_url_raises_unavailable_naming_it() -> None:
    """A client pointed at a port nobody listens on gets StoreUnavailable naming the URL."""
    url = f"http://127.0.0.1:{free_port()}"
    async with HttpStore(url, TOKEN, timeout=2) as store:
        with pytest.raises(StoreUnavailable, match=f"store at {url} is unreachable: .*refused"):
            await store.get("/a")
        with pytest.raises(StoreUnavailable, match=url):
            await store.watch("/a", 0, 1)


async def test_dead_etcd_endpoint_raises_unavailable_naming_it() -> None:
    """An etcd client whose every endpoint is dead names them all, with the OS's reason."""
    dead = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    async with EtcdStore(dead, timeout=2) as store:
        with pytest.raises(StoreUnavailable) as caught:
            await store.put("/a", b"x")
        with pytest.raises(StoreUnavailable, match="connection refused"):
            await store.watch("/a", 0, 1)
    for endpoint in dead:
        assert f"http://{endpoint}: connection refused" in str(caught.value)


async def test_url_that_is_not_a_store() -> None:
    """A URL that answers 404 for /store is reported as not being a store."""
    other = FastAPI()
    transport = httpx.ASGITransport(app=other)
    async with HttpStore("http://not-a-store.test", TOKEN, transport=transport) as store:
        with pytest.raises(StoreUnavailable, match="no store API"):
            await store.get("/a")


async def test_closed_client_refuses_calls(app: FastAPI) -> None:
    """A closed HttpStore raises StoreUnavailable instead of an httpx error."""
    store = HttpStore("http://store.test", TOKEN, transport=httpx.ASGITransport(app=app))
    await store.close()
    with pytest.raises(StoreUnavailable, match="closed"):
        await store.get("/a")


# -- authentication ------------------------------------------------------------


async def test_request_without_token_is_401(raw: httpx.AsyncClient) -> None:
    """A request without a bearer token gets a 401 problem+json with WWW-Authenticate."""
    response = await raw.get("/store/kv", params={"key": "/a"})
    assert response.status_code == 401
    assert response.headers["content-type"].startswith("application/problem+json")
    assert response.headers["www-authenticate"].startswith("Bearer")
    assert "Bearer" in response.json()["detail"]


async def test_wrong_token_is_a_clear_store_error(app: FastAPI) -> None:
    """HttpStore with the wrong token raises StoreUnavailable saying the token was refused."""
    transport = httpx.ASGITransport(app=app)
    async with HttpStore("http://store.test", "wrong", transport=transport) as store:
        with pytest.raises(StoreUnavailable, match="refused our credentials"):
            await store.put("/a", b"x")


# -- malformed requests --------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"key": "/a", "value": "eA=="}, "expected_version"),
        ({"key": "/a", "value": "not base64!", "expected_version": None}, "value"),
        ({"key": "/a", "value": "eA==", "expected_version": "soon"}, "expected_version"),
        ({"key": "/a", "value": "eA==", "expected_version": None, "extra": 1}, "extra"),
    ],
)
async def test_malformed_cas_body_is_422(
    raw: httpx.AsyncClient, body: dict[str, object], field: str
) -> None:
    """A CAS body with a missing, mistyped, badly encoded or unknown field gets a 422 naming it."""
    response = await raw.post("/store/cas", json=body, headers=AUTH)
    assert response.status_code == 422
    assert field in response.text


async def test_body_that_is_not_json_is_422(raw: httpx.AsyncClient) -> None:
    """A body that is not JSON gets a 422 problem."""
    response = await raw.post(
        "/store/cas",
        content=b"{not json",
        headers={**AUTH, "content-type": "application/json"},
    )
    assert response.status_code == 422
    assert response.headers["content-type"].startswith("application/problem+json")


async def test_invalid_key_over_the_wire_is_422(raw: httpx.AsyncClient) -> None:
    """A key with a '..' segment sent past the client's own check gets a 422 'Invalid store key'."""
    response = await raw.put("/store/kv", json={"key": "a/../b", "value": ""}, headers=AUTH)
    assert response.status_code == 422
    assert response.json()["title"] == "Invalid store key"


async def test_invalid_key_error_maps_back(app: FastAPI) -> None:
    """The client maps the server's 'Invalid store key' back to InvalidKey (add on a non-counter)."""
    transport = httpx.ASGITransport(app=app)
    async with HttpStore("http://store.test", TOKEN, transport=transport) as store:
        await store.put("/text", b"hello")
        with pytest.raises(InvalidKey):
            await store.add("/text")


async def test_out_of_range_query_is_a_store_error(raw: httpx.AsyncClient) -> None:
    """A watch asking for a longer long-poll than the server allows gets a 422."""
    response = await raw.get(
        "/store/watch", params={"key": "/a", "after": 0, "timeout": 10_000}, headers=AUTH
    )
    assert response.status_code == 422
    assert "timeout" in response.text


# -- size limits ---------------------------------------------------------------


async def test_value_over_the_store_limit_is_413(raw: httpx.AsyncClient) -> None:
    """A value whose decoded size is over the store's limit gets a 413, though the body fits."""
    import base64

    value = base64.b64encode(b"x" * (64 * 1024 + 1)).decode()
    response = await raw.put("/store/kv", json={"key": "/big", "value": value}, headers=AUTH)
    assert response.status_code == 413
    assert response.json()["title"] == "Value too large"


async def test_body_over_the_limit_is_413_by_content_length(raw: httpx.AsyncClient) -> None:
    """A body whose Content-Length is over the limit gets a 413 before it is parsed."""
    response = await raw.put(
        "/store/kv",
        content=b"x" * (1024 * 1024),
        headers={**AUTH, "content-type": "application/json"},
    )
    assert response.status_code == 413
    assert "request body" in response.json()["detail"]


async def test_streamed_body_over_the_limit_is_413(raw: httpx.AsyncClient) -> None:
    """A chunked body without Content-Length is cut off with a 413 once over the limit."""

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(64):
            yield b"x" * 16 * 1024

    response = await raw.put(
        "/store/kv", content=chunks(), headers={**AUTH, "content-type": "application/json"}
    )
    assert response.status_code == 413


async def test_client_refuses_large_values_locally() -> None:
    """HttpStore refuses a value over its limit without sending it."""
    async with HttpStore("http://127.0.0.1:9", TOKEN, max_value_bytes=10) as store:
        with pytest.raises(ValueTooLarge):
            await store.put("/a", b"x" * 11)


# -- long-polls ----------------------------------------------------------------


async def test_watch_is_dropped_when_the_client_goes_away(tmp_path: Path) -> None:
    """When a watching client disconnects, the server stops its watch (no leaked waiter)."""
    store = MemoryStore()
    async with serving(store) as url, httpx.AsyncClient(base_url=url, headers=AUTH) as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.get(
                "/store/watch", params={"key": "/a", "after": 0, "timeout": 30}, timeout=0.3
            )
        deadline = time.monotonic() + 5
        while store._key_waiters:
            assert time.monotonic() < deadline, "the server kept the abandoned watch"
            await asyncio.sleep(0.02)
    await store.close()


async def test_long_watch_is_split_into_polls() -> None:
    """A watch longer than one poll is served as several polls and still sees a later change."""
    import elasticd.store.http as http_module

    store = MemoryStore()
    app = create_store_app(store, TOKEN)
    transport = httpx.ASGITransport(app=app)
    old = http_module.MAX_POLL_SECONDS
    http_module.MAX_POLL_SECONDS = 0.1
    try:
        async with HttpStore("http://store.test", TOKEN, transport=transport) as client:
            task = asyncio.create_task(client.watch("/a", 0, 5))
            await asyncio.sleep(0.35)
            assert not task.done()
            entry = await client.put("/a", b"x")
            events = await task
            assert [e.revision for e in events] == [entry.version]
    finally:
        http_module.MAX_POLL_SECONDS = old
        await store.close()


# -- etcd faults -----------------------------------------------------------------


@pytest.fixture
def own_etcd(tmp_path: Path) -> Iterator[EtcdProcess]:
    """An etcd of this test's own, that the test may kill and restart."""
    server = EtcdProcess(tmp_path / "etcd")
    try:
        server.start()
        yield server
    finally:
        server.kill()


async def test_etcd_fails_over_to_the_next_endpoint(own_etcd: EtcdProcess) -> None:
    """With a dead first endpoint, the etcd client uses the next one, for requests and watches."""
    dead = f"http://127.0.0.1:{free_port()}"
    async with EtcdStore([dead, own_etcd.url], timeout=2) as store:
        entry = await store.put("/failover", b"x")
        assert await store.get("/failover") == entry
    async with EtcdStore([dead, own_etcd.url], timeout=2) as store:
        events = await store.watch("/failover", entry.version - 1, 5)
        assert [(e.key, e.revision) for e in events] == [("/failover", entry.version)]


@pytest.mark.parametrize("fault", ["close", "hang"])
async def test_etcd_request_broken_after_sending(own_etcd: EtcdProcess, fault: str) -> None:
    """A member that takes a request and then closes or goes silent: a write's outcome is
    reported as unknown, a read moves on to the next member; neither is sent twice."""

    async def handler(conn: FakeConn) -> None:
        await conn.request()
        if fault == "hang":
            await conn.server.release.wait()

    async with (
        asyncio.timeout(20),
        fake_http(handler) as fake,
        EtcdStore([fake.address, own_etcd.url], timeout=0.5) as store,
    ):
        where = re.escape(f"etcd at http://{fake.address} failed during /kv/put")
        with pytest.raises(StoreUnavailable, match=f"{where} .*may or may not have been applied"):
            await store.put("/broken", b"x")
        assert await store.get("/broken") is None  # answered by the real member
        assert [r[0].split()[1] for r in fake.requests] == ["/v3/kv/put", "/v3/kv/range"]


async def test_etcd_killed_mid_operation_then_restarted(own_etcd: EtcdProcess) -> None:
    """Killing etcd fails pending and new calls with StoreUnavailable; a restart heals the client."""
    async with EtcdStore([own_etcd.url], timeout=2) as store:
        entry = await store.put("/survivor", b"kept")
        watching = asyncio.create_task(store.watch("/survivor", entry.version, 30))
        await asyncio.sleep(0.2)
        own_etcd.kill()
        with pytest.raises(StoreUnavailable, match="etcd at"):
            async with asyncio.timeout(10):
                await watching
        with pytest.raises(StoreUnavailable, match=own_etcd.url):
            await store.put("/survivor", b"lost")
        await asyncio.to_thread(own_etcd.start)
        deadline = time.monotonic() + 15
        while True:
            try:
                got = await store.get("/survivor")
                break
            except StoreUnavailable:
                assert time.monotonic() < deadline, "the client did not recover"
                await asyncio.sleep(0.1)
        assert got == entry
        assert (await store.put("/survivor", b"again")).version > entry.version


async def test_etcd_unknown_lease_is_lease_not_found(own_etcd: EtcdProcess) -> None:
    """Writing with, or keeping alive, a lease etcd does not know raises LeaseNotFound."""
    from elasticd.errors import LeaseNotFound

    async with EtcdStore([own_etcd.url]) as store:
        with pytest.raises(LeaseNotFound):
            await store.put("/a", b"x", lease=12345)
        with pytest.raises(LeaseNotFound):
            await store.keep_alive(12345)
        await store.revoke(12345)


async def test_etcd_not_a_gateway(own_etcd: EtcdProcess) -> None:
    """A wrong API prefix is reported as a store error that says what to change."""
    async with EtcdStore([own_etcd.url], api_prefix="/v9") as store:
        with pytest.raises(StoreError, match="api_prefix"):
            await store.get("/a")
        with pytest.raises(StoreError, match="api_prefix"):
            await store.watch("/a", 0, 1)


async def test_etcd_moves_off_a_member_without_leader() -> None:
    """A member answering 503 'no leader' is skipped: reads retry at once, writes once the
    member refused them (a refusal before any proposal: nothing was applied)."""
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        host = request.url.host
        calls.append(f"{host}{request.url.path}")
        if host == "sick":
            return httpx.Response(503, json={"error": "etcdserver: no leader", "code": 14})
        return httpx.Response(200, json={"header": {"revision": "7"}})  # empty range, or put

    transport = httpx.MockTransport(handler)
    async with EtcdStore(["sick:2379", "well:2379"], transport=transport) as store:
        assert await store.get("/a") is None
        assert calls == ["sick/v3/kv/range", "well/v3/kv/range"]
        calls.clear()
        assert (await store.put("/a", b"x")).version == 7  # sticks to the member that answered
        assert calls == ["well/v3/kv/put"]

    calls.clear()
    async with EtcdStore(["sick:2379", "well:2379"], transport=transport) as store:
        # "no leader" is a refusal before anything is proposed: the write was not
        # applied, so it is tried again (on the next member) rather than failed.
        assert (await store.put("/a", b"x")).version == 7
        assert calls == ["sick/v3/kv/put", "well/v3/kv/put"]
