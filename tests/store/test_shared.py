"""Sharing requests among a process's many agents (issue 16): watches, queued reads, indexes."""

from __future__ import annotations

import asyncio

import pytest

from elasticd.store.base import WatchEvent
from elasticd.store.memory import MemoryStore
from elasticd.store.shared import Gate, SharedWatches

pytestmark = pytest.mark.timeout(10)


class CountedWatches:
    """The memory store's watch, counting the requests a SharedWatches sends through it."""

    def __init__(self, store: MemoryStore) -> None:
        self.store = store
        self.requests: list[int] = []  # the ``after`` of each request

    async def __call__(self, key: str, after: int, timeout: float, prefix: bool):
        self.requests.append(after)
        return await self.store.watch(key, after, timeout, prefix=prefix)


async def test_concurrent_watches_of_one_key_share_one_request():
    """A hundred watchers of one key cost one request; each gets the change it waits for."""
    async with MemoryStore() as store:
        first = await store.put("head", b"0")
        watch = CountedWatches(store)
        shared = SharedWatches(watch)
        watchers = [
            asyncio.create_task(shared.watch("head", first.version, 5, False)) for _ in range(100)
        ]
        await asyncio.sleep(0.01)
        second = await store.put("head", b"1")
        results = await asyncio.gather(*watchers)
        assert len(watch.requests) == 1
        assert all([e.revision for e in r] == [second.version] for r in results)


async def test_a_watcher_never_gets_changes_at_or_below_its_revision():
    """Sharing a request from an earlier revision filters what each watcher already saw."""
    async with MemoryStore() as store:
        a = await store.put("head", b"a")
        b = await store.put("head", b"b")
        shared = SharedWatches(CountedWatches(store))
        early, late = await asyncio.gather(
            shared.watch("head", a.version - 1, 5, False),
            shared.watch("head", b.version, 0.2, False),
        )
        assert [e.revision for e in early] == [a.version, b.version]
        assert late == []  # nothing after b within its timeout


async def test_a_watcher_from_an_earlier_revision_starts_a_request_the_later_ones_join():
    """A request from a later revision could miss what an earlier watcher wants: it is not joined."""
    async with MemoryStore() as store:
        a = await store.put("head", b"a")
        await store.put("other", b"x")
        watch = CountedWatches(store)
        shared = SharedWatches(watch)
        later = asyncio.create_task(shared.watch("head", a.version, 5, False))
        await asyncio.sleep(0.01)
        earlier = await shared.watch("head", a.version - 1, 5, False)
        assert [e.value for e in earlier] == [b"a"]
        new = await store.put("head", b"c")
        assert [e.revision for e in await later] == [new.version]
        assert watch.requests[:2] == [a.version, a.version - 1]


async def test_the_request_is_cancelled_when_its_last_watcher_leaves():
    """Watchers that go away (cancelled, or timed out) leave no request behind."""
    async with MemoryStore() as store:
        shared = SharedWatches(CountedWatches(store))
        watchers = [asyncio.create_task(shared.watch("head", 0, 5, False)) for _ in range(3)]
        await asyncio.sleep(0.01)
        for w in watchers:
            w.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)
        await asyncio.sleep(0)
        assert not shared._requests
        assert not store._key_waiters
        assert await shared.watch("head", 0, 0.05, False) == []
        assert not shared._requests


async def test_identical_reads_waiting_for_a_turn_share_one_request_but_a_sent_one_is_not_joined():
    """Reads queued behind a full gate are sent once for all; one already sent is never shared
    (its answer could predate a later caller's call)."""
    gate = Gate(1)
    sent: list[int] = []
    release = asyncio.Event()

    async def read(n: int) -> int:
        sent.append(n)
        await release.wait()
        return n

    busy = asyncio.create_task(gate.read("k", lambda: read(0)))  # sent: holds the only turn
    await asyncio.sleep(0)
    queued = [asyncio.create_task(gate.read("k", lambda i=i: read(i))) for i in range(1, 6)]
    await asyncio.sleep(0)
    release.set()
    assert await busy == 0
    assert await asyncio.gather(*queued) == [1] * 5  # the first queued read, shared
    assert sent == [0, 1]


async def test_a_shared_read_whose_sender_is_cancelled_is_asked_again():
    """Cancelling the caller that would have sent a shared read does not fail the others."""
    gate = Gate(1)
    hold = asyncio.Event()

    async def slow() -> str:
        await hold.wait()
        return "busy"

    busy = asyncio.create_task(gate.run(slow))
    await asyncio.sleep(0)
    leader = asyncio.create_task(gate.read("k", lambda: asyncio.sleep(0, "leader")))
    await asyncio.sleep(0)
    follower = asyncio.create_task(gate.read("k", lambda: asyncio.sleep(0, "follower")))
    await asyncio.sleep(0)
    leader.cancel()
    hold.set()
    assert await busy == "busy"
    assert await follower == "follower"


async def test_listings_and_watches_use_the_indexes_and_stay_exact():
    """The sorted key index and the per-key change index answer what a scan would."""
    async with MemoryStore(history=50) as store:
        for i in range(30):
            await store.put(f"a/{i:02}", b"x")
        await store.put("a", b"top")
        await store.put("b/1", b"y")
        await store.delete("a/05")
        listing = await store.list("a/")
        assert [e.key for e in listing.entries] == [f"a/{i:02}" for i in range(30) if i != 5]
        assert [e.key for e in (await store.list("a")).entries][:2] == ["a", "a/00"]
        assert (await store.list("c")).entries == []
        # A small prefix watched from long ago: found through each key's changes.
        events = await store.watch("b/", 0, 1, prefix=True)
        assert [(e.key, e.value) for e in events] == [("b/1", b"y")]
        deleted = await store.watch("a/05", listing.revision - 1, 1)
        assert [e.kind for e in deleted] == ["delete"]


async def test_a_change_wakes_only_the_watchers_of_its_prefixes():
    """Waiters are found by the changed key's prefixes, not by scanning every waiter."""
    async with MemoryStore() as store:
        rev = store.revision
        mine = asyncio.create_task(store.watch("job/1/", rev, 5, prefix=True))
        other = asyncio.create_task(store.watch("job/2/", rev, 5, prefix=True))
        everything = asyncio.create_task(store.watch("", rev, 5, prefix=True))
        await asyncio.sleep(0.01)
        await store.put("job/1/x", b"1")
        got: list[WatchEvent] = await mine
        assert [e.key for e in got] == ["job/1/x"]
        assert [e.key for e in await everything] == ["job/1/x"]
        assert not other.done()
        other.cancel()
        await asyncio.gather(other, return_exceptions=True)
        assert not store._waiters_by_prefix
