"""The event log: every thing that happens to a job, persisted and ordered.

``emit`` writes the event to SQLite (which assigns ``seq``) before it
returns, so an event that an API call acknowledged is on disk. Readers that
follow a job (the SSE stream, ``elasticd run``) wait on a notification, not
on a timer.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from elasticd.clock import SYSTEM_CLOCK, Clock
from elasticd.db import Database
from elasticd.models import Event, EventSource

log = logging.getLogger("elasticd.events")


class EventLog:
    """Append-only, per-job ordered events with wake-ups for followers."""

    def __init__(self, db: Database, node: str, clock: Clock = SYSTEM_CLOCK) -> None:
        self._db = db
        self._node = node
        self._clock = clock
        self._changed = asyncio.Event()

    def emit(
        self,
        job_id: str,
        source: EventSource,
        kind: str,
        message: str = "",
        **fields: Any,
    ) -> Event:
        """Record one event now and wake everyone following the log."""
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
        stored = self._db.append_event(event)
        log.info("job %s: %s %s", job_id, kind, message)
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        return stored

    def read(self, job_id: str, after: int = 0, limit: int = 1000) -> list[Event]:
        return self._db.list_events(job_id, after, limit)

    async def follow(
        self, job_id: str, after: int, timeout: float, limit: int = 1000
    ) -> list[Event]:
        """Events after ``after``; waits up to ``timeout`` for the first one."""
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
