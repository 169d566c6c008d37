"""The store contract, run unchanged against every backend (see ``conftest.py``).

Tests never assume the store is empty or at revision 0 (the etcd server is
shared by the session): each one works under its own key prefix ``ns``.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from elasticd.errors import (
    InvalidKey,
    LeaseNotFound,
    ListingTooLarge,
    StoreCompacted,
    ValueTooLarge,
)
from elasticd.store.base import DEFAULT_MAX_VALUE_BYTES, Store, WatchEvent

from .conftest import LIST_LIMIT, Backend

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def ns() -> str:
    """A key prefix no other test uses."""
    return f"/test/{uuid.uuid4().hex[:12]}/"


async def _watch_soon(
    store: Store, key: str, after: int, timeout: float = 10.0, *, prefix: bool = False
) -> asyncio.Task[list[WatchEvent]]:
    """Start a watch and give it a moment to reach the store before the caller writes."""
    task = asyncio.create_task(store.watch(key, after, timeout, prefix=prefix))
    await asyncio.sleep(0.05)  # not a correctness wait: the watch must not miss changes anyway
    return task


# -- reads and writes --------------------------------------------------------


async def test_get_absent_key_is_none(store: Store, ns: str) -> None:
    """Reading a key that was never written gives None."""
    assert await store.get(ns + "missing") is None


async def test_put_then_get_returns_value_and_versions(store: Store, ns: str) -> None:
    """A put is read back with version = created = its revision, and the next put keeps created."""
    first = await store.put(ns + "k", b"one")
    assert first.value == b"one"
    assert first.version == first.created
    got = await store.get(ns + "k")
    assert got is not None
    assert (got.value, got.version, got.created) == (b"one", first.version, first.created)
    second = await store.put(ns + "k", b"two")
    assert second.version > first.version
    assert second.created == first.created


async def test_revisions_grow_with_every_change(store: Store, ns: str) -> None:
    """Every change gets a higher revision than the one before, across keys."""
    versions = [(await store.put(f"{ns}k{i % 3}", b"x")).version for i in range(9)]
    assert versions == sorted(versions)
    assert len(set(versions)) == len(versions)


async def test_cas_create_if_absent(store: Store, ns: str) -> None:
    """CAS with expected_version=None creates a key once; a second create loses to the first."""
    won = await store.compare_and_set(ns + "k", b"a", None)
    assert won.ok
    assert won.entry is not None
    assert won.entry.value == b"a"
    lost = await store.compare_and_set(ns + "k", b"b", None)
    assert not lost.ok
    assert lost.entry == won.entry


async def test_cas_on_version(store: Store, ns: str) -> None:
    """CAS writes on the current version and, on a stale one, returns the winner's entry."""
    created = await store.compare_and_set(ns + "k", b"a", None)
    assert created.entry is not None
    updated = await store.compare_and_set(ns + "k", b"b", created.entry.version)
    assert updated.ok
    assert updated.entry is not None
    assert updated.entry.value == b"b"
    stale = await store.compare_and_set(ns + "k", b"c", created.entry.version)
    assert not stale.ok
    assert stale.entry == updated.entry


async def test_cas_on_a_deleted_key_reports_absence(store: Store, ns: str) -> None:
    """CAS on a version of a key that is gone fails with entry None."""
    entry = await store.put(ns + "k", b"a")
    assert await store.delete(ns + "k")
    lost = await store.compare_and_set(ns + "k", b"b", entry.version)
    assert lost == type(lost)(ok=False, entry=None)


async def test_cas_race_has_exactly_one_winner_per_version(backend: Backend, ns: str) -> None:
    """Many clients CAS from the same version at once; exactly one wins each round."""
    clients = [await backend.client() for _ in range(8)]
    key = ns + "race"
    start = await clients[0].compare_and_set(key, b"0", None)
    assert start.entry is not None
    version = start.entry.version
    for round_ in range(5):
        attempts = [
            c.compare_and_set(key, f"{round_}:{i}".encode(), version)
            for i, c in enumerate(clients * 3)
        ]
        results = await asyncio.gather(*attempts)
        winners = [r for r in results if r.ok]
        assert len(winners) == 1
        winner = winners[0].entry
        assert winner is not None
        for lost in results:
            if not lost.ok:
                assert lost.entry is not None
                assert lost.entry.version >= winner.version
        current = await clients[0].get(key)
        assert current == winner
        version = winner.version


