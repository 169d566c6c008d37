"""SQLite persistence of this daemon's events (WAL mode), under its state dir.

Jobs live in the cluster store (which, embedded, is SQLite too); this file
holds what this node itself recorded, first, so that an event is on disk
before anyone is told of it, and is published to the store afterwards.

Writes happen on the event loop thread: each is one small transaction (well
under a millisecond in WAL mode), which keeps ordering trivial and avoids a
thread hop on the exit-detection path. ``synchronous=NORMAL`` in WAL mode
survives a crash or SIGKILL of the daemon (the WAL is in the OS page cache);
only a power loss can drop the last transactions. Rows hold JSON documents
of :class:`elasticd.models.Event`; nothing is pickled.

A write the disk refuses (full, I/O error) never raises into the caller of
:meth:`Database.submit_event`, :meth:`Database.record_worker`,
:meth:`Database.forget_workers` or :meth:`Database.delete_events`: it waits,
in order, in the database's :class:`~elasticd.storage.WriteBacklog`, which
retries until it lands and keeps the "degraded" fact in
:attr:`Database.health` meanwhile (see :mod:`elasticd.storage`).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self

from elasticd.models import Event
from elasticd.node.retention import EndSeen
from elasticd.security import create_private_file, make_private_dir
from elasticd.storage import StorageHealth, WriteBacklog

SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
    seq       INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id    TEXT NOT NULL,
    doc       TEXT NOT NULL,
    published INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS events_by_job ON events (job_id, seq);
CREATE INDEX IF NOT EXISTS events_unpublished ON events (published) WHERE published = 0;
-- Every worker process spawned and not yet stopped, for the start-up sweep of orphans.
CREATE TABLE IF NOT EXISTS workers (
    pid        INTEGER NOT NULL,
    start_time INTEGER NOT NULL,
    boot_id    TEXT NOT NULL,
    job_id     TEXT NOT NULL,
    attempt    INTEGER,
    local_rank INTEGER NOT NULL,
    PRIMARY KEY (pid, start_time)
);
-- When this node saw each finished job end, on its monotonic clock (elasticd.node.retention).
CREATE TABLE IF NOT EXISTS job_ends (
    job_id      TEXT PRIMARY KEY,
    finished_at REAL,
    boot_id     TEXT NOT NULL,
    seen_at     REAL NOT NULL
);
"""


@dataclass(frozen=True)
class WorkerRecord:
    """One spawned worker as the daemon's database remembers it."""

    pid: int
    start_time: int
    """Field 22 of ``/proc/<pid>/stat``: when the process started, in clock ticks since boot."""
    boot_id: str
    job_id: str
    attempt: int | None
    local_rank: int


