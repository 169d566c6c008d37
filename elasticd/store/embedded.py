"""The embedded store: the in-memory store, made durable in one SQLite file.

A daemon serves this store at ``/store/...`` when no ``store_url`` is set.

Design:

* **Memory is the truth while running; SQLite is the journal.** Every
  operation runs on :class:`~elasticd.store.memory.MemoryStore`'s state on the
  event loop (so it stays atomic without locks). Each change is also queued
  for disk, and the operation returns only once its change is committed:
  :meth:`EmbeddedStore._settle` awaits the durable revision. Watchers are
  woken only after the commit, and a read waits until what it saw is
  committed, so no caller ever acts on a change that a crash could lose.
* **Group commit.** One writer thread commits whatever queued up while the
  previous commit ran, as one transaction (later writes to the same key in a
  batch replace earlier ones). Under load one fsync covers many writes, and
  the event loop never blocks on the disk.
* **WAL + ``synchronous=FULL`` (the default).** In WAL mode a commit appends to
  the write-ahead log, and FULL fsyncs the log at every commit. A ``kill -9``
  can only lose transactions that never committed, which were never
  acknowledged; an OS crash or power cut loses nothing acknowledged either.
  This matters because revisions are fencing tokens: a store that came back
  from a power cut at an older revision would hand out the same versions
  twice. ``synchronous="NORMAL"`` (no fsync per commit, still safe against a
  process crash, not against power loss) is available for throwaway state.
  SQLite never leaves a WAL database unreadable after a crash: an incomplete
  tail of the log is ignored on the next open.
* **Restart.** The revision is stored with every commit, so it only grows
  across restarts. Leases are not carried over: keys bound to a lease are
  deleted when the store opens (each delete a change, as an expiry would be),
  because the holder's keep-alives went to a process that no longer exists.
  The holder notices on its next keep-alive (``LeaseNotFound``) and
  re-registers. The watch history starts empty after a restart, so a watch
  from before the restart raises ``StoreCompacted`` and the caller re-reads.
"""

from __future__ import annotations

import asyncio
import sqlite3
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