async def test_put_is_unconditional(store: Store, ns: str) -> None:
    """A put overwrites whatever version is there."""
    await store.put(ns + "k", b"a")
    entry = await store.put(ns + "k", b"b")
    got = await store.get(ns + "k")
    assert got == entry


# -- counters ------------------------------------------------------------------


async def test_add_counts_from_zero(store: Store, ns: str) -> None:
    """add starts an absent counter at 0, returns the new value and stores ASCII decimal."""
    assert await store.add(ns + "n") == 1
    assert await store.add(ns + "n", 5) == 6
    assert await store.add(ns + "n", -10) == -4
    got = await store.get(ns + "n")
    assert got is not None
    assert got.value == b"-4"


async def test_add_on_a_non_counter_is_refused(store: Store, ns: str) -> None:
    """add on a key holding something else than an integer raises InvalidKey."""
    await store.put(ns + "n", b"not a number")
    with pytest.raises(InvalidKey, match="counter"):
        await store.add(ns + "n")


async def test_counter_loses_no_update(backend: Backend, ns: str) -> None:
    """Concurrent adds from 50 tasks over several clients sum exactly (no lost update)."""
    clients = [await backend.client() for _ in range(5)]
    tasks = 50
    per_task = backend.counter_total // tasks
    key = ns + "counter"

    async def worker(i: int) -> list[int]:
        client = clients[i % len(clients)]
        return [await client.add(key) for _ in range(per_task)]

    seen = await asyncio.gather(*(worker(i) for i in range(tasks)))
    total = tasks * per_task
    returned = sorted(v for values in seen for v in values)
    assert returned == list(range(1, total + 1))  # every value handed out exactly once
    got = await clients[0].get(key)
    assert got is not None
    assert got.value == str(total).encode()


# -- delete --------------------------------------------------------------------


async def test_delete_with_expected_version(store: Store, ns: str) -> None:
    """delete honours expected_version and reports whether it deleted."""
    entry = await store.put(ns + "k", b"a")
    assert not await store.delete(ns + "k", expected_version=entry.version + 1000)
    assert await store.get(ns + "k") == entry
    assert await store.delete(ns + "k", expected_version=entry.version)
    assert await store.get(ns + "k") is None
    assert not await store.delete(ns + "k")


async def test_recreated_key_has_a_new_created_revision(store: Store, ns: str) -> None:
    """A key deleted and written again starts a new life (created moves forward)."""
    first = await store.put(ns + "k", b"a")
    await store.delete(ns + "k")
    again = await store.put(ns + "k", b"b")
    assert again.created > first.created
    assert again.created == again.version


# -- listing -------------------------------------------------------------------


async def test_list_prefix_is_sorted_and_exact(store: Store, ns: str) -> None:
    """list returns exactly the keys under the prefix, sorted, with the read revision."""
    for name in ["b", "a", "c/d", "c/a"]:
        await store.put(f"{ns}jobs/{name}", name.encode())
    await store.put(f"{ns}jobsX", b"outside")
    await store.put(f"{ns}node", b"outside")
    listing = await store.list(ns + "jobs/")
    assert [e.key for e in listing.entries] == [f"{ns}jobs/{n}" for n in ["a", "b", "c/a", "c/d"]]
    assert [e.value for e in listing.entries] == [b"a", b"b", b"c/a", b"c/d"]
    assert listing.revision >= max(e.version for e in listing.entries)
    assert (await store.list(ns + "nothing/")).entries == []


