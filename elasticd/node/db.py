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

    def retention_view(
        self, job_id: str
    ) -> list[tuple[int, float, str, str | None, int, int, int | None, float | None]]:
        """What the retention decision needs of a job's events, in seq order: seq, time,
        kind, state, has a root cause, published, count, duration_s."""
        return self.conn.execute(
            "SELECT seq, json_extract(doc, '$.time'), json_extract(doc, '$.kind'), "
            "json_extract(doc, '$.state'), json_extract(doc, '$.error') IS NOT NULL, published, "
            "json_extract(doc, '$.count'), json_extract(doc, '$.duration_s') "
            "FROM events WHERE job_id = ? ORDER BY seq",
            (job_id,),
        ).fetchall()

    def apply_trim(self, job_id: str, delete: Iterable[int], marker: Event) -> None:
        """Delete trimmed events and write the marker in place of the first (one transaction;
        queued behind unwritten ones when the disk refuses). The marker is unpublished."""
        gone = [(job_id, seq) for seq in delete]
        doc = marker.model_copy(update={"seq": 0}).model_dump_json()

        def write() -> None:
            conn = self.conn
            conn.execute("BEGIN IMMEDIATE")
            try:
                conn.executemany("DELETE FROM events WHERE job_id = ? AND seq = ?", gone)
                conn.execute(
                    "UPDATE events SET doc = ?, published = 0 WHERE job_id = ? AND seq = ?",
                    (doc, job_id, marker.seq),
                )
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise

        self.backlog.submit(write, _ignore)

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
