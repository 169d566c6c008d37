"""Behaviour specific to the in-memory store (the fake shipped in elasticd.testing)."""

from __future__ import annotations

import asyncio

import pytest

from elasticd.errors import InvalidKey, StoreCompacted, StoreUnavailable
from elasticd.store.memory import MAX_KEY_BYTES, MemoryStore, validate_key
from elasticd.testing import MemoryStore as ExportedMemoryStore

pytestmark = pytest.mark.timeout(10)


def test_testing_module_exports_the_memory_store() -> None:
    """elasticd.testing ships the in-memory store for users' tests."""
    assert ExportedMemoryStore is MemoryStore


async def test_bounded_history_compacts_oldest_changes() -> None:
    """Once more changes than `history` happened, a watch from before them raises."""
    async with MemoryStore(history=10) as store:
        first = await store.put("k", b"0")
        for i in range(10):
            await store.put("k", str(i).encode())
        with pytest.raises(StoreCompacted) as caught:
            await store.watch("k", first.version - 1, 1)
        assert caught.value.revision == first.version
        events = await store.watch("k", caught.value.revision, 1)
        assert len(events) == 10


async def test_expire_ends_a_lease_without_waiting() -> None:
    """expire() ends a lease at once, as its TTL running out would."""
    async with MemoryStore() as store:
        lease = await store.grant(3600)
        entry = await store.put("node", b"x", lease=lease)
        await store.expire(lease)
        events = await store.watch("node", entry.version, 0)
        assert [e.kind for e in events] == ["delete"]


async def test_close_fails_pending_watches_and_later_calls() -> None:
    """Closing the store wakes its watchers with StoreUnavailable and refuses new calls."""
    store = MemoryStore()
    task = asyncio.create_task(store.watch("k", 0, 30))
    await asyncio.sleep(0)
    await store.close()
    with pytest.raises(StoreUnavailable):
        await task
    with pytest.raises(StoreUnavailable):
        await store.get("k")


async def test_cancelled_watch_leaves_no_waiter() -> None:
    """A cancelled watch removes its waiter, so nothing leaks across many watches."""
    async with MemoryStore() as store:
        for _ in range(100):
            task = asyncio.create_task(store.watch("k", 0, 30))
            await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        assert not store._key_waiters
        assert not store._prefix_waiters


def test_validate_key_limits() -> None:
    """Key validation refuses over-long keys and lone surrogates, and allows partial '..'."""
    validate_key("a" * MAX_KEY_BYTES)
    with pytest.raises(InvalidKey, match="longer"):
        validate_key("a" * (MAX_KEY_BYTES + 1))
    with pytest.raises(InvalidKey, match="UTF-8"):
        validate_key("bad\udc80")
    validate_key("", prefix=True)
    validate_key("/a/..", prefix=True)
    validate_key("/a/..b/c")
    with pytest.raises(InvalidKey):
        validate_key("/a/../", prefix=True)