async def test_watch_from_listing_revision_misses_nothing(store: Store, ns: str) -> None:
    """A prefix watch from a listing's revision sees the first change made after the listing."""
    await store.put(ns + "jobs/a", b"1")
    listing = await store.list(ns + "jobs/")
    await store.put(ns + "jobs/b", b"2")
    events = await store.watch(ns + "jobs/", listing.revision, 5, prefix=True)
    assert [(e.kind, e.key, e.value) for e in events] == [("put", ns + "jobs/b", b"2")]


# -- leases --------------------------------------------------------------------


async def test_lease_expiry_deletes_keys_and_watchers_see_it(backend: Backend, ns: str) -> None:
    """When a lease runs out its keys vanish and a watcher of the key gets the delete."""
    store = await backend.client()
    lease = await store.grant(backend.lease_ttl)
    entry = await store.put(ns + "node", b"alive", lease=lease)
    assert entry.lease == lease
    unleased = await store.put(ns + "other", b"stays")
    started = time.monotonic()
    events = await store.watch(ns + "node", entry.version, backend.lease_ttl + 10)
    elapsed = time.monotonic() - started
    assert [(e.kind, e.key, e.value) for e in events] == [("delete", ns + "node", None)]
    assert elapsed >= backend.lease_ttl * 0.5
    assert await store.get(ns + "node") is None
    assert await store.get(ns + "other") == unleased
    with pytest.raises(LeaseNotFound):
        await store.keep_alive(lease)


async def test_keep_alive_extends_a_lease(backend: Backend, ns: str) -> None:
    """A lease kept alive past its TTL keeps its keys."""
    store = await backend.client()
    ttl = backend.lease_ttl
    lease = await store.grant(ttl)
    await store.put(ns + "node", b"alive", lease=lease)
    deadline = time.monotonic() + ttl * 2.5
    while time.monotonic() < deadline:
        await store.keep_alive(lease)
        await asyncio.sleep(ttl / 4)
    got = await store.get(ns + "node")
    assert got is not None
    assert got.value == b"alive"
    await store.revoke(lease)


async def test_revoke_deletes_the_lease_keys(store: Store, ns: str) -> None:
    """Revoking a lease deletes all its keys, and a watch sees a delete for each."""
    lease = await store.grant(60)
    await store.put(ns + "a", b"1", lease=lease)
    last = await store.put(ns + "b", b"2", lease=lease)
    await store.revoke(lease)
    events = await store.watch(ns, last.version, 5, prefix=True)
    assert sorted((e.kind, e.key) for e in events) == [("delete", ns + "a"), ("delete", ns + "b")]
    # etcd deletes them in one revision, the other backends one revision each.
    assert all(e.revision > last.version for e in events)
    assert (await store.list(ns)).entries == []
    with pytest.raises(LeaseNotFound):
        await store.keep_alive(lease)


async def test_revoke_unknown_lease_is_not_an_error(store: Store) -> None:
    """Revoking a lease that does not exist does nothing."""
    lease = await store.grant(60)
    await store.revoke(lease)
    await store.revoke(lease)


async def test_write_with_unknown_lease_is_refused(store: Store, ns: str) -> None:
    """put and a winning CAS with a lease that is gone raise LeaseNotFound and write nothing."""
    lease = await store.grant(60)
    await store.revoke(lease)
    with pytest.raises(LeaseNotFound):
        await store.put(ns + "k", b"x", lease=lease)
    with pytest.raises(LeaseNotFound):
        await store.compare_and_set(ns + "k", b"x", None, lease=lease)
    assert await store.get(ns + "k") is None


async def test_overwrite_without_lease_detaches_key(store: Store, ns: str) -> None:
    """A key rewritten without a lease no longer dies with that lease."""
    lease = await store.grant(60)
    await store.put(ns + "k", b"leased", lease=lease)
    await store.put(ns + "k", b"free")
    await store.revoke(lease)
    got = await store.get(ns + "k")
    assert got is not None
    assert got.value == b"free"
    assert got.lease is None


# -- watch ---------------------------------------------------------------------


