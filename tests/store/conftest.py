"""Backends for the store conformance suite, one fixture parameter each.

A :class:`Backend` hands out any number of clients of one store, so the same
test can race many clients against it, and knows the few things that differ
per backend (how short a lease may be, how to compact, how many counter
increments are affordable).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from api.store_server import create_store_app, serve_store
from elasticd.store.base import Store
from elasticd.store.embedded import EmbeddedStore
from elasticd.store.etcd import EtcdStore
from elasticd.store.http import HttpStore
from elasticd.store.memory import MemoryStore

from .etcd_server import EtcdProcess

#: Every backend's list limit here: small, so that exceeding it stays cheap.
LIST_LIMIT = 4 * 1024 * 1024


@dataclass
class Backend:
    """One store under test and a factory of clients for it."""

    name: str
    make_client: Callable[[], Awaitable[Store]]
    compact: Callable[[int], Awaitable[None]]
    lease_ttl: float = 0.5  # shortest TTL the backend honours (room for a loaded CI box)
    counter_total: int = 10_000  # increments in the lost-update test
    clients: list[Store] = field(default_factory=list)

    async def client(self) -> Store:
        """A new client of the store (the same object for the in-memory store)."""
        store = await self.make_client()
        self.clients.append(store)
        return store

    async def aclose(self) -> None:
        for store in reversed(self.clients):
            await store.close()


async def _memory_backend() -> AsyncIterator[Backend]:
    store = MemoryStore(max_list_bytes=LIST_LIMIT)

    async def make() -> Store:
        return store

    async def compact(revision: int) -> None:
        store.compact(revision)

    backend = Backend("memory", make, compact)
    try:
        yield backend
    finally:
        await backend.aclose()


async def _embedded_backend(tmp_path: Path) -> AsyncIterator[Backend]:
    store = EmbeddedStore(tmp_path / "store.sqlite3", max_list_bytes=LIST_LIMIT)

    async def make() -> Store:
        return store

    async def compact(revision: int) -> None:
        store.compact(revision)

    backend = Backend("embedded", make, compact)
    try:
        yield backend
    finally:
        await backend.aclose()


TOKEN = "test-token"


async def _http_backend(tmp_path: Path) -> AsyncIterator[Backend]:
    """The embedded store behind the real FastAPI app, reached through ASGITransport."""
    store = EmbeddedStore(tmp_path / "store.sqlite3", max_list_bytes=LIST_LIMIT)
    app = create_store_app(store, TOKEN)

    async def make() -> Store:
        return HttpStore("http://store.test", TOKEN, transport=httpx.ASGITransport(app=app))

    async def compact(revision: int) -> None:
        store.compact(revision)

    backend = Backend("http", make, compact)
    try:
        yield backend
    finally:
        await backend.aclose()
        await store.close()


@asynccontextmanager
async def serving(store: Store, token: str | None = TOKEN) -> AsyncIterator[str]:
    """Serve ``store`` with real uvicorn on a free loopback port in this loop; yields its URL."""
    stop = asyncio.Event()
    listening: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    server = asyncio.create_task(
        serve_store(
            store,
            host="127.0.0.1",
            port=0,
            token=token,
            stop=stop,
            on_listening=listening.set_result,
        )
    )
    try:
        async with asyncio.timeout(10):
            await asyncio.wait((listening, server), return_when=asyncio.FIRST_COMPLETED)
        if server.done():
            await server  # raises what made it stop
        yield listening.result()
    finally:
        stop.set()
        async with asyncio.timeout(10):
            await server


async def _uvicorn_backend(tmp_path: Path) -> AsyncIterator[Backend]:
    """The embedded store served by real uvicorn on a loopback port."""
    store = EmbeddedStore(tmp_path / "store.sqlite3", max_list_bytes=LIST_LIMIT)

    async def compact(revision: int) -> None:
        store.compact(revision)

    async with serving(store) as url:

        async def make() -> Store:
            return HttpStore(url, TOKEN)

        # Client and server share one core here; the "http" backend runs the same
        # server code with the full 10,000 increments. Client, server and the store's
        # journal also share one event loop: a 0.5 s lease kept alive every 0.125 s
        # lapsed once under a full CI run, so this backend's leases get 1 s.
        backend = Backend("uvicorn", make, compact, counter_total=2_000, lease_ttl=1.0)
        try:
            yield backend
        finally:
            await backend.aclose()


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdProcess]:
    """One etcd for the whole session (tests use their own key prefixes)."""
    server = EtcdProcess(tmp_path_factory.mktemp("etcd") / "data")
    try:
        server.start()
        yield server
    finally:
        server.kill()


def _httpx_transport() -> httpx.AsyncHTTPTransport:
    """A real-socket httpx transport, limited as EtcdStore limits its own httpx client."""
    return httpx.AsyncHTTPTransport(
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64)
    )


async def _etcd_backend(server: EtcdProcess, *, via_httpx: bool) -> AsyncIterator[Backend]:
    """The shared etcd, through EtcdStore's lean client or (``via_httpx``) through httpx.

    The httpx path is what https endpoints and injected transports take.
    """
    admin = EtcdStore([server.url])

    async def make() -> Store:
        if via_httpx:
            return EtcdStore([server.url], transport=_httpx_transport(), max_list_bytes=LIST_LIMIT)
        return EtcdStore([server.url], max_list_bytes=LIST_LIMIT)

    async def compact(revision: int) -> None:
        await admin.compact(revision)

    name = "etcd-httpx" if via_httpx else "etcd"
    backend = Backend(name, make, compact, lease_ttl=1.0)  # etcd TTLs are whole seconds
    try:
        yield backend
    finally:
        await backend.aclose()
        await admin.close()


BACKEND_NAMES = ["memory", "embedded", "http", "uvicorn", "etcd", "etcd-httpx"]


@pytest.fixture(params=BACKEND_NAMES)
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    """Every store backend in turn."""
    name = request.param
    if name == "memory":
        backends = _memory_backend()
    elif name == "embedded":
        backends = _embedded_backend(tmp_path)
    elif name == "http":
        backends = _http_backend(tmp_path)
    elif name == "uvicorn":
        backends = _uvicorn_backend(tmp_path)
    else:
        backends = _etcd_backend(
            request.getfixturevalue("etcd_server"), via_httpx=name == "etcd-httpx"
        )
    async for value in backends:
        yield value


@pytest.fixture
async def store(backend: Backend) -> Store:
    """One client of the backend under test."""
    return await backend.client()