class Database:
    """The daemon's SQLite file. Open with ``async with`` or ``open()``/``close()``."""

    def __init__(self, path: Path, health: StorageHealth | None = None) -> None:
        self.path = path
        self._conn: sqlite3.Connection | None = None
        self.health = health if health is not None else StorageHealth()
        #: Writes the disk refused, in order, retried until they land.
        self.backlog = WriteBacklog(f"state file {path}", self.health)

    def open(self) -> Self:
        make_private_dir(self.path.parent)
        create_private_file(self.path)  # born 0600, and so are its -wal and -shm files
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("PRAGMA busy_timeout=5000")
        conn.executescript(SCHEMA)
        self._conn = conn
        return self

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    @property
    def is_open(self) -> bool:
        return self._conn is not None

    async def __aenter__(self) -> Self:
        return self.open()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def conn(self) -> sqlite3.Connection:
        if self._conn is None:
            raise RuntimeError("database is not open")
        return self._conn

    def append_event(self, event: Event) -> Event:
        """Persist an event; the database assigns its (local) seq."""
        cur = self.conn.execute(
            "INSERT INTO events (job_id, doc) VALUES (?, ?)",
            (event.job_id, event.model_dump_json()),
        )
        assert cur.lastrowid is not None
        return event.model_copy(update={"seq": cur.lastrowid})

    def submit_event(self, event: Event, landed: Callable[[Event], None]) -> bool:
        """Persist ``event`` now or, when the disk refuses, as soon as it can (in order).

        ``landed(stored)`` is called with the event and its seq once it is on
        disk; True when that happened before returning.
        """
        return self.backlog.submit(lambda: self.append_event(event), landed, tag=event.job_id)

    def list_events(self, job_id: str, after: int, limit: int) -> list[Event]:
        rows = self.conn.execute(
            "SELECT seq, doc FROM events WHERE job_id = ? AND seq > ? ORDER BY seq LIMIT ?",
            (job_id, after, limit),
        ).fetchall()
        return [Event.model_validate_json(doc).model_copy(update={"seq": seq}) for seq, doc in rows]

    def jobs_quiet_since(self, before: float) -> list[str]:
        """Jobs with local events, none of them newer than ``before`` (wall time)."""
        rows = self.conn.execute(
            "SELECT job_id FROM events GROUP BY job_id HAVING MAX(json_extract(doc, '$.time')) < ?",
            (before,),
        ).fetchall()
        return [job_id for (job_id,) in rows]

    def delete_events(self, job_id: str) -> None:
        """Drop a job's events (queued behind unwritten ones when the disk refuses)."""
        self.backlog.submit(
            lambda: self.conn.execute("DELETE FROM events WHERE job_id = ?", (job_id,)), _ignore
        )

    def unpublished_events(self) -> list[Event]:
        rows = self.conn.execute(
            "SELECT seq, doc FROM events WHERE published = 0 ORDER BY seq"
        ).fetchall()
        return [Event.model_validate_json(doc).model_copy(update={"seq": seq}) for seq, doc in rows]

    def mark_published(self, seqs: Iterable[int]) -> None:
        seqs = list(seqs)
        if seqs:
            self.conn.executemany(
                "UPDATE events SET published = 1 WHERE seq = ?", [(s,) for s in seqs]
            )

    # when finished jobs were seen to end (elasticd.node.retention)

    def record_job_end(self, job_id: str, end: EndSeen) -> None:
        """Remember when this node saw ``job_id`` end (queued if the disk refuses)."""
        self.backlog.submit(
            lambda: self.conn.execute(
                "INSERT OR REPLACE INTO job_ends (job_id, finished_at, boot_id, seen_at)"
                " VALUES (?, ?, ?, ?)",
                (job_id, end.finished_at, end.boot_id, end.at),
            ),
            _ignore,
        )

    def forget_job_end(self, job_id: str) -> None:
        self.backlog.submit(
            lambda: self.conn.execute("DELETE FROM job_ends WHERE job_id = ?", (job_id,)), _ignore
        )

    def job_ends(self) -> dict[str, EndSeen]:
        rows = self.conn.execute(
            "SELECT job_id, finished_at, boot_id, seen_at FROM job_ends"
        ).fetchall()
        return {job_id: EndSeen(finished, boot, at) for job_id, finished, boot, at in rows}

    # spawned workers (elasticd.supervise.spawn: the start-up sweep of orphans)

    def record_worker(self, record: WorkerRecord) -> None:
        """Remember a spawned worker until its group is stopped (queued if the disk refuses)."""
        self.backlog.submit(lambda: self._record_worker(record), _ignore, keep=True)

    def _record_worker(self, record: WorkerRecord) -> None:
        self.conn.execute(
            "INSERT OR REPLACE INTO workers (pid, start_time, boot_id, job_id, attempt, local_rank)"
            " VALUES (?, ?, ?, ?, ?, ?)",
            (
                record.pid,
                record.start_time,
                record.boot_id,
                record.job_id,
                record.attempt,
                record.local_rank,
            ),
        )

    def forget_workers(self, pids: Iterable[tuple[int, int]]) -> None:
        """Forget workers by (pid, start time): their process groups are gone."""
        rows = [tuple(p) for p in pids]
        self.backlog.submit(
            lambda: self.conn.executemany(
                "DELETE FROM workers WHERE pid = ? AND start_time = ?", rows
            ),
            _ignore,
            keep=True,
        )

    def recorded_workers(self) -> list[WorkerRecord]:
        rows = self.conn.execute(
            "SELECT pid, start_time, boot_id, job_id, attempt, local_rank FROM workers"
        ).fetchall()
        return [WorkerRecord(*row) for row in rows]


def _ignore(_: object) -> None:
    """The result of a write nobody waits for."""