async def test_watch_returns_past_changes_at_once(store: Store, ns: str) -> None:
    """A watch from an old version returns the changes already made, without waiting."""
    first = await store.put(ns + "k", b"1")
    await store.put(ns + "k", b"2")
    await store.delete(ns + "k")
    async with asyncio.timeout(2):
        events = await store.watch(ns + "k", first.version, 30)
    assert [(e.kind, e.value) for e in events] == [("put", b"2"), ("delete", None)]
    assert events[0].revision < events[1].revision


async def test_zero_timeout_watch_returns_history(store: Store, ns: str) -> None:
    """A watch with timeout 0 returns the changes already made, or [] when there are none."""
    first = await store.put(ns + "k", b"1")
    second = await store.put(ns + "k", b"2")
    events = await store.watch(ns + "k", first.version, 0)
    assert [e.revision for e in events] == [second.version]
    assert await store.watch(ns + "k", second.version, 0) == []


async def test_watch_wakes_on_change(store: Store, ns: str) -> None:
    """A pending watch returns promptly with the change that was made."""
    entry = await store.put(ns + "k", b"1")
    task = await _watch_soon(store, ns + "k", entry.version, 30)
    assert not task.done()
    written = await store.put(ns + "k", b"2")
    async with asyncio.timeout(5):
        events = await task
    assert events == [WatchEvent(kind="put", key=ns + "k", value=b"2", revision=written.version)]


async def test_watch_times_out_empty_without_spurious_wakeups(store: Store, ns: str) -> None:
    """A watch on a quiet key returns [] at its timeout, even while other keys change."""
    entry = await store.put(ns + "quiet", b"1")
    started = time.monotonic()
    task = await _watch_soon(store, ns + "quiet", entry.version, 0.8)
    for i in range(5):
        await store.put(ns + "quiet-not", str(i).encode())  # same prefix, different key
    events = await task
    assert events == []
    assert time.monotonic() - started >= 0.75


async def test_idle_watch_uses_no_cpu(store: Store, ns: str) -> None:
    """An idle watch burns (almost) no CPU in this process: it waits, it does not poll."""
    entry = await store.put(ns + "idle", b"1")
    cpu_before = time.process_time()
    wall_before = time.monotonic()
    assert await store.watch(ns + "idle", entry.version, 1.0) == []
    wall = time.monotonic() - wall_before
    cpu = time.process_time() - cpu_before
    assert wall >= 0.95
    assert cpu < 0.1 * wall, f"idle watch used {cpu:.3f}s CPU in {wall:.3f}s"


async def test_watch_from_future_revision_waits(store: Store, ns: str) -> None:
    """A watch from a revision ahead of the key's changes waits for a newer change."""
    entry = await store.put(ns + "k", b"1")
    task = await _watch_soon(store, ns + "k", entry.version + 1, 5)
    await store.put(ns + "other", b"x")  # takes revision version + 1 (or later)
    nxt = await store.put(ns + "k", b"2")
    async with asyncio.timeout(5):
        events = await task
    assert [e.revision for e in events] == [nxt.version]


async def test_prefix_watch_sees_only_its_prefix(store: Store, ns: str) -> None:
    """A prefix watch returns changes under the prefix and ignores keys outside it."""
    base = await store.put(ns + "outside", b"0")
    task = await _watch_soon(store, ns + "jobs/", base.version, 10, prefix=True)
    await store.put(ns + "outside", b"1")
    await store.put(ns + "jobsX", b"1")
    written = await store.put(ns + "jobs/a/b", b"2")
    async with asyncio.timeout(5):
        events = await task
    assert [(e.key, e.revision) for e in events] == [(ns + "jobs/a/b", written.version)]


async def test_many_watchers_all_wake(backend: Backend, ns: str) -> None:
    """Every one of many concurrent watchers of a key wakes on one change."""
    store = await backend.client()
    base = await store.put(ns + "k", b"0")
    clients = [await backend.client() for _ in range(4)]
    tasks = [
        asyncio.create_task(clients[i % 4].watch(ns + "k", base.version, 10)) for i in range(20)
    ]
    await asyncio.sleep(0.1)
    written = await store.put(ns + "k", b"1")
    async with asyncio.timeout(5):
        results = await asyncio.gather(*tasks)
    assert all([e.revision for e in events] == [written.version] for events in results)


