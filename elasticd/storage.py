"""Local storage faults: what the daemon does when its own disk is full or failing.

Runs in the daemon, on the daemon's side of the trust boundary: nothing here
opens a path; it only classifies errors the writers hit and keeps the facts.

A daemon writes three kinds of things to its local disk: its event log
(``elasticd.sqlite3``, :mod:`elasticd.node.events`), the embedded store's journal
(``store.sqlite3``: job documents, state transitions, group views,
:mod:`elasticd.store.embedded`) and the workers' log files
(:mod:`elasticd.supervise.output`). A full disk (``ENOSPC``, SQLite's
"database or disk is full") or an I/O error there is a *storage fault*, and
the rules are:

* **A write failure never kills anyone.** No writer raises a storage fault
  into an agent or a route that did not ask for the write's result. The
  event log keeps the events it could not write in a bounded, ordered
  in-memory backlog (:class:`WriteBacklog`) and a writer task retries with
  backoff until they land, in order; later events queue behind them, so the
  order a job's events were emitted in is the order they land in. The
  embedded store keeps its unwritten changes in memory, retries the commit
  with backoff and acknowledges a write only once it is on disk.
* **The fact is reported.** :class:`StorageHealth` holds one "degraded since
  T, reason" fact per source (the event log, the store journal, each log
  file that is dropping output). ``/readyz`` answers 503 with the oldest
  one (``Daemon.not_ready_reason``); ``/healthz`` still means "the process
  is alive". A new job is refused with 507 while the state disk is
  degraded (:class:`~elasticd.errors.StorageFull`): its submission could not
  be made durable, so it is not acknowledged at all.
* **Recovery needs no restart.** The first write that lands clears its
  source's fact; the daemon is ready again once every source is clear.

Decisions are pure (:func:`is_storage_fault`, :func:`next_backoff`); the
backlog's retry loop is a thin task around them.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import logging
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from elasticd.clock import SYSTEM_CLOCK, Clock
from elasticd.tasks import TaskSet

#: Pages of a SQLite write-ahead log between two automatic checkpoints (SQLite's
#: default, 1,000 pages, let each WAL reach about 4 MB).
WAL_CHECKPOINT_PAGES = 256
#: What a WAL file is cut back to after a checkpoint: without it the file stays at
#: its high-water mark (issue 34: the store's file and WAL reached 6.8 MB in a soak).
WAL_SIZE_LIMIT = 1 << 20


def bound_wal(conn: sqlite3.Connection) -> None:
    """Bound the connection's WAL file: checkpoint every :data:`WAL_CHECKPOINT_PAGES`
    pages, truncate to :data:`WAL_SIZE_LIMIT` bytes after (the daemon's two databases)."""
    conn.execute(f"PRAGMA wal_autocheckpoint={WAL_CHECKPOINT_PAGES}")
    conn.execute(f"PRAGMA journal_size_limit={WAL_SIZE_LIMIT}")


log = logging.getLogger("elasticd.storage")

#: errno values that mean "the disk cannot take this write now".
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.EFBIG})

#: SQLite primary result codes that mean the same (SQLITE_IOERR, SQLITE_FULL, SQLITE_CANTOPEN).
SQLITE_DISK_CODES = frozenset({10, 13, 14})

#: The most events the event log keeps in memory while it cannot write them.
#: ~1 KiB each; past it, new events are counted and dropped (one
#: ``events.dropped`` event says how many once writing works again).
BACKLOG_LIMIT = 20_000

BACKOFF_FIRST = 0.05
BACKOFF_MAX = 2.0


def is_storage_fault(exc: BaseException) -> bool:
    """True when ``exc`` says the local disk cannot take a write now (full, I/O error)."""
    if isinstance(exc, sqlite3.OperationalError | sqlite3.DatabaseError):
        code = getattr(exc, "sqlite_errorcode", None)
        if code is not None:
            return (code & 0xFF) in SQLITE_DISK_CODES
        text = str(exc).lower()
        return "disk" in text or "full" in text or "i/o" in text
    if isinstance(exc, OSError):
        return exc.errno in DISK_ERRNOS
    return False


