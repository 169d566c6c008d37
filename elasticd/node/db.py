"""SQLite persistence of this daemon's events (WAL mode), under its state dir.

Jobs live in the cluster store (which, embedded, is SQLite too); this file
holds what this node itself recorded, first, so that an event is on disk
before anyone is told of it, and is published to the store afterwards.

Writes happen on the event loop thread: each is one small transaction (tens of
microseconds in WAL mode, measured under a crash loop: issue 27), which keeps
ordering trivial and avoids a thread hop on the exit-detection path. The one
long read, the retention trim's view of a job's events, runs in a thread on
a connection of its own (:meth:`Database.retention_view`). ``synchronous=NORMAL`` in WAL mode
survives a crash or SIGKILL of the daemon (the WAL is in the OS page cache);
only a power loss can drop the last transactions. Rows hold JSON documents
of :class:`elasticd.models.Event`; nothing is pickled.

A write the disk refuses (full, I/O error) never raises into the caller of
:meth:`Database.submit_event`, :meth:`Database.record_worker`,
:meth:`Database.forget_workers` or :meth:`Database.delete_events`: it waits,
in order, in the database's :class:`~elasticd.storage.WriteBacklog`, which
retries until it lands and keeps the "degraded" fact in
:attr:`Database.health` meanwhile (see :mod:`elasticd.storage`).

A damaged file (garbage in its header, a truncated file, a page that no
longer parses) is found when it is opened (SQLite's ``quick_check``, before
any event is read or written) and never becomes a traceback or a crash loop:
by default (``on_corrupt_database = "refuse"``) the daemon refuses to start
with :class:`~elasticd.errors.StateFileDamaged` (exit 2) naming the file and
the recovery; with ``"set_aside"`` the file (and its ``-wal``/``-shm``) is
renamed ``<name>.corrupt-<UTC time>``, never deleted, and the daemon starts
with an empty one (:attr:`Database.set_aside` says where it went). What is
lost then is this node's local copy of its events (those already published
are in the store) and its record of spawned workers (the cgroup sweep still
finds a previous run's processes).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self

from elasticd.errors import StateFileDamaged
from elasticd.models import Event
from elasticd.node.retention import EndSeen
from elasticd.security import create_private_file, make_private_dir
from elasticd.storage import StorageHealth, WriteBacklog, bound_wal
from elasticd.supervise.records import WorkerRecord

log = logging.getLogger("elasticd.node.db")

#: The ``on_corrupt_database`` config key: what a daemon does with a damaged database.
OnCorrupt = Literal["refuse", "set_aside"]

#: The files of one SQLite database in WAL mode, by suffix.
_COMPANIONS = ("", "-wal", "-shm")

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


def set_aside_name(path: Path, now: float, taken: Callable[[Path], bool]) -> Path:
    """Where a damaged database goes: ``<name>.corrupt-<UTC time>`` beside it (pure).

    ``taken(candidate)`` says whether a name is in use (one of its files
    exists); a second damaged file in the same second gets ``.1``, ``.2``, ...
    """
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
    base = path.with_name(f"{path.name}.corrupt-{stamp}")
    candidate, n = base, 0
    while taken(candidate):
        n += 1
        candidate = base.with_name(f"{base.name}.{n}")
    return candidate


def damaged_message(path: Path, why: str) -> str:
    """The one line a daemon refusing a damaged database prints (pure)."""
    return (
        f"the daemon's database {path} is damaged ({why}); restore it from a backup, or move "
        f"it aside (mv {path} {path}.bad) to start with an empty one: it holds this node's "
        f"event log and its record of running workers, the jobs are in the store; or set "
        f'on_corrupt_database = "set_aside" and the daemon does that itself'
    )


class Database:
    """The daemon's SQLite file. Open with ``async with`` or ``open()``/``close()``."""

    def __init__(
        self,
        path: Path,
        health: StorageHealth | None = None,
        *,
        on_corrupt: OnCorrupt = "refuse",
        now: Callable[[], float] = time.time,
    ) -> None:
        self.path = path
        self._conn: sqlite3.Connection | None = None
        #: The retention trim's own connection, used in a thread (:meth:`retention_view`).
        self._reader: sqlite3.Connection | None = None
        self._reader_lock = threading.Lock()
        self.health = health if health is not None else StorageHealth()
        #: Writes the disk refused, in order, retried until they land.
        self.backlog = WriteBacklog(f"state file {path}", self.health)
        self.on_corrupt = on_corrupt
        self._now = now
        #: Where a damaged file was moved by ``open()`` (``on_corrupt = "set_aside"``).
        self.set_aside: Path | None = None
        #: Why it was: SQLite's words.
        self.damage: str | None = None

    def open(self) -> Self:
        """Open (or create) the file; a damaged one is refused or set aside (see the module)."""
        make_private_dir(self.path.parent)
        try:
            self._conn = self._connect()
        except sqlite3.DatabaseError as exc:
            if not _is_damage(exc):
                raise
            self.damage = str(exc)
            if self.on_corrupt != "set_aside":
                raise StateFileDamaged(damaged_message(self.path, str(exc))) from None
            self.set_aside = self._move_aside()
            log.warning(
                "the daemon's database %s was damaged (%s): moved to %s (kept, with its -wal "
                "and -shm); starting with an empty one: this node's earlier local events and "
                "its record of spawned workers are in the moved file",
                self.path,
                exc,
                self.set_aside,
            )
            self._conn = self._connect()
        return self

    def _connect(self) -> sqlite3.Connection:
        create_private_file(self.path)  # born 0600, and so are its -wal and -shm files
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        # A damaged row's bytes may not be UTF-8: read them as text that then fails to
        # parse (and is skipped), not as an error out of fetchall().
        conn.text_factory = lambda raw: raw.decode(errors="replace")
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            bound_wal(conn)
            conn.execute("PRAGMA busy_timeout=5000")
            # Every page of every table and index, before anything is read or written: a
            # damaged file is found here, not half-way through a start-up that already
            # emitted events (issue 23). Milliseconds for the bounded event log.
            problems = [row[0] for row in conn.execute("PRAGMA quick_check(5)")]
            if problems != ["ok"]:
                found = " ".join(" ".join(str(p).split()) for p in problems)  # one line
                raise sqlite3.DatabaseError(f"quick_check: {found}")
            conn.executescript(SCHEMA)
        except BaseException:
            conn.close()
            raise
        return conn

    def _move_aside(self) -> Path:
        """Rename the file and its companions to one new name each (never deleted)."""

        def taken(candidate: Path) -> bool:
            return any(Path(f"{candidate}{suffix}").exists() for suffix in _COMPANIONS)

        target = set_aside_name(self.path, self._now(), taken)
        for suffix in _COMPANIONS:
            try:
                os.rename(f"{self.path}{suffix}", f"{target}{suffix}")
            except FileNotFoundError:
                pass
        return target

    def close(self) -> None:
        with self._reader_lock:  # after a read in flight, if any
            if self._reader is not None:
                self._reader.close()
                self._reader = None
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
            (event.job_id, event.record()),
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
        return self._parse(rows)

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

    def delete_events_of_others(self, job_id: str, tag: str) -> None:
        """Drop the events of ``job_id`` tagged for another job of the id than ``tag`` (a
        deleted one); untagged ones stay. Queued as :meth:`delete_events` is."""
        self.backlog.submit(
            lambda: self.conn.execute(
                "DELETE FROM events WHERE job_id = ? AND json_extract(doc, '$.job_tag') != ?",
                (job_id, tag),
            ),
            _ignore,
        )

    async def retention_view(self, job_id: str) -> list[tuple[Any, ...]]:
        """What the retention decision needs of a job's events, in seq order: seq, time,
        kind, state, has a root cause, published, count, duration_s, then what tells one
        failure from another: rank, exit code, signal, and the root cause's rank, exit
        code, signal and message.

        Read in a thread, on a connection of its own (in WAL mode a reader and the
        writer never wait for each other): it reads and parses every event of the job,
        milliseconds the event loop is not held for (issue 27). It sees the events
        written before it started; later ones are left for the next trim.
        """
        return await asyncio.to_thread(self._read_retention_view, job_id)

    def _read_retention_view(self, job_id: str) -> list[tuple[Any, ...]]:
        with self._reader_lock:
            if self._reader is None:
                if self._conn is None:
                    raise RuntimeError("database is not open")
                self._reader = sqlite3.connect(
                    self.path, isolation_level=None, check_same_thread=False
                )
                self._reader.text_factory = self._conn.text_factory
                self._reader.execute("PRAGMA busy_timeout=5000")
            return self._reader.execute(
                "SELECT seq, json_extract(doc, '$.time'), json_extract(doc, '$.kind'), "
                "json_extract(doc, '$.state'), json_extract(doc, '$.error') IS NOT NULL, "
                "published, "
                "json_extract(doc, '$.count'), json_extract(doc, '$.duration_s'), "
                "json_extract(doc, '$.job_tag'), "
                "json_extract(doc, '$.rank'), json_extract(doc, '$.exit_code'), "
                "json_extract(doc, '$.signal'), json_extract(doc, '$.error.rank'), "
                "json_extract(doc, '$.error.exit_code'), json_extract(doc, '$.error.signal'), "
                "json_extract(doc, '$.error.message') "
                "FROM events WHERE job_id = ? ORDER BY seq",
                (job_id,),
            ).fetchall()

    def open_store_outages(self) -> dict[str, tuple[float, str, str | None]]:
        """Jobs whose last ``store.lost`` of this node has no ``store.back`` after it:
        job -> (wall time, source and job tag of the ``store.lost``). What a daemon that
        stopped during an outage still owes its jobs (:meth:`EventLog.store_back`)."""
        rows = self.conn.execute(
            "SELECT job_id, json_extract(doc, '$.kind'), json_extract(doc, '$.time'), "
            "json_extract(doc, '$.source'), json_extract(doc, '$.job_tag') FROM events "
            "WHERE json_extract(doc, '$.kind') IN ('store.lost', 'store.back') ORDER BY seq"
        ).fetchall()
        open_: dict[str, tuple[float, str, str | None]] = {}
        for job_id, kind, when, source, tag in rows:
            if kind == "store.lost":
                open_[job_id] = (float(when), str(source), None if tag is None else str(tag))
            else:
                open_.pop(job_id, None)
        return open_

    def apply_trim(self, job_id: str, delete: Iterable[int], marker: Event) -> None:
        """Delete trimmed events and write the marker in place of the first (one transaction;
        queued behind unwritten ones when the disk refuses). The marker is unpublished."""
        gone = [(job_id, seq) for seq in delete]
        doc = marker.model_copy(update={"seq": 0}).record()

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
        return self._parse(rows)

    def _parse(self, rows: Iterable[tuple[int, str]]) -> list[Event]:
        """The events of ``rows``; a row whose document no longer parses (bytes of a page
        changed where SQLite's structure check cannot see: inside a record) is skipped and
        logged, never a crash of whoever reads."""
        events = []
        for seq, doc in rows:
            try:
                events.append(Event.model_validate_json(doc).model_copy(update={"seq": seq}))
            except ValueError as exc:
                log.warning("%s: skipping event row %s, which is damaged: %s", self.path, seq, exc)
        return events

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


def _is_damage(exc: sqlite3.DatabaseError) -> bool:
    """A file that does not read as a database, as opposed to one that cannot be reached.

    ``OperationalError`` is locked, read-only, I/O or a full disk: those are
    the disk's or another process's, not the file's, and setting the file
    aside would lose a good database; they keep their own error.
    """
    return not isinstance(exc, sqlite3.OperationalError)