from elasticd.errors import StoreUnavailable
from elasticd.store.base import DEFAULT_MAX_LIST_BYTES, DEFAULT_MAX_VALUE_BYTES, Entry, WatchEvent
from elasticd.store.memory import DEFAULT_HISTORY, MemoryStore

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (
    name  TEXT PRIMARY KEY,
    value INTEGER NOT NULL
);
INSERT OR IGNORE INTO meta (name, value) VALUES ('revision', 0);
CREATE TABLE IF NOT EXISTS kv (
    key     TEXT PRIMARY KEY,
    value   BLOB NOT NULL,
    version INTEGER NOT NULL,
    created INTEGER NOT NULL,
    lease   INTEGER
);
"""

_UPSERT = (
    "INSERT INTO kv (key, value, version, created, lease) VALUES (?, ?, ?, ?, ?) "
    "ON CONFLICT (key) DO UPDATE SET value = excluded.value, version = excluded.version, "
    "created = excluded.created, lease = excluded.lease"
)

Synchronous = Literal["FULL", "NORMAL"]


class EmbeddedStore(MemoryStore):
    """A :class:`MemoryStore` whose every acknowledged change is in SQLite at ``path``.

    Opening reads the whole file into memory (the store holds cluster
    metadata, not bulk data) and deletes the keys that were bound to leases.
    """

    def __init__(
        self,
        path: Path | str,
        *,
        synchronous: Synchronous = "FULL",
        max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
        max_list_bytes: int = DEFAULT_MAX_LIST_BYTES,
        history: int = DEFAULT_HISTORY,
    ) -> None:
        super().__init__(
            max_value_bytes=max_value_bytes, max_list_bytes=max_list_bytes, history=history
        )
        if synchronous not in ("FULL", "NORMAL"):
            raise ValueError(f"synchronous must be FULL or NORMAL, not {synchronous!r}")
        self.path = Path(path)
        self._db = self._open(self.path, synchronous)
        self._durable = self._revision
        self._pending: list[tuple[WatchEvent, Entry | None]] = []
        self._settle_waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._flusher: asyncio.Task[None] | None = None
        self._broken: StoreUnavailable | None = None
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="elasticd-store")

    # -- opening -----------------------------------------------------------

    def _open(self, path: Path, synchronous: Synchronous) -> sqlite3.Connection:
        """Open (or create) the file, load every key and drop the leased ones."""
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        except (OSError, sqlite3.Error) as exc:
            raise StoreUnavailable(f"cannot open the store's state file {path}: {exc}") from exc
        try:
            mode = db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise StoreUnavailable(f"{path}: SQLite refused WAL mode (got {mode!r})")
            db.execute(f"PRAGMA synchronous={synchronous}")
            found = db.execute("PRAGMA user_version").fetchone()[0]
            if found > SCHEMA_VERSION:
                raise StoreUnavailable(
                    f"{path} was written by a newer elasticd (schema {found}, "
                    f"this one reads {SCHEMA_VERSION})"
                )
            check = db.execute("PRAGMA quick_check").fetchone()[0]
            if check != "ok":
                raise StoreUnavailable(f"{path} is damaged ({check}); restore it from a backup")
            db.execute("BEGIN IMMEDIATE")
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    db.execute(statement)
            db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            self._load(db)
            db.execute("COMMIT")
        except sqlite3.Error as exc:
            db.close()
            raise StoreUnavailable(f"cannot read the store's state file {path}: {exc}") from exc
        except BaseException:
            db.close()
            raise
        return db

    def _load(self, db: sqlite3.Connection) -> None:
        revision = int(db.execute("SELECT value FROM meta WHERE name = 'revision'").fetchone()[0])
        leased: list[str] = []
        rows = db.execute("SELECT key, value, version, created, lease FROM kv")
        for key, value, version, created, lease in rows:
            if lease is not None:
                leased.append(key)
                continue
            self._entries[key] = Entry(
                key=key, value=bytes(value), version=version, created=created
            )
        # Leases do not survive a restart; their keys go, each as a change.
        for key in sorted(leased):
            revision += 1
            db.execute("DELETE FROM kv WHERE key = ?", (key,))
        db.execute("UPDATE meta SET value = ? WHERE name = 'revision'", (revision,))
        self._revision = self._visible = self._compacted = revision

    # -- durability hooks --------------------------------------------------

    def _check_open(self) -> None:
        if self._broken is not None:
            raise self._broken
        super()._check_open()

    def _changed(self, event: WatchEvent, entry: Entry | None) -> None:
        self._pending.append((event, entry))
        if self._flusher is None:
            self._flusher = asyncio.get_running_loop().create_task(self._flush())

    async def _settle(self) -> None:
        if self._broken is not None:
            raise self._broken
        target = self._revision
        if self._durable >= target:
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._settle_waiters.append((target, waiter))
        await waiter

    async def _flush(self) -> None:
        """Commit queued changes, batch after batch, until none are left."""
        loop = asyncio.get_running_loop()
        try:
            while self._pending:
                batch, self._pending = self._pending, []
                top = batch[-1][0].revision
                try:
                    await loop.run_in_executor(self._writer, self._commit, batch, top)
                except (sqlite3.Error, OSError) as exc:
                    self._fail(exc)
                    return
                self._durable = self._visible = top
                self._wake(event for event, _ in batch)
                still: list[tuple[int, asyncio.Future[None]]] = []
                for target, waiter in self._settle_waiters:
                    if target <= top:
                        if not waiter.done():
                            waiter.set_result(None)
                    else:
                        still.append((target, waiter))
                self._settle_waiters = still
        finally:
            self._flusher = None

    def _commit(self, batch: list[tuple[WatchEvent, Entry | None]], top: int) -> None:
        """Write one batch as one transaction (runs in the writer thread)."""
        last: dict[str, Entry | None] = {}
        for event, entry in batch:
            last[event.key] = entry
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            deleted = [(key,) for key, entry in last.items() if entry is None]
            written = [
                (e.key, e.value, e.version, e.created, e.lease)
                for e in last.values()
                if e is not None
            ]
            if deleted:
                db.executemany("DELETE FROM kv WHERE key = ?", deleted)
            if written:
                db.executemany(_UPSERT, written)
            db.execute("UPDATE meta SET value = ? WHERE name = 'revision'", (top,))
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise

    def _fail(self, exc: BaseException) -> None:
        """Stop serving: memory now holds changes the file does not (fail-stop)."""
        self._broken = StoreUnavailable(
            f"the store could not write its state file {self.path}: {exc}; "
            "restart the daemon once the disk is fixed"
        )
        for _, waiter in self._settle_waiters:
            if not waiter.done():
                waiter.set_exception(self._broken)
        self._settle_waiters = []

    # -- lifecycle ---------------------------------------------------------

    async def close(self) -> None:
        """Finish the pending commits, then close the file."""
        if self._closed:
            return
        await super().close()  # refuses new calls and stops the lease timers
        while self._flusher is not None:
            await asyncio.shield(self._flusher)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._writer, self._db.close)
        self._writer.shutdown(wait=True)
