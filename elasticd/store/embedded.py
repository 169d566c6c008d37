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
  *Only* what it saw: a read of a key (or a prefix) waits for the commit of
  the latest change to that key (or under that prefix) if it is not durable
  yet, and answers at once otherwise, however many other keys' changes wait
  for the disk (issue 27: under a crash loop the store is written all the
  time, and every API read used to wait for one or two commits, each an ``fsync``).
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
* **A full or failing disk is waited out, not fatal** (:mod:`elasticd.storage`).
  When a commit fails with a disk fault (SQLite's "database or disk is
  full", an I/O error), the batch goes back in front of the queue, in order,
  and the flusher retries it with backoff (50 ms doubling to 2 s) until it
  lands; :attr:`EmbeddedStore.health` says "degraded since T" meanwhile
  (``/readyz`` reports it). Writes are still acknowledged only once on disk,
  so a writer waits until the disk takes its change; watchers see nothing
  new meanwhile. Reads answer from memory at once while the disk refuses
  (the API and the agents keep working; what a read shows is at worst a
  change not yet on disk, which a crash of the daemon before the disk frees
  would lose, and no writer has been told it succeeded). When the store is
  closed while the disk still refuses, the flusher gives up after
  :data:`CLOSE_GRACE` seconds: those changes were never acknowledged. Any
  other SQLite error still stops the store (fail-stop).
* **Restart.** The revision is stored with every commit, so it only grows
  across restarts. Leases are kept too (table ``leases``: id and TTL, written
  in the same commits as the keys, a grant always before the keys bound to
  it): on open every lease gets a fresh grace of one TTL, counted from the
  store's first use, and keeps its keys. A holder whose keep-alives reach
  the restarted store within that grace carries on as if nothing happened;
  a holder that is gone loses its keys when the grace runs out, exactly as
  an expiry. Without this a restart of the store's host would make every
  other node look dead to it. Keys bound to a lease that has no row (a file
  written before leases were kept) get the same grace, with
  :data:`RESTORED_TTL`. The watch history starts empty after a restart, so
  a watch from before the restart raises ``StoreCompacted`` and the caller
  re-reads. While running, the history keeps only what watchers need
  (:mod:`elasticd.store.memory`: a few thousand changes, not 100,000).
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

from elasticd.errors import StoreUnavailable
from elasticd.security import create_private_file, make_private_dir
from elasticd.storage import (
    BACKOFF_FIRST,
    StorageHealth,
    bound_wal,
    describe,
    is_storage_fault,
    next_backoff,
)
from elasticd.store.base import DEFAULT_MAX_LIST_BYTES, DEFAULT_MAX_VALUE_BYTES, Entry, WatchEvent
from elasticd.store.memory import (
    DEFAULT_HISTORY,
    DEFAULT_HISTORY_BYTES,
    DEFAULT_HISTORY_KEEP,
    DEFAULT_HISTORY_MARGIN,
    MemoryStore,
    _Lease,
)
from elasticd.tasks import TaskSet

SCHEMA_VERSION = 2

#: Seconds a closing store keeps retrying a commit the disk refuses before giving up.
CLOSE_GRACE = 5.0

#: The grace, in seconds, of a restored lease whose TTL the file does not hold.
RESTORED_TTL = 10.0

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
CREATE TABLE IF NOT EXISTS leases (
    id  INTEGER PRIMARY KEY,
    ttl REAL NOT NULL
);
"""

_UPSERT = (
    "INSERT INTO kv (key, value, version, created, lease) VALUES (?, ?, ?, ?, ?) "
    "ON CONFLICT (key) DO UPDATE SET value = excluded.value, version = excluded.version, "
    "created = excluded.created, lease = excluded.lease"
)

Synchronous = Literal["FULL", "NORMAL"]


def read_target(undurable: Mapping[str, int], key: str, *, prefix: bool = False) -> int:
    """The revision a read of ``key`` (or of the keys under it) waits to be durable: that of
    the latest change it saw which is not durable yet; 0 when all it saw is (pure)."""
    if not prefix:
        return undurable.get(key, 0)
    return max((rev for k, rev in undurable.items() if k.startswith(key)), default=0)


class EmbeddedStore(MemoryStore):
    """A :class:`MemoryStore` whose every acknowledged change is in SQLite at ``path``.

    Opening reads the whole file into memory (the store holds cluster
    metadata, not bulk data) and restores the leases, each with a fresh grace.
    """

    def __init__(
        self,
        path: Path | str,
        *,
        synchronous: Synchronous = "FULL",
        max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
        max_list_bytes: int = DEFAULT_MAX_LIST_BYTES,
        history: int = DEFAULT_HISTORY,
        history_keep: float = DEFAULT_HISTORY_KEEP,
        history_margin: int = DEFAULT_HISTORY_MARGIN,
        history_bytes: int = DEFAULT_HISTORY_BYTES,
    ) -> None:
        super().__init__(
            max_value_bytes=max_value_bytes,
            max_list_bytes=max_list_bytes,
            history=history,
            history_keep=history_keep,
            history_margin=history_margin,
            history_bytes=history_bytes,
        )
        if synchronous not in ("FULL", "NORMAL"):
            raise ValueError(f"synchronous must be FULL or NORMAL, not {synchronous!r}")
        self.path = Path(path)
        self._unarmed: list[_Lease] = []
        self._db = self._open(self.path, synchronous)
        self._durable = self._revision
        self._pending: list[tuple[WatchEvent, Entry | None]] = []
        #: Key -> the revision of its latest change that is not durable yet.
        self._undurable: dict[str, int] = {}
        #: Lease grants (id, ttl) and ends (id, None) not yet committed.
        self._lease_ops: list[tuple[int, float | None]] = []
        self._settle_waiters: list[tuple[int, asyncio.Future[None]]] = []
        #: The commit loop while changes wait (one at a time); close lets it finish.
        self._tasks = TaskSet("embedded-store")
        self._flusher: asyncio.Task[Any] | None = None
        self._broken: StoreUnavailable | None = None
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="elasticd-store")
        #: Where a disk that refuses commits is reported (the daemon passes its own).
        self.health = StorageHealth()
        self._source = f"store journal {self.path}"
        self._give_up_at: float | None = None

    # -- opening -----------------------------------------------------------

    def _open(self, path: Path, synchronous: Synchronous) -> sqlite3.Connection:
        """Open (or create) the file, load every key and lease."""
        try:
            make_private_dir(path.parent)
            create_private_file(path)  # born 0600, and so are its -wal and -shm files
            db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        except (OSError, sqlite3.Error) as exc:
            raise StoreUnavailable(f"cannot open the store's state file {path}: {exc}") from exc
        try:
            mode = db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise StoreUnavailable(f"{path}: SQLite refused WAL mode (got {mode!r})")
            db.execute(f"PRAGMA synchronous={synchronous}")
            bound_wal(db)
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
            fix = ""
            if not isinstance(exc, sqlite3.OperationalError):  # the file's, not the disk's
                fix = "; the file is damaged: restore it from a backup"
            raise StoreUnavailable(
                f"cannot read the store's state file {path}: {exc}{fix}"
            ) from exc
        except BaseException:
            db.close()
            raise
        return db

    def _load(self, db: sqlite3.Connection) -> None:
        revision = int(db.execute("SELECT value FROM meta WHERE name = 'revision'").fetchone()[0])
        for lease_id, ttl in db.execute("SELECT id, ttl FROM leases"):
            self._leases[lease_id] = _Lease(id=lease_id, ttl=float(ttl))
        rows = db.execute("SELECT key, value, version, created, lease FROM kv")
        for key, value, version, created, lease in rows:
            if lease is not None and lease not in self._leases:
                self._leases[lease] = _Lease(id=lease, ttl=RESTORED_TTL)
                db.execute("INSERT INTO leases (id, ttl) VALUES (?, ?)", (lease, RESTORED_TTL))
            if lease is not None:
                self._leases[lease].keys.add(key)
            self._entries[key] = Entry(
                key=key, value=bytes(value), version=version, created=created, lease=lease
            )
        self._sorted = sorted(self._entries)
        # Their timers start at the first use (there may be no event loop yet).
        self._unarmed.extend(self._leases.values())
        self._revision = self._visible = self._compacted = revision

    # -- durability hooks --------------------------------------------------

    def _check_open(self) -> None:
        if self._broken is not None:
            raise self._broken
        super()._check_open()
        if self._unarmed:
            restored, self._unarmed = self._unarmed, []
            for lease in restored:
                if lease.id in self._leases:
                    self._arm(lease)  # a fresh grace of one TTL from now

    async def grant(self, ttl: float) -> int:
        lease = await super().grant(ttl)
        self._queue_lease(lease, float(ttl))
        return lease

    def _end_lease(self, lease_id: int) -> None:
        known = lease_id in self._leases
        super()._end_lease(lease_id)
        if known:
            self._queue_lease(lease_id, None)

    def _queue_lease(self, lease_id: int, ttl: float | None) -> None:
        self._lease_ops.append((lease_id, ttl))
        if self._flusher is None:
            self._flusher = self._tasks.spawn(self._flush(), name="store-commit")

    def _changed(self, event: WatchEvent, entry: Entry | None) -> None:
        self._pending.append((event, entry))
        self._undurable[event.key] = event.revision
        if self._flusher is None:
            self._flusher = self._tasks.spawn(self._flush(), name="store-commit")

    async def _settle(self) -> None:
        await self._settle_to(self._revision)

    async def _settle_to(self, target: int) -> None:
        """Until every change up to revision ``target`` is durable."""
        if self._broken is not None:
            raise self._broken
        if self._durable >= target:
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._settle_waiters.append((target, waiter))
        await waiter

    async def _settle_read(self, key: str, *, prefix: bool = False, revision: int = 0) -> int:
        # While the disk refuses commits, answer reads from memory (see the module docstring).
        if self.health.is_failing(self._source):
            if self._broken is not None:
                raise self._broken
            return revision
        await self._settle_to(read_target(self._undurable, key, prefix=prefix))
        # Every change under the prefix up to ``revision`` is durable now; later changes to
        # other keys may not be: the listing is the prefix's state at the durable revision
        # too, which is the one to report (a watch from it misses nothing after a crash).
        return min(revision, self._durable)

    async def _flush(self) -> None:
        """Commit queued changes, batch after batch, until none are left."""
        loop = asyncio.get_running_loop()
        delay = BACKOFF_FIRST
        try:
            while self._pending or self._lease_ops:
                batch, self._pending = self._pending, []
                leases, self._lease_ops = self._lease_ops, []
                top = batch[-1][0].revision if batch else self._durable
                try:
                    await loop.run_in_executor(self._writer, self._commit, batch, top, leases)
                except (sqlite3.Error, OSError) as exc:
                    giving_up = self._give_up_at is not None and loop.time() >= self._give_up_at
                    if not is_storage_fault(exc) or giving_up:
                        self._fail(exc)
                        return
                    # The disk refuses: keep the batch, in front of what came since, and retry.
                    self._pending = batch + self._pending
                    self._lease_ops = leases + self._lease_ops
                    self.health.failing(self._source, describe(exc))
                    await asyncio.sleep(delay)
                    delay = next_backoff(delay)
                    continue
                delay = BACKOFF_FIRST
                self.health.ok(self._source)
                self._durable = self._visible = top
                for event, _ in batch:
                    if self._undurable.get(event.key, top + 1) <= top:
                        del self._undurable[event.key]
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

    def _commit(
        self,
        batch: list[tuple[WatchEvent, Entry | None]],
        top: int,
        leases: list[tuple[int, float | None]],
    ) -> None:
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
            for lease_id, ttl in leases:  # in order: a lease may be granted and end in one batch
                if ttl is None:
                    db.execute("DELETE FROM leases WHERE id = ?", (lease_id,))
                else:
                    db.execute(
                        "INSERT OR REPLACE INTO leases (id, ttl) VALUES (?, ?)", (lease_id, ttl)
                    )
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
            "restart the daemon once the fault is fixed"
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
        self._give_up_at = asyncio.get_running_loop().time() + CLOSE_GRACE
        while self._flusher is not None:
            await asyncio.shield(self._flusher)
        await self._tasks.aclose()  # nothing left by now: no commit loop outlives the file
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._writer, self._db.close)
        self._writer.shutdown(wait=True)
