"""The embedded store's durability: restarts, leases across restarts, disk failures."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from pathlib import Path

import pytest

from elasticd.errors import LeaseNotFound, StoreCompacted, StoreUnavailable
from elasticd.store.embedded import SCHEMA_VERSION, EmbeddedStore, read_target

pytestmark = pytest.mark.timeout(30)


async def test_restart_keeps_keys_and_revision(tmp_path: Path) -> None:
    """Keys without a lease, their versions and the revision survive a close and reopen."""
    path = tmp_path / "store.sqlite3"
    async with EmbeddedStore(path) as store:
        a = await store.put("/a", b"1")
        await store.put("/b", b"2")
        await store.delete("/b")
        counter = await store.add("/n", 41)
        last = store.revision
    async with EmbeddedStore(path) as store:
        assert await store.get("/a") == a
        assert await store.get("/b") is None
        assert await store.add("/n") == counter + 1
        assert store.revision == last + 1  # the add above; nothing reused


async def test_leases_and_their_keys_survive_a_restart(tmp_path: Path) -> None:
    """A lease comes back with its keys and a fresh grace: its holder just keeps it alive."""
    path = tmp_path / "store.sqlite3"
    async with EmbeddedStore(path) as store:
        lease = await store.grant(3600)
        node = await store.put("/nodes/a", b"alive", lease=lease)
        kept = await store.put("/jobs/x", b"spec")
        before = store.revision
    async with EmbeddedStore(path) as store:
        assert await store.get("/nodes/a") == node
        assert await store.get("/jobs/x") == kept
        assert store.revision == before  # nothing changed on open
        await store.keep_alive(lease)  # the holder carries on
        again = await store.put("/nodes/a", b"still", lease=lease)
        assert again.lease == lease and again.version > before
        with pytest.raises(StoreCompacted):
            await store.watch("/jobs/x", node.version, 1)  # history does not survive


async def test_a_restored_lease_nobody_keeps_alive_expires_after_one_ttl(tmp_path: Path) -> None:
    """The grace is one TTL from the first use after the restart; then its keys go, as changes."""
    path = tmp_path / "store.sqlite3"
    async with EmbeddedStore(path) as store:
        lease = await store.grant(0.5)
        await store.put("/nodes/gone", b"x", lease=lease)
        await store.keep_alive(lease)
        before = store.revision
    async with EmbeddedStore(path) as store:
        assert await store.get("/nodes/gone") is not None  # starts the grace
        events = await store.watch("/nodes/gone", before, 5)
        assert [e.kind for e in events] == ["delete"]
        assert await store.get("/nodes/gone") is None
        with pytest.raises(LeaseNotFound):
            await store.keep_alive(lease)
    async with EmbeddedStore(path) as store:  # the expiry itself was committed
        assert await store.get("/nodes/gone") is None
        with pytest.raises(LeaseNotFound):
            await store.keep_alive(lease)


async def test_a_revoked_lease_does_not_come_back(tmp_path: Path) -> None:
    path = tmp_path / "store.sqlite3"
    async with EmbeddedStore(path) as store:
        lease = await store.grant(3600)
        await store.put("/nodes/a", b"x", lease=lease)
        await store.revoke(lease)
    async with EmbeddedStore(path) as store:
        assert await store.get("/nodes/a") is None
        with pytest.raises(LeaseNotFound):
            await store.keep_alive(lease)


async def test_leased_keys_of_a_file_without_lease_rows_get_the_default_grace(
    tmp_path: Path,
) -> None:
    """A file written before leases were kept: its leased keys are restored, not dropped."""
    path = tmp_path / "store.sqlite3"
    async with EmbeddedStore(path) as store:
        lease = await store.grant(3600)
        await store.put("/nodes/a", b"x", lease=lease)
    with sqlite3.connect(path) as db:
        db.execute("DELETE FROM leases")
    async with EmbeddedStore(path) as store:
        assert (await store.get("/nodes/a")) is not None
        await store.keep_alive(lease)


async def test_acknowledged_writes_are_on_disk_before_close(tmp_path: Path) -> None:
    """Every acknowledged write is readable by a second opener while the first never closed."""
    path = tmp_path / "store.sqlite3"
    first = EmbeddedStore(path)
    written = await asyncio.gather(*(first.put(f"/k/{i}", str(i).encode()) for i in range(200)))
    second = EmbeddedStore(path)  # as a restarted process would see the file
    try:
        for entry in written:
            assert await second.get(entry.key) == entry
    finally:
        await second.close()
        await first.close()


async def test_group_commit_batches_concurrent_writes(tmp_path: Path) -> None:
    """Concurrent writes share commits: far fewer transactions than writes."""
    store = EmbeddedStore(tmp_path / "store.sqlite3")
    commits = 0
    original = store._commit

    def counting(*args: object) -> None:
        nonlocal commits
        commits += 1
        original(*args)  # type: ignore[arg-type]

    store._commit = counting  # type: ignore[method-assign]
    try:
        await asyncio.gather(*(store.add("/n") for _ in range(500)))
        assert await store.add("/n") == 501
        assert commits < 250
    finally:
        await store.close()


async def test_watchers_wake_only_after_commit(tmp_path: Path) -> None:
    """A watcher is woken by a change only once that change is durable."""
    async with EmbeddedStore(tmp_path / "store.sqlite3") as store:
        base = await store.put("/k", b"0")
        task = asyncio.create_task(store.watch("/k", base.version, 5))
        await asyncio.sleep(0)
        written = await store.put("/k", b"1")
        events = await task
        assert store._durable >= written.version
        assert [e.revision for e in events] == [written.version]


async def test_disk_failure_stops_the_store(tmp_path: Path) -> None:
    """When a commit fails, the write and every later call raise StoreUnavailable naming the file."""
    path = tmp_path / "store.sqlite3"
    store = EmbeddedStore(path)
    await store.put("/a", b"1")
    store._db.close()  # every later statement fails, as a dying disk would
    with pytest.raises(StoreUnavailable, match=str(path)):
        await store.put("/b", b"2")
    with pytest.raises(StoreUnavailable, match="state file"):
        await store.get("/a")
    await store.close()


async def test_normal_synchronous_mode(tmp_path: Path) -> None:
    """synchronous=NORMAL is accepted and the data still survives a reopen."""
    path = tmp_path / "store.sqlite3"
    async with EmbeddedStore(path, synchronous="NORMAL") as store:
        entry = await store.put("/a", b"1")
    async with EmbeddedStore(path) as store:
        assert await store.get("/a") == entry


def test_file_from_a_newer_version_is_refused(tmp_path: Path) -> None:
    """A state file with a newer schema version is refused with a clear error."""
    path = tmp_path / "store.sqlite3"
    with sqlite3.connect(path) as db:
        db.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    with pytest.raises(StoreUnavailable, match="newer elasticd"):
        EmbeddedStore(path)


def test_garbage_file_is_refused(tmp_path: Path) -> None:
    """A file that is not SQLite is refused with an error naming it."""
    path = tmp_path / "store.sqlite3"
    path.write_bytes(b"this is not a database" * 100)
    with pytest.raises(StoreUnavailable, match=str(path)):
        EmbeddedStore(path)


def test_wal_mode_is_used(tmp_path: Path) -> None:
    """The state file is in WAL mode, so a crash never leaves it half-written."""
    path = tmp_path / "store.sqlite3"
    store = EmbeddedStore(path)
    try:
        with sqlite3.connect(path) as db:
            assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        asyncio.run(store.close())


@pytest.mark.parametrize(
    ("key", "prefix", "target"),
    [
        ("/jobs/a", False, 7),  # its own change is not durable yet
        ("/jobs/b", False, 0),  # nothing of it waits: answer at once
        ("/jobs/", True, 9),  # the latest change under the prefix
        ("/nodes/", True, 0),
        ("/", True, 9),
    ],
)
def test_a_read_waits_for_the_changes_it_saw(key: str, prefix: bool, target: int) -> None:
    """read_target: the revision a read waits to be durable is that of the latest change of
    what it reads that is not durable yet, 0 when there is none."""
    undurable = {"/jobs/a": 7, "/jobs/c": 9, "/events/x": 8}
    assert read_target(undurable, key, prefix=prefix) == target


async def test_a_read_never_waits_for_the_commit_of_other_keys(tmp_path: Path) -> None:
    """While the disk holds another key's commit, a read of a durable key (or prefix) answers
    at once; a read of the pending key waits for its commit, and a listing reports a
    revision that is durable (a watch from it misses nothing after a crash)."""
    async with EmbeddedStore(tmp_path / "store.sqlite3") as store:
        durable = await store.put("/jobs/a", b"1")
        held, release = asyncio.Event(), threading.Event()
        loop = asyncio.get_running_loop()

        def hold_the_disk() -> None:  # the writer thread, busy as with a slow fsync
            loop.call_soon_threadsafe(held.set)
            release.wait(timeout=20)

        blocker = loop.run_in_executor(store._writer, hold_the_disk)
        await held.wait()
        pending = asyncio.create_task(store.put("/events/x", b"2"))
        await asyncio.sleep(0)
        try:
            async with asyncio.timeout(5):
                assert await store.get("/jobs/a") == durable
                listing = await store.list("/jobs/")
            assert listing.entries == [durable]
            assert listing.revision <= store._durable
            waiting = asyncio.create_task(store.get("/events/x"))
            await asyncio.sleep(0.05)
            assert not waiting.done()  # its change is not on disk yet
        finally:
            release.set()
            await blocker
        written = await pending
        assert await waiting == written