def describe(exc: BaseException) -> str:
    """A short reason for ``/readyz`` and the log: always names the disk."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return f"disk full ({exc.strerror})"
    text = str(exc)
    if "full" in text.lower():
        return f"disk full ({text})"
    return f"disk error ({text})"


def next_backoff(current: float) -> float:
    """The pause before the next retry: doubling from 50 ms, at most 2 s."""
    return min(max(current * 2, BACKOFF_FIRST), BACKOFF_MAX)


@dataclass(frozen=True)
class Degraded:
    """One source that cannot write: since when (wall time) and why."""

    source: str
    since: float
    reason: str


class StorageHealth:
    """The daemon's "storage degraded since T, reason" facts, one per source."""

    def __init__(self, clock: Clock = SYSTEM_CLOCK) -> None:
        self._clock = clock
        self._facts: dict[str, Degraded] = {}
        #: The state disk's current episode: the first fact of it (kept until all clear).
        self._episode: Degraded | None = None
        self._on_state_back: list[Callable[[Degraded, float], None]] = []

    def on_state_back(self, listener: Callable[[Degraded, float], None]) -> None:
        """Call ``listener(first_fact, seconds)`` when the state disk takes writes again."""
        self._on_state_back.append(listener)

    def failing(self, source: str, reason: str) -> None:
        """``source`` could not write; the first failure of an episode sets ``since``."""
        if source not in self._facts:
            log.error("storage degraded: %s: %s; retrying until it can write", source, reason)
            fact = Degraded(source, self._clock.time(), reason)
            self._facts[source] = fact
            if self._episode is None and not _is_log(source):
                self._episode = fact

    def ok(self, source: str, *, gone: bool = False) -> None:
        """``source`` wrote again, or (``gone``) no longer writes at all."""
        fact = self._facts.pop(source, None)
        if fact is not None:
            log.warning(
                "storage: %s %s after %.1f s",
                source,
                "is closed" if gone else "writes again",
                self._clock.time() - fact.since,
            )
        episode = self._episode
        if episode is not None and self.state_degraded() is None:
            self._episode = None
            for listener in self._on_state_back:
                try:
                    listener(episode, self._clock.time() - episode.since)
                except Exception:  # a listener must never break the writers
                    log.exception("storage listener failed")

    def is_failing(self, source: str) -> bool:
        return source in self._facts

    @property
    def degraded(self) -> list[Degraded]:
        return sorted(self._facts.values(), key=lambda d: d.since)

    def state_degraded(self) -> Degraded | None:
        """The oldest fault of the state disk (event log, store journal), if any."""
        state = [d for d in self.degraded if not _is_log(d.source)]
        return state[0] if state else None

    @property
    def reason(self) -> str | None:
        """For ``/readyz``: the oldest fact and how many more, None when all is well."""
        facts = self.degraded
        if not facts:
            return None
        first = facts[0]
        more = f" (and {len(facts) - 1} more)" if len(facts) > 1 else ""
        return f"storage degraded since {first.since:.0f}: {first.source}: {first.reason}{more}"


class WriteBacklog:
    """Ordered writes that could not be done yet, retried with backoff until they land.

    ``submit(write, landed)`` runs ``write()`` now when nothing is queued, and
    calls ``landed(result)``; when the write fails with a storage fault (or
    earlier writes are still queued) it is queued, in order, and a retry task
    runs the queue head first until it is empty. Any other exception from
    ``write`` propagates (a bug, not a disk fault). At :data:`BACKLOG_LIMIT`
    queued writes, new ones are dropped and counted (:attr:`dropped`).
    """

    def __init__(
        self,
        source: str,
        health: StorageHealth,
        *,
        limit: int = BACKLOG_LIMIT,
        on_drained: Callable[[dict[str, int]], None] | None = None,
    ) -> None:
        self.source = source
        self._health = health
        self._limit = limit
        self._queue: collections.deque[tuple[Callable[[], Any], Callable[[Any], None]]] = (
            collections.deque()
        )
        #: The retry loop while writes wait (one at a time), owned here and ended by stop.
        self._tasks = TaskSet(f"backlog-{source}")
        self._task: asyncio.Task[None] | None = None
        self._empty = asyncio.Event()
        self._empty.set()
        self.dropped: dict[str, int] = {}  # writes dropped past the limit, by tag (job id)
        self.on_drained = on_drained  # told what was dropped, once the backlog is written

    def __len__(self) -> int:
        return len(self._queue)

    def submit(
        self,
        write: Callable[[], Any],
        landed: Callable[[Any], None],
        *,
        tag: str = "",
        keep: bool = False,
    ) -> bool:
        """Write now if possible; True when it landed now, False when it was queued or dropped.

        Past the limit a write is dropped and counted under ``tag`` (reported
        through ``on_drained`` once the backlog is written), unless ``keep``:
        writes the daemon's safety depends on (the worker table, read by the
        orphan sweep) are small and few, and always queued.
        """
        if not self._queue:
            try:
                result = write()
            except Exception as exc:
                if not is_storage_fault(exc):
                    raise
                self._health.failing(self.source, describe(exc))
            else:
                landed(result)
                return True
        if len(self._queue) >= self._limit and not keep:
            self.dropped[tag] = self.dropped.get(tag, 0) + 1
            return False
        self._queue.append((write, landed))
        self._empty.clear()
        if self._task is None:
            self._task = self._tasks.spawn(self._retry(), name=f"backlog-{self.source}")
        return False

    async def wait_empty(self) -> None:
        await self._empty.wait()

    async def _retry(self) -> None:
        delay = BACKOFF_FIRST
        try:
            while self._queue:
                await asyncio.sleep(delay)
                while self._queue:
                    write, landed = self._queue[0]
                    try:
                        result = write()
                    except Exception as exc:
                        if not is_storage_fault(exc):
                            # Not a disk fault: this write can never land. Say so, go on.
                            log.exception("%s: dropping a queued write that fails", self.source)
                            self._queue.popleft()
                            continue
                        self._health.failing(self.source, describe(exc))
                        delay = next_backoff(delay)
                        break
                    self._queue.popleft()
                    try:
                        landed(result)
                    except Exception:  # a callback must not stop the backlog
                        log.exception("%s: a landed write's callback failed", self.source)
                    delay = BACKOFF_FIRST
            self._health.ok(self.source)
            dropped, self.dropped = self.dropped, {}
            if dropped:
                log.error(
                    "%s: %d writes were dropped while it refused",
                    self.source,
                    sum(dropped.values()),
                )
                if self.on_drained is not None:
                    self.on_drained(dropped)
        finally:
            self._task = None
            if not self._queue:
                self._empty.set()

    async def stop(self) -> None:
        """Stop retrying (what is still queued is given up: the daemon is exiting)."""
        await self._tasks.aclose()
        self._task = None
        if self._queue:
            log.error("%s: %d writes could not be made before exit", self.source, len(self._queue))


def _is_log(source: str) -> bool:
    """A worker's log file (its loss is reported per attempt), not the daemon's state."""
    return source.startswith("log ")