async def test_watch_of_compacted_history_raises(backend: Backend, ns: str) -> None:
    """A watch from before the compacted history raises StoreCompacted with a usable revision."""
    store = await backend.client()
    first = await store.put(ns + "k", b"0")
    for i in range(5):
        last = await store.put(ns + "k", str(i).encode())
    await backend.compact(last.version)
    with pytest.raises(StoreCompacted) as caught:
        await store.watch(ns + "k", first.version, 1)
    assert first.version <= caught.value.revision <= last.version
    task = await _watch_soon(store, ns + "k", caught.value.revision, 5)
    written = await store.put(ns + "k", b"after")
    async with asyncio.timeout(5):
        events = await task
    assert events[-1].revision == written.version


# -- keys and values -----------------------------------------------------------


async def test_one_mebibyte_values(store: Store, ns: str) -> None:
    """A 1 MiB value survives put, get, CAS and watch byte for byte."""
    value = bytes(range(256)) * 4096
    entry = await store.put(ns + "big", value)
    got = await store.get(ns + "big")
    assert got is not None
    assert got.value == value
    changed = value[::-1]
    result = await store.compare_and_set(ns + "big", changed, entry.version)
    assert result.ok
    events = await store.watch(ns + "big", entry.version, 5)
    assert events[0].value == changed


async def test_value_over_limit_is_refused(store: Store, ns: str) -> None:
    """A value over the store's limit raises ValueTooLarge and writes nothing."""
    with pytest.raises(ValueTooLarge):
        await store.put(ns + "huge", b"x" * (DEFAULT_MAX_VALUE_BYTES + 1))
    assert await store.get(ns + "huge") is None


async def test_a_listing_over_the_limit_is_refused(store: Store, ns: str) -> None:
    """A list answer over the store's list limit raises ListingTooLarge naming the prefix and
    the setting; a narrower prefix still lists."""
    value = b"x" * (DEFAULT_MAX_VALUE_BYTES - 1024)
    for i in range(LIST_LIMIT // len(value) + 1):
        await store.put(f"{ns}big/{i}", value)
    with pytest.raises(ListingTooLarge, match="store_max_list_bytes") as refused:
        await store.list(ns + "big/")
    assert f"{ns}big/" in str(refused.value)
    assert [e.key for e in (await store.list(ns + "big/1")).entries] == [f"{ns}big/1"]


async def test_empty_value(store: Store, ns: str) -> None:
    """An empty value is a value, not an absence."""
    await store.put(ns + "empty", b"")
    got = await store.get(ns + "empty")
    assert got is not None
    assert got.value == b""


@pytest.mark.parametrize(
    "name",
    ["a/b/c", "ü/日本語/ключ", "with space/and:colon", "trailing/", "emoji/🚀", "dots/./.../x.y"],
)
async def test_keys_with_slashes_and_unicode(store: Store, ns: str, name: str) -> None:
    """Keys with slashes, spaces and non-ASCII characters round-trip through every call."""
    key = ns + name
    entry = await store.put(key, name.encode())
    got = await store.get(key)
    assert got == entry
    listing = await store.list(key)
    assert [e.key for e in listing.entries] == [key]
    events = await store.watch(key, entry.version - 1, 1)
    assert [e.key for e in events] == [key]
    assert await store.delete(key, expected_version=entry.version)


@pytest.mark.parametrize("key", ["", "a/../b", "..", "a/..", "a\x00b", "line\nbreak", "tab\t"])
async def test_invalid_keys_are_refused(store: Store, key: str) -> None:
    """Empty keys, '..' segments and control characters raise InvalidKey."""
    with pytest.raises(InvalidKey):
        await store.put(key, b"x")
    with pytest.raises(InvalidKey):
        await store.get(key)
