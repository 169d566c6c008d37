"""Storage faults (issue 12, defect 2): classification, the ordered backlog, the embedded store.

The pure parts are tested as tables; the backlog with a write that fails on
command; the embedded store and the event log on a real, really full tmpfs
(root only, as CI is).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from elasticd.clock import FakeClock
from elasticd.eventkinds import EventKind
from elasticd.node.db import Database
from elasticd.node.events import EventLog
from elasticd.storage import (
    BACKOFF_MAX,
    StorageHealth,
    WriteBacklog,
    describe,
    is_storage_fault,
    next_backoff,
)
from elasticd.store.embedded import EmbeddedStore

pytestmark = pytest.mark.timeout(60)


def _sqlite_error(message: str, code: int | None) -> sqlite3.OperationalError:
    exc = sqlite3.OperationalError(message)
    if code is not None:
        exc.sqlite_errorcode = code  # type: ignore[attr-defined]
    return exc


@pytest.mark.parametrize(
    ("exc", "fault"),
    [
        (OSError(errno.ENOSPC, "No space left on device"), True),
        (OSError(errno.EDQUOT, "Disk quota exceeded"), True),
        (OSError(errno.EIO, "Input/output error"), True),
        (OSError(errno.EROFS, "Read-only file system"), True),
        (OSError(errno.EPERM, "Operation not permitted"), False),
        (OSError(errno.ENOENT, "No such file"), False),
        (_sqlite_error("database or disk is full", 13), True),
        (_sqlite_error("disk I/O error", 10 | (4 << 8)), True),  # SQLITE_IOERR_WRITE
        (_sqlite_error("database is locked", 5), False),
        (_sqlite_error("database or disk is full", None), True),
        (sqlite3.ProgrammingError("Cannot operate on a closed database."), False),
        (ValueError("disk"), False),
    ],
)
def test_what_counts_as_a_storage_fault(exc: BaseException, fault: bool) -> None:
    """Full and failing disks are storage faults; locks, bugs and permissions are not."""
    assert is_storage_fault(exc) is fault


def test_reasons_name_the_disk() -> None:
    """Every reason /readyz shows says "disk"."""
    assert describe(OSError(errno.ENOSPC, "No space left on device")).startswith("disk full")
    assert describe(_sqlite_error("database or disk is full", 13)).startswith("disk full")
    assert describe(OSError(errno.EIO, "Input/output error")).startswith("disk error")


def test_backoff_doubles_from_50_ms_to_at_most_2_s() -> None:
    """Retries back off: 50 ms, doubling, capped."""
    delays = [0.0]
    for _ in range(10):
        delays.append(next_backoff(delays[-1]))
    assert delays[1:4] == [0.05, 0.1, 0.2]
    assert max(delays) == BACKOFF_MAX


def test_health_reports_the_oldest_fact_until_every_source_is_clear() -> None:
    """The reason names the oldest degraded source; ready again once all are clear."""
    clock = FakeClock(1000.0)
    health = StorageHealth(clock)
    back: list[tuple[str, float]] = []
    health.on_state_back(lambda first, seconds: back.append((first.source, seconds)))
    assert health.reason is None
    health.failing("state file a", "disk full (x)")
    clock.advance(5)
    health.failing("log b", "disk full (y)")
    health.failing("state file a", "disk full (later)")  # the episode keeps its start
    since = clock.time() - 5
    assert health.reason == (
        f"storage degraded since {since:.0f}: state file a: disk full (x) (and 1 more)"
    )
    assert health.state_degraded() is not None
    clock.advance(2)
    health.ok("state file a")
    assert back == [("state file a", 7.0)]  # once, when the state disk is clear
    assert health.state_degraded() is None  # log files do not refuse new jobs
    assert health.reason is not None and "log b" in health.reason
    health.ok("log b", gone=True)
    assert health.reason is None
    assert len(back) == 1


async def test_backlog_keeps_order_and_lands_everything_once_the_disk_takes_it() -> None:
    """Writes the disk refuses wait, later ones queue behind them, all land in order."""
    health = StorageHealth()
    backlog = WriteBacklog("state file t", health)
    full = True
    written: list[int] = []
    landed: list[int] = []

    def write(n: int) -> int:
        if full:
            raise sqlite3.OperationalError("database or disk is full")
        written.append(n)
        return n

    assert backlog.submit(lambda: write(0), landed.append) is False
    assert health.reason is not None and "disk full" in health.reason
    full = False  # a later write would succeed at once, but must not jump the queue
    for n in range(1, 5):
        assert backlog.submit(lambda n=n: write(n), landed.append) is False
    async with asyncio.timeout(10):
        await backlog.wait_empty()
    assert written == landed == [0, 1, 2, 3, 4]
    assert health.reason is None
    assert backlog.submit(lambda: write(5), landed.append) is True


async def test_backlog_is_bounded_and_counts_what_it_drops() -> None:
    """Past its limit the backlog drops new writes and counts them by tag, except the
    writes it must keep (the worker table the orphan sweep reads)."""
    health = StorageHealth()
    drained: list[dict[str, int]] = []
    backlog = WriteBacklog("state file t", health, limit=3, on_drained=drained.append)
    full = True
    landed: list[int] = []

    def write(n: int) -> int:
        if full:
            raise OSError(errno.ENOSPC, "No space left on device")
        return n

    for n in range(5):
        backlog.submit(lambda n=n: write(n), landed.append, tag="job-a" if n < 4 else "job-b")
    backlog.submit(lambda: write(99), landed.append, keep=True)
    assert len(backlog) == 4 and backlog.dropped == {"job-a": 1, "job-b": 1}
    full = False
    async with asyncio.timeout(10):
        await backlog.wait_empty()
    assert landed == [0, 1, 2, 99] and health.reason is None
    assert drained == [{"job-a": 1, "job-b": 1}] and backlog.dropped == {}


async def test_events_dropped_past_the_backlog_are_reported_per_job(tmp_path) -> None:
    """The event log says, in the job's own events, how many were lost past the bound."""
    from elasticd.node.db import Database
    from elasticd.node.events import EventLog

    db = Database(tmp_path / "state.sqlite3")
    db.open()
    log = EventLog(db, "n0")
    db.backlog.dropped = {"job-a": 3}
    db.backlog.on_drained({"job-a": 3}) if db.backlog.on_drained else None
    (event,) = [e for e in db.list_events("job-a", 0, 10) if e.kind == "events.dropped"]
    assert event.count == 3 and "3 events" in event.message and event.node == "n0"
    assert log is not None
    db.close()


