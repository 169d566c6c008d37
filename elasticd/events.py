"""The event log: every thing that happens to a job, persisted, ordered, shared.

``emit`` writes the event to this daemon's SQLite before it returns (so an
event that an API call acknowledged is on disk), then a publisher task puts
it into the cluster store under ``ev/<job>/<node>/<local seq>``. The merged
view that the API serves reads the store: an event's ``seq`` there is the
store revision of its publication, one order for all nodes' events.
Unpublished events (the store was unreachable, the daemon was killed) are
published again when the daemon starts, under the same key, so nothing is
lost and nothing is duplicated.

A full or failing disk never makes ``emit`` raise (:mod:`elasticd.storage`):
an event the database refuses waits in the database's ordered backlog, and
every later event queues behind it, so a job's events land (and are
published) in the order they were emitted, as soon as the disk takes them.
Until then ``emit`` returns the event with ``seq`` 0 and local followers see
it when it lands.

Followers wait on the store's watch (cluster view) or on a local
notification (``elasticd run``), never on a timer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from elasticd.clock import SYSTEM_CLOCK, Clock
from elasticd.db import Database
from elasticd.errors import StoreCompacted, StoreError
from elasticd.keys import event_key, event_prefix
from elasticd.models import Event, EventSource
from elasticd.storage import is_storage_fault
from elasticd.store import Store

log = logging.getLogger("elasticd.events")


class EventLog:
    """Append-only, per-job ordered events with wake-ups for followers."""

    def __init__(
        self, db: Database, node: str, clock: Clock = SYSTEM_CLOCK, store: Store | None = None
    ) -> None:
        self._db = db
        self._node = node
        self._clock = clock
        self._store = store
        self._changed = asyncio.Event()
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._publisher: asyncio.Task[None] | None = None
        self._listeners: list[Any] = []

    def add_listener(self, listener: Any) -> None:
        """Call ``listener(event)`` synchronously after every emit (metrics)."""
        self._listeners.append(listener)

    # writing

    def emit(
        self,
        job_id: str,
        source: EventSource,
        kind: str,
        message: str = "",
        **fields: Any,
    ) -> Event:
        """Record one event now (or, on a refusing disk, as soon as it can), queue it for the store.

        Never raises for a disk fault; the returned event has ``seq`` 0 when it
        is not on disk yet.
        """
        event = Event(
            seq=0,
            time=fields.pop("time", None) or self._clock.time(),
            job_id=job_id,
            node=fields.pop("node", None) or self._node,
            source=source,
            kind=kind,
            message=message,
            **fields,
        )
        log.info("job %s: %s %s", job_id, kind, message)
        landed: list[Event] = []
        self._db.submit_event(event, self._landed_into(landed))
        stored = landed[0] if landed else event
        for listener in self._listeners:
            try:
                listener(stored)
            except Exception:  # a listener must never break event recording
                log.exception("event listener failed")
        return stored

    def _landed_into(self, out: list[Event]) -> Callable[[Event], None]:
        def landed(stored: Event) -> None:
            out.append(stored)
            self._landed(stored)

        return landed

    def _landed(self, stored: Event) -> None:
        """An event is on disk: wake local followers, queue it for the store."""
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        if self._store is not None:
            self._queue.put_nowait(stored)

    async def start(self) -> None:
        """Publish what a previous run left unpublished, then keep publishing."""
        if self._store is None:
            return
        for event in self._db.unpublished_events():
            self._queue.put_nowait(event)
        self._publisher = asyncio.create_task(self._publish(), name="event-publisher")

    async def stop(self, timeout: float = 5.0) -> None:
        """Write and publish what is queued (bounded by ``timeout``), then stop."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._db.backlog.wait_empty()
                if self._publisher is not None:
                    await self._queue.join()
        await self._db.backlog.stop()
        if self._publisher is None:
            return
        self._publisher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._publisher
        self._publisher = None

    async def flush(self, timeout: float = 5.0) -> None:
        """Wait until every event emitted so far is in the store (bounded by ``timeout``)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._db.backlog.wait_empty()
                if self._publisher is not None:
                    await self._queue.join()

    async def _publish(self) -> None:
        """Publish in batches: everything queued goes out concurrently, one group commit."""
        assert self._store is not None
        store = self._store
        backoff = 0.05
        while True:
            batch = [await self._queue.get()]
            while not self._queue.empty():
                batch.append(self._queue.get_nowait())
            pending = batch
            while pending:
                results = await asyncio.gather(
                    *(
                        store.put(
                            event_key(e.job_id, e.node, e.seq),
                            e.model_dump_json().encode(),
                        )
                        for e in pending
                    ),
                    return_exceptions=True,
                )
                done = [
                    e
                    for e, r in zip(pending, results, strict=True)
                    if not isinstance(r, BaseException)
                ]
                try:
                    self._db.mark_published(e.seq for e in done)
                except Exception as exc:
                    # They are in the store; unmarked, they are only published again
                    # (same keys) at the next start. Never let the publisher die of it.
                    if not is_storage_fault(exc):
                        log.exception("cannot mark %d events published", len(done))
                pending = [e for e in pending if e not in done]
                if pending:
                    errors = [r for r in results if isinstance(r, BaseException)]
                    if any(not isinstance(r, StoreError) for r in errors):
                        log.error("publishing events failed unexpectedly: %r", errors[0])
                    log.warning("cannot publish %d events yet: %s", len(pending), errors[0])
                    await asyncio.sleep(backoff)  # retry with backoff while the store is away
                    backoff = min(backoff * 2, 1.0)
                else:
                    backoff = 0.05
            for _ in batch:
                self._queue.task_done()

    def quiet_since(self, before: float) -> list[str]:
        """Jobs this node holds events of, the newest older than ``before``."""
        return self._db.jobs_quiet_since(before)

    def forget(self, job_id: str) -> None:
        """Drop this node's records of a deleted job."""
        self._db.delete_events(job_id)

    # reading: this node's own events

    def read(self, job_id: str, after: int = 0, limit: int = 1000) -> list[Event]:
        return self._db.list_events(job_id, after, limit)

    async def follow(
        self, job_id: str, after: int, timeout: float, limit: int = 1000
    ) -> list[Event]:
        """This node's events after ``after``; waits up to ``timeout`` for the first one."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            changed = self._changed
            events = self.read(job_id, after, limit)
            remaining = deadline - loop.time()
            if events or remaining <= 0:
                return events
            try:
                async with asyncio.timeout(remaining):
                    await changed.wait()
            except TimeoutError:
                return []

    # reading: every node's events, merged through the store

    async def cluster_events(self, job_id: str, after: int = 0) -> list[Event]:
        return (await self._cluster_events(job_id, after))[0]

    async def _cluster_events(self, job_id: str, after: int) -> tuple[list[Event], int]:
        if self._store is None:
            return self.read(job_id, after), 0
        listing = await self._store.list(event_prefix(job_id))
        events = []
        for entry in listing.entries:
            if entry.created <= after:
                continue
            try:
                event = Event.model_validate_json(entry.value)
            except ValidationError:
                log.warning("ignoring malformed event %s", entry.key)
                continue
            events.append(event.model_copy(update={"seq": entry.created}))
        events.sort(key=lambda e: e.seq)
        return events, listing.revision

    async def follow_cluster(self, job_id: str, after: int, timeout: float) -> list[Event]:
        """Merged events after ``after``, waiting up to ``timeout`` for the first one."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            events, revision = await self._cluster_events(job_id, after)
            remaining = deadline - loop.time()
            if events or remaining <= 0 or self._store is None:
                return events
            # Watch from what was just read: a re-published event (same key, same
            # created revision) must not wake this loop over and over.
            with contextlib.suppress(StoreCompacted):
                await self._store.watch(event_prefix(job_id), revision, remaining, prefix=True)
