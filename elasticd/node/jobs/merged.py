"""The events of a job of replica groups: its own and its groups', merged in one order.

A parent's events route (``GET /jobs/{parent}/events``, its SSE stream) shows
what happens to every group: each child job's events, in the merged order of
the store (``seq``, :mod:`elasticd.node.events`), each carrying the
``replica_group`` it is about (stamped here, as read). A group's failure and
restart are its own job's usual events.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from elasticd.models import Event
from elasticd.node.events import EventLog

__all__ = ["EventSource", "follow_merged", "merged_events", "page"]


@dataclass(frozen=True)
class EventSource:
    """One job whose events a merged read takes."""

    job_id: str
    tag: str | None = None
    replica_group: int | None = None


def page(parts: Sequence[tuple[list[Event], bool]], limit: int | None) -> list[Event]:
    """The first ``limit`` events of several jobs' reads, in ``seq`` order (pure).

    ``parts``: each job's events after the cursor, in order, and whether the read was
    cut at ``limit`` (it may have more). Past the lowest last ``seq`` of a cut read,
    nothing is known for sure, so nothing past it is given; and one ``seq`` is never
    split across pages (two jobs' events created at one store revision may share it),
    so a reader's ``after`` of the last one misses nothing.
    """
    events = sorted((e for part, _ in parts for e in part), key=lambda e: e.seq)
    cut_at = [part[-1].seq for part, cut in parts if cut and part]
    if cut_at:
        events = [e for e in events if e.seq <= min(cut_at)]
    if limit is not None and len(events) > limit:
        end = limit
        while 0 < end < len(events) and events[end].seq == events[end - 1].seq:
            end -= 1
        events = events[: end or limit]
    return events


async def merged_events(
    log: EventLog, sources: Sequence[EventSource], after: int = 0, limit: int | None = None
) -> tuple[list[Event], int]:
    """Every node's events of ``sources`` after ``after`` (:func:`page`), each with its
    source's ``replica_group``, and the lowest store revision read (a watch from it
    misses nothing)."""
    parts: list[tuple[list[Event], bool]] = []
    revisions = []
    for source in sources:
        events, revision = await log.cluster_page(source.job_id, after, source.tag, limit)
        revisions.append(revision)
        if source.replica_group is not None:
            events = [e.model_copy(update={"replica_group": source.replica_group}) for e in events]
        parts.append((events, limit is not None and len(events) >= limit))
    return page(parts, limit), min(revisions, default=0)


async def follow_merged(
    log: EventLog, sources: Sequence[EventSource], prefix: str, after: int, timeout: float
) -> list[Event]:
    """:func:`merged_events` after ``after``, waiting up to ``timeout`` for the first one;
    woken by a change under ``ev/<prefix>`` (the parent's id: its groups' start with it)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        events, revision = await merged_events(log, sources, after)
        remaining = deadline - loop.time()
        if events or remaining <= 0 or not await log.wait_for_events(prefix, revision, remaining):
            return events