async def test_backlog_raises_what_is_not_a_disk_fault() -> None:
    """A bug is not hidden as a disk fault."""
    backlog = WriteBacklog("state file t", StorageHealth())

    def broken() -> None:
        raise sqlite3.ProgrammingError("Cannot operate on a closed database.")

    with pytest.raises(sqlite3.ProgrammingError):
        backlog.submit(broken, lambda _: None)
    assert len(backlog) == 0


# -- on a really full disk ------------------------------------------------------------


@contextlib.contextmanager
def full_tmpfs(folder: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs at ``folder``; yields the filler path (create it with :func:`fill`)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    folder.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(folder)], check=True)
    try:
        yield folder / "filler"
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def fill(filler: Path) -> None:
    chunk = b"\0" * 65536
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        while chunk:
            try:
                os.write(fd, chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                chunk = chunk[: len(chunk) // 2]
    finally:
        os.close(fd)


async def test_embedded_store_waits_out_a_full_disk_and_loses_nothing(tmp_path: Path) -> None:
    """A commit the disk refuses is retried; reads answer meanwhile; the write lands once freed."""
    with full_tmpfs(tmp_path / "disk") as filler:
        path = filler.parent / "store.sqlite3"
        store = EmbeddedStore(path)
        try:
            await store.put("/a", b"before")
            fill(filler)
            write = asyncio.create_task(store.put("/b", b"x" * 20000))
            async with asyncio.timeout(10):
                while store.health.reason is None:
                    await asyncio.sleep(0.01)
            assert "disk full" in store.health.reason
            assert not write.done()  # not acknowledged: it is not on disk
            entry = await asyncio.wait_for(store.get("/a"), 2)  # reads still answer
            assert entry is not None and entry.value == b"before"
            filler.unlink()
            async with asyncio.timeout(10):
                written = await write
            assert store.health.reason is None
        finally:
            await store.close()
        async with EmbeddedStore(path) as reopened:
            assert await reopened.get("/b") == written


async def test_event_log_never_raises_on_a_full_disk_and_lands_events_in_order(
    tmp_path: Path,
) -> None:
    """emit() on a full disk returns; the events land in emission order once space returns."""
    with full_tmpfs(tmp_path / "disk") as filler:
        db = Database(filler.parent / "elasticd.sqlite3").open()
        try:
            events = EventLog(db, "n1")
            events.emit("j", "agent", EventKind.JOB_STATE, "first")
            fill(filler)
            for n in range(50):
                events.emit("j", "agent", EventKind.WORKER_EXITED, f"full-{n}" + "y" * 200)
            assert db.health.reason is not None and "disk full" in db.health.reason
            filler.unlink()
            async with asyncio.timeout(10):
                await db.backlog.wait_empty()
            said = [e.message.rstrip("y") for e in events.read("j")]
            assert said == ["first", *(f"full-{n}" for n in range(50))]
            assert db.health.reason is None
        finally:
            await db.backlog.stop()
            db.close()
