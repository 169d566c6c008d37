"""SQLite persistence of jobs and events (WAL mode), under the daemon's state dir.

Writes happen on the event loop thread: each is a single small transaction
(well under a millisecond in WAL mode), which keeps ordering trivial and
avoids a thread hop on the exit-detection path. ``synchronous=NORMAL`` in WAL
mode survives a crash or SIGKILL of the daemon (the WAL is in the OS page
cache); only a power loss can drop the last transactions.

Rows hold JSON documents of the pydantic models in :mod:`elasticd.models`;
nothing is pickled.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import Self

from elasticd.models import Event, Job, WorkersView
from elasticd.states import JOB_ACTIVE, JobState

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id          TEXT PRIMARY KEY,
    created_at  REAL NOT NULL,
    state       TEXT NOT NULL,
    doc         TEXT NOT NULL,
    workers     TEXT
);
CREATE INDEX IF NOT EXISTS jobs_by_time ON jobs (created_at DESC);
CREATE INDEX IF NOT EXISTS jobs_by_state ON jobs (state, created_at DESC);
CREATE TABLE IF NOT EXISTS events (
    seq     INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id  TEXT NOT NULL,
    doc     TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_by_job ON events (job_id, seq);
"""


class Database:
    """The daemon's SQLite file. Open with ``async with`` or ``open()``/``close()``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._conn: sqlite3.Connection | None = None

    def open(self) -> Self:
        self.path.parent.mkdir(parents=True, exist_ok=True)
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

    # jobs

    def insert_job(self, job: Job) -> bool:
        """Insert a new job; False if the id exists already."""
        cur = self.conn.execute(
            "INSERT OR IGNORE INTO jobs (id, created_at, state, doc) VALUES (?, ?, ?, ?)",
            (job.id, job.created_at, job.state.value, job.model_dump_json()),
        )
        return cur.rowcount == 1

    def save_job(self, job: Job) -> None:
        self.conn.execute(
            "UPDATE jobs SET state = ?, doc = ? WHERE id = ?",
            (job.state.value, job.model_dump_json(), job.id),
        )

    def save_workers(self, job_id: str, view: WorkersView) -> None:
        self.conn.execute(
            "UPDATE jobs SET workers = ? WHERE id = ?", (view.model_dump_json(), job_id)
        )

    def get_job(self, job_id: str) -> Job | None:
        row = self.conn.execute("SELECT doc FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return Job.model_validate_json(row[0]) if row else None

    def get_workers(self, job_id: str) -> WorkersView | None:
        row = self.conn.execute("SELECT workers FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return WorkersView.model_validate_json(row[0]) if row and row[0] else None

    def list_jobs(
        self, states: Iterable[JobState] | None, limit: int, offset: int
    ) -> tuple[list[Job], int]:
        where, params = "", []
        if states is not None:
            wanted = [s.value for s in states]
            where = f"WHERE state IN ({','.join('?' * len(wanted))})"
            params = wanted
        total = self.conn.execute(f"SELECT count(*) FROM jobs {where}", params).fetchone()[0]
        rows = self.conn.execute(
            f"SELECT doc FROM jobs {where} ORDER BY created_at DESC, id LIMIT ? OFFSET ?",
            [*params, limit, offset],
        ).fetchall()
        return [Job.model_validate_json(r[0]) for r in rows], int(total)

    def active_jobs(self) -> list[Job]:
        jobs, _ = self.list_jobs(JOB_ACTIVE, limit=1_000_000, offset=0)
        return jobs

    # events

    def append_event(self, event: Event) -> Event:
        """Persist an event; the database assigns its seq."""
        doc = event.model_dump_json()  # seq is stored as the row id
        cur = self.conn.execute(
            "INSERT INTO events (job_id, doc) VALUES (?, ?)", (event.job_id, doc)
        )
        assert cur.lastrowid is not None
        return event.model_copy(update={"seq": cur.lastrowid})

    def list_events(self, job_id: str, after: int, limit: int) -> list[Event]:
        rows = self.conn.execute(
            "SELECT seq, doc FROM events WHERE job_id = ? AND seq > ? ORDER BY seq LIMIT ?",
            (job_id, after, limit),
        ).fetchall()
        return [Event.model_validate_json(doc).model_copy(update={"seq": seq}) for seq, doc in rows]
