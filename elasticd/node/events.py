"""The event log: every thing that happens to a job, persisted, ordered, shared.

``emit`` writes the event to this daemon's SQLite before it returns (so an
event that an API call acknowledged is on disk), then a publisher task puts
it into the cluster store under ``ev/<job>/<node>/<local seq>``. The merged
view that the API serves reads the store and orders all nodes' events by
:func:`merge_key`: the store revision that created each event, then node,
then the node's own seq.

Each node's own order survives the merge because the publisher writes what
is queued as one :meth:`~elasticd.store.Store.put_batch` (one etcd txn: one
round trip, one revision, all or nothing) and sends the next batch only
after this one is written. So an event is never created at an earlier
revision than one emitted before it on the same node: events of one batch
share a revision (ties are broken by the node's seq), later batches get
later ones, and a failed batch is retried whole before anything newer.
(Puts sent concurrently, as before, were applied in whatever order etcd
received them, and an outage left holes that were filled later.) An event's
``seq`` in the merged view is ``revision * SEQ_STRIDE + its place among the
events created at that revision``: unique, increasing, and a cursor for
``after``.

Unpublished events (the store was unreachable, the daemon was killed) are
published again when the daemon starts, under the same key, so nothing is
lost and nothing is duplicated; a key that was written keeps its created
revision.

A full or failing disk never makes ``emit`` raise (:mod:`elasticd.storage`):
an event the database refuses waits in the database's ordered backlog, and
every later event queues behind it, so a job's events land (and are
published) in the order they were emitted, as soon as the disk takes them.
Until then ``emit`` returns the event with ``seq`` 0 and local followers see
it when it lands.

Followers wait on the store's watch (cluster view) or on a local
notification (``elasticd run``), never on a timer.

**Which job of its id.** An id can be deleted and taken again while events of
the old job are still on their way to the store (queued on a node cut off from
it), and they land under the id after the new job's document, where no sweep
takes them. So each event carries its job's ``incarnation_tag``
(:attr:`~elasticd.models.Event.job_tag`, stamped by its emitter), and every
read by id is given the tag of the job it reads and leaves out another job's
(:func:`of_job`); an event with no tag (an older daemon's) is kept.

**Retention** (issue 23: a crash-looping job wrote 16 events per restart,
forever). Per job, each node keeps the first ``first`` and the last ``last``
of its own events, and every failure (:func:`is_failure`: a worker that
failed, ``group.restarting``, ``job.state`` ``FAILED``, an event with a root
cause, and the fault kinds of :data:`KEPT_KINDS`) except the repeats of a
crash loop: a worker exit, restart or hang the same as the one of its kind
before it (:func:`failure_signature`: same rank, exit code, signal and root
cause) is counted in the marker, not kept. (Each kept event is in every
node's copy of the store, in memory for as long as the job is kept: a
thousand identical records of one crash cost the store megabytes and tell a
reader nothing the first one, the count and the last ones do not.) Every ``every`` new events
of a job, :func:`trim_events` (pure) decides what goes: the routine events
between the first and the last, as one ``events.trimmed`` marker written *in
place of the first of them* (same local seq, so the same store key, which
keeps its created revision: the merged ``seq`` of everything stays as it
was), the others deleted from SQLite and from the store. Later trims fold
into the same marker (its ``count`` grows, its span ``duration_s`` too). A
reader sees the failures in order, the marker where the gap starts, never a
silent hole; a follower that read past the gap keeps what it read. Only
published events are trimmed, so a deleted key is never published again.
"Per job" is per job of the id (:func:`trim_jobs`): a node may hold a deleted
job's events beside the new job's of its id, and each keeps its own first,
last and failures, under a marker tagged for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple, cast

from pydantic import ValidationError

from elasticd.clock import SYSTEM_CLOCK, Clock
from elasticd.errors import StoreCompacted, StoreError
from elasticd.eventkinds import EventKind
from elasticd.keys import EVENTS, event_key, event_prefix
from elasticd.models import Event, EventSource, tagged_for
from elasticd.node.db import Database
from elasticd.storage import is_storage_fault
from elasticd.store import Store
from elasticd.store.base import MAX_BATCH_KEYS, Entry
from elasticd.tasks import TaskSet

log = logging.getLogger("elasticd.node.events")


#: Merged-view seqs per store revision: room for every event one batch can create.
SEQ_STRIDE = 1000

#: Most events, and most bytes of them, one publication batch holds (a store
#: batch has a size limit, and the embedded store's HTTP route a body limit).
PUBLISH_BATCH_EVENTS = MAX_BATCH_KEYS
PUBLISH_BATCH_BYTES = 256 * 1024


def _parsed(entry: Entry) -> Event | None:
    """The event a store entry holds; None (and a warning) when it is malformed."""
    try:
        return Event.model_validate_json(entry.value)
    except ValidationError:
        log.warning("ignoring malformed event %s", entry.key)
        return None


class ParsedEvents:
    """The events of the store's entries, parsed once per entry version (issue 40: a
    crash-looping job has hundreds, and every page of them, every follower's poll and
    every scrape read them all), for the :data:`PARSED_JOBS` jobs read last. What a job's
    entries no longer hold (trimmed, deleted) leaves its cache at its next read; the
    cached events are never mutated (a read copies each one it numbers)."""

    def __init__(self, jobs: int | None = None) -> None:
        self._jobs = PARSED_JOBS if jobs is None else jobs
        self._by_job: dict[str, dict[str, tuple[int, Event | None]]] = {}

    def of(self, job_id: str, entries: Iterable[Entry]) -> list[tuple[Entry, Event]]:
        """Each entry with its event (a malformed one left out, warned about once)."""
        known = self._by_job.pop(job_id, {})
        fresh: dict[str, tuple[int, Event | None]] = {}
        out: list[tuple[Entry, Event]] = []
        for entry in entries:
            cached = known.get(entry.key)
            if cached is not None and cached[0] == entry.version:
                event = cached[1]
            else:
                event = _parsed(entry)
            fresh[entry.key] = (entry.version, event)
            if event is not None:
                out.append((entry, event))
        self._by_job[job_id] = fresh  # the newest read last: the first is the oldest
        while len(self._by_job) > self._jobs:
            del self._by_job[next(iter(self._by_job))]
        return out

    def forget(self, job_id: str) -> None:
        self._by_job.pop(job_id, None)


def of_job(event: Event, tag: str | None) -> bool:
    """Whether ``event`` is about the job ``tag`` names (:attr:`Event.job_tag`; pure).

    A job id can be deleted and taken again (by another owner, maybe) while an
    event of the old job is still on its way to the store (queued on a node whose
    publisher is behind, or cut off from the store for a moment); that event is
    another job's and is never shown under the new one. An event with no tag (an
    older daemon's, in a mixed-version cluster, or a database from before tags) is
    kept: nothing says whose it is. ``tag`` None: every event of the id.
    """
    return tagged_for(event.job_tag, tag)


def published_key(event: Event) -> str:
    """Where a node publishes its event: under the job, its node, and its local seq."""
    return event_key(event.job_id, event.node, event.seq)


def merge_key(created: int, event: Event) -> tuple[int, str, int]:
    """The merged order: creating revision, then node, then the node's own (local) seq."""
    return (created, event.node, event.seq)


def merged_seqs(created: list[int]) -> list[int]:
    """Merged-view seqs of events sorted by :func:`merge_key`, from their created revisions.

    ``revision * SEQ_STRIDE + place among the events of that revision``:
    events of one batch share a revision, and a cursor must still tell them
    apart. A batch is written whole, so a reader sees all of a revision's
    events or none, and the places are stable.
    """
    seqs = []
    previous, place = -1, 0
    for revision in created:
        place = place + 1 if revision == previous else 0
        previous = revision
        seqs.append(revision * SEQ_STRIDE + min(place, SEQ_STRIDE - 1))
    return seqs


def publication_batches(events: list[Event]) -> list[list[Event]]:
    """Queued events as store batches, in order: each key once, bounded in count and bytes."""
    batches: list[list[Event]] = []
    current: list[Event] = []
    keys: set[str] = set()
    size = 0
    for event in events:
        key = published_key(event)
        if key in keys:  # queued twice (emitted before start() re-queued it): same value
            continue
        doc = len(event.record())
        if current and (len(current) >= PUBLISH_BATCH_EVENTS or size + doc > PUBLISH_BATCH_BYTES):
            batches.append(current)
            current, size = [], 0
        current.append(event)
        keys.add(key)
        size += doc
    if current:
        batches.append(current)
    return batches


@dataclass(frozen=True)
class EventRetention:
    """How many of its own events of one job a node keeps (every failure besides)."""

    first: int = 100
    last: int = 400
    #: Decide again after this many new events of a job (the work is amortised).
    every: int = 64
    #: A finished job keeps only its first ``finished_first`` and last ``finished_last``
    #: (every distinct failure besides): a job that ended is read for how it began and
    #: ended, and a node keeps finished jobs for ``job_retention`` (7 days).
    finished_first: int = 20
    finished_last: int = 50
    #: The events of finished jobs this node keeps in all; past it, the jobs that ended
    #: first keep only their last event and the marker (:func:`summarised_jobs`).
    finished_total: int = 2000
    #: Every failure unlike the one before it is kept (False: only first and last).
    keep_failures: bool = True

    def of_finished(self) -> EventRetention:
        """The policy of a finished job's events (never more than a running job's)."""
        return replace(
            self,
            first=min(self.first, self.finished_first),
            last=min(self.last, self.finished_last),
        )

    def of_summarised(self) -> EventRetention:
        """The policy of a finished job past ``finished_total``: its last event, a marker."""
        return replace(self, first=0, last=1, keep_failures=False)


def summarised_jobs(finished: Sequence[tuple[str, float, int]], total: int) -> set[str]:
    """Which finished jobs keep only their last event (pure): ``finished`` holds each
    finished job's id, when this node saw it end and how many of its events the node
    keeps now. The newest ends keep theirs while they add up to at most ``total``; the
    job that goes past it, and every one that ended before it, are summarised."""
    out: set[str] = set()
    kept = 0
    for job_id, _, count in sorted(finished, key=lambda f: (f[1], f[0]), reverse=True):
        kept += count
        if kept > total:
            out.add(job_id)
    return out


#: Kinds always kept: failures, faults, and what a reader needs to explain them.
KEPT_KINDS = frozenset(
    {
        EventKind.GROUP_RESTARTING,
        EventKind.AGENT_ERROR,
        EventKind.AGENT_CRASHED,
        EventKind.AGENT_FENCED,
        EventKind.STORE_LOST,
        EventKind.STORE_BACK,
        EventKind.STORAGE_BACK,
        EventKind.EVENTS_DROPPED,
        EventKind.LOGS_LOST,
        EventKind.DAEMON_STOPPED,
        EventKind.JOB_RESUMED,
        EventKind.JOB_REFUSED,
        EventKind.JOB_CANCEL_REQUESTED,
        EventKind.JOB_PREEMPTED,
        EventKind.RENDEZVOUS_FAILED,
        EventKind.WORKERS_SPAWN_FAILED,
        EventKind.WORKERS_STRAYS,
        EventKind.WORKER_HANG,
        EventKind.WORKER_STACKS,
        EventKind.WORKER_HEARTBEAT_REPLACED,
        EventKind.WORKER_HEALTH_CHECK_FAILED,
        EventKind.WORKER_ORPHAN_KILLED,
        EventKind.HEALTH_FAILED,
        EventKind.EXIT_BARRIER_TIMEOUT,
    }
)


def is_failure(kind: str, state: str | None, has_error: bool) -> bool:
    """Whether the retention policy always keeps an event (pure)."""
    if has_error or kind in KEPT_KINDS:
        return True
    if kind == EventKind.JOB_STATE:
        return state == "FAILED"
    if kind == EventKind.WORKER_EXITED:
        return state == "FAILED"  # a worker the agent stopped is not a failure
    return False


#: Failures that a crash loop repeats: one of these that is the same as the one of its
#: kind before it (:func:`failure_signature`) is counted, not kept.
REPEATABLE_KINDS = frozenset(
    {EventKind.WORKER_EXITED, EventKind.GROUP_RESTARTING, EventKind.WORKER_HANG}
)


def failure_signature(kind: str, *fields: object) -> tuple[object, ...] | None:
    """What makes a failure of a :data:`REPEATABLE_KINDS` kind the same as another (pure):
    its kind and ``fields`` (the rank, exit code, signal and root cause: never its pid,
    time or attempt, which every repeat changes). None for any other kind: never a repeat."""
    return (kind, *fields) if kind in REPEATABLE_KINDS else None


@dataclass(frozen=True)
class Retained:
    """One stored event as the retention decision sees it."""

    seq: int
    time: float
    failure: bool = False
    #: A failure's :func:`failure_signature` (None: not a failure a loop repeats).
    signature: tuple[object, ...] | None = None
    published: bool = True
    #: A marker (``events.trimmed``): how many events it stands for (0: not a marker).
    dropped: int = 0
    #: A marker: the time of the last event it stands for.
    until: float = 0.0


@dataclass(frozen=True)
class Trim:
    """What to do: delete these seqs, and (re)write ``marker`` at its seq."""

    delete: tuple[int, ...] = ()
    marker: Retained | None = None


def trim_events(events: Sequence[Retained], policy: EventRetention) -> Trim:
    """Which of one job's events (this node's, in seq order) go, and the marker in their place.

    The first ``policy.first`` and the last ``policy.last`` stay, and every
    unpublished event, and every failure unlike the failure of its kind before
    it (a crash loop's thousandth identical exit is counted, not kept: the
    first of each run of the same failure stays, as do the ones in the last
    ``policy.last``); the others between them (and an earlier marker) become
    one marker at the seq of the first of them. ``policy.keep_failures`` False:
    the failures between them go too.
    """
    n = len(events)
    if n <= policy.first + policy.last:
        return Trim()
    repeats = set()
    before: dict[object, tuple[object, ...]] = {}  # per kind: the last failure's signature
    for at, e in enumerate(events):
        if e.signature is None:
            continue
        if before.get(e.signature[0]) == e.signature:
            repeats.add(at)
        before[e.signature[0]] = e.signature
    middle = [(at, e) for at, e in enumerate(events) if policy.first <= at < n - policy.last]
    keep_failures = policy.keep_failures
    gone = [
        e
        for at, e in middle
        if (not e.failure or at in repeats or not keep_failures) and e.published
    ]
    if not any(e.dropped == 0 for e in gone):
        return Trim()  # nothing new: at most the marker of an earlier trim
    anchor = gone[0]
    count = sum(e.dropped or 1 for e in gone)
    until = max(max(e.until, e.time) for e in gone)
    marker = Retained(seq=anchor.seq, time=anchor.time, dropped=count, until=until)
    return Trim(delete=tuple(e.seq for e in gone[1:]), marker=marker)


def trim_jobs(
    views: Mapping[str | None, Sequence[Retained]], policy: EventRetention
) -> dict[str | None, Trim]:
    """:func:`trim_events` for each job of an id (pure): ``views`` holds a node's events
    of the id by :attr:`~elasticd.models.Event.job_tag`, each in seq order.

    A node may hold a deleted job's events beside those of the new job of its id: what
    its agent or the node said of it after the node saw the id taken again (a
    ``store.back``, a stop), or all of them while a trim read them as the id was seen
    taken (:meth:`EventLog.forget_others`). Each job keeps its own first and last, and
    its first failure of each kind: counted together, the new job's first events went
    as the old job's middle, its first failure as a repeat of the old job's, under the
    old job's marker, which the new job's reader never sees. Untagged events (from
    before tags) are one more job.
    """
    return {tag: trim_events(view, policy) for tag, view in views.items()}


#: Store keys of trimmed events deleted together (one commit of the embedded store).
UNPUBLISH_CHUNK = 64
#: Jobs whose parsed events a node keeps for its next merged read (:class:`ParsedEvents`).
PARSED_JOBS = 16


class _Merged(NamedTuple):
    """A merged read: the events shown, the store's revision it read at, and whether
    events of another job of the id were left out."""

    events: list[Event]
    revision: int
    others: bool


class EventLog:
    """Append-only, per-job ordered events with wake-ups for followers."""

    def __init__(
        self,
        db: Database,
        node: str,
        clock: Clock = SYSTEM_CLOCK,
        store: Store | None = None,
        retention: EventRetention | None = None,
    ) -> None:
        self._db = db
        db.backlog.on_drained = self._dropped
        self._node = node
        self._clock = clock
        self._store = store
        self._changed = asyncio.Event()
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        #: The publisher and the retention trimmer: started by start, ended by stop.
        self._tasks = TaskSet("events")
        self._publishing = False
        self._listeners: list[Any] = []
        #: Jobs told ``store.lost`` and not yet ``store.back``: job -> (monotonic time
        #: lost, the source that said it, which job of the id). Kept by the node, not the
        #: agent: an agent torn down during the outage (the plan dropped this node) cannot
        #: say it is back.
        self._store_lost: dict[str, tuple[float, EventSource, str | None]] = {}
        self._reopen_store_outages()
        self.retention = retention or EventRetention()
        self._since_trim: dict[str, int] = {}  # new events per job since its last trim
        self._to_trim: set[str] = set()
        self._trim_wake = asyncio.Event()
        self._trimming = False
        #: Store keys of trimmed events not deleted yet (the store was away), per job.
        self._unpublish: dict[str, list[str]] = {}
        #: Jobs forgotten so far (a trim that read a job's events meanwhile is dropped).
        self._forgets = 0
        #: Finished jobs (:meth:`job_ended`): job -> (when this node saw it end, on the
        #: monotonic clock; its events this node kept at its last trim).
        self._finished: dict[str, tuple[float, int]] = {}
        #: The finished jobs past ``finished_total`` (:func:`summarised_jobs`).
        self._summarised: set[str] = set()
        #: Merged reads parse only what changed since the last read of the job (issue 40).
        self._parsed = ParsedEvents()

    def add_listener(self, listener: Any) -> None:
        """Call ``listener(event)`` synchronously after every emit (metrics)."""
        self._listeners.append(listener)

    # writing

    def emit(
        self,
        job_id: str,
        source: EventSource,
        kind: EventKind,
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
            kind=kind.value,
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

    def _dropped(self, by_job: dict[str, int]) -> None:
        """The disk took writes again, but events were dropped past the backlog's bound: say so."""
        for job_id, count in sorted(by_job.items()):
            if job_id:
                self.emit(
                    job_id,
                    "daemon",
                    EventKind.EVENTS_DROPPED,
                    f"{count} events of this job on {self._node} were lost: the state disk "
                    "refused writes for longer than the in-memory backlog could hold",
                    count=count,
                )

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
        count = self._since_trim.get(stored.job_id, 0) + 1
        if count >= self.retention.every:
            count = 0
            self._to_trim.add(stored.job_id)
            self._trim_wake.set()
        self._since_trim[stored.job_id] = count

    # retention (see the module docstring)

    def job_ended(self, job_id: str, seen_at: float) -> None:
        """The job ended (this node saw it at ``seen_at``, monotonic): its events here are
        trimmed to the finished policy now (:meth:`EventRetention.of_finished`), and the
        finished jobs' events together to ``finished_total``."""
        if job_id in self._finished:
            return
        self._finished[job_id] = (seen_at, 0)
        self._since_trim.pop(job_id, None)  # no more counting: trimmed once now
        self._to_trim.add(job_id)
        self._trim_wake.set()

    def _policy_of(self, job_id: str) -> EventRetention:
        if job_id in self._summarised:
            return self.retention.of_summarised()
        if job_id in self._finished:
            return self.retention.of_finished()
        return self.retention

    def _kept(self, job_id: str, count: int) -> None:
        """After a trim of a finished job: ``count`` of its events stay here; the jobs past
        ``finished_total`` now are trimmed to their last event."""
        ended = self._finished.get(job_id)
        if ended is None:
            return
        self._finished[job_id] = (ended[0], count)
        over = summarised_jobs(
            [(j, at, n) for j, (at, n) in self._finished.items()], self.retention.finished_total
        )
        for job in over - self._summarised:
            self._to_trim.add(job)
            self._trim_wake.set()
        self._summarised = over

    async def trim(self, job_id: str) -> dict[str | None, Trim]:
        """Apply the retention policy to this node's events of ``job_id`` now (locally).

        Returns what was decided, for each job of the id (:attr:`Event.job_tag`); the
        store keys of the deleted events are deleted by the trimming task
        (:meth:`_unpublish_trimmed`), each marker is published like any event. The
        events are read off the event loop (:meth:`Database.retention_view`); a job
        forgotten meanwhile is left alone.
        """
        forgets = self._forgets
        rows = await self._db.retention_view(job_id)
        if self._forgets != forgets:
            return {}  # a job was forgotten while its events were read: decide again later
        views: dict[str | None, list[Retained]] = {}
        for seq, time, kind, state, has_error, published, count, span, tag, *failed in rows:
            failure = kind != EventKind.EVENTS_TRIMMED and is_failure(kind, state, bool(has_error))
            views.setdefault(tag, []).append(
                Retained(
                    seq=seq,
                    time=time,
                    failure=failure,
                    signature=failure_signature(kind, state, *failed) if failure else None,
                    published=bool(published),
                    dropped=int(count or 0) if kind == EventKind.EVENTS_TRIMMED else 0,
                    until=time + float(span or 0.0) if kind == EventKind.EVENTS_TRIMMED else 0.0,
                )
            )
        policy = self._policy_of(job_id)
        decisions = trim_jobs(views, policy)
        for tag, decision in decisions.items():
            if decision.marker is not None:
                self._apply_trim(job_id, tag, decision.delete, decision.marker, policy)
        self._kept(job_id, len(rows) - sum(len(d.delete) for d in decisions.values()))
        return decisions

    def _apply_trim(
        self,
        job_id: str,
        tag: str | None,
        delete: tuple[int, ...],
        m: Retained,
        policy: EventRetention,
    ) -> None:
        """Write the marker ``m`` of the job ``tag`` names in place of the events it stands
        for (deleted here, and from the store by the trimming task)."""
        marker = Event(
            seq=m.seq,
            time=m.time,
            job_id=job_id,
            node=self._node,
            source="daemon",
            kind=EventKind.EVENTS_TRIMMED.value,
            count=m.dropped,
            duration_s=max(0.0, m.until - m.time),
            job_tag=tag,  # said to that job's readers, of its own events only
            message=(
                f"{m.dropped} events of this job on {self._node} were dropped by the event "
                f"retention policy, over {max(0.0, m.until - m.time):.1f} s from here: routine "
                f"ones, and failures the same as the one of their kind before them (kept: the "
                f"first {policy.first}, the last {policy.last}"
                + (", every other failure)" if policy.keep_failures else ")")
            ),
        )
        self._db.apply_trim(job_id, delete, marker)
        if self._store is not None:
            self._queue.put_nowait(marker)  # same key as the event it replaces
            self._unpublish.setdefault(job_id, []).extend(
                event_key(job_id, self._node, seq) for seq in delete
            )

    async def _trim_loop(self) -> None:
        """Trim the jobs that got ``every`` new events, then delete their store keys."""
        while True:
            await self._trim_wake.wait()
            self._trim_wake.clear()
            jobs, self._to_trim = self._to_trim, set()
            for job_id in sorted(jobs):
                try:
                    await self.trim(job_id)
                except Exception as exc:  # never let retention take the event log down
                    if not is_storage_fault(exc):
                        log.exception("event retention of job %s failed", job_id)
            await self._unpublish_trimmed()

    async def _unpublish_trimmed(self) -> None:
        if self._store is None:
            return
        for job_id in list(self._unpublish):
            keys = self._unpublish[job_id]
            while keys:
                # A chunk at a time, together: the store commits them as one batch (one at
                # a time, a trim of a long crash loop fell behind its job's events).
                chunk = keys[-UNPUBLISH_CHUNK:]
                results = await asyncio.gather(
                    *(self._store.delete(key) for key in chunk), return_exceptions=True
                )
                del keys[-len(chunk) :]
                failed = [
                    key
                    for key, r in zip(chunk, results, strict=True)
                    if r is not True and r is not False
                ]
                for r in results:
                    if isinstance(r, BaseException) and not isinstance(r, StoreError):
                        keys.extend(failed)
                        raise r
                if failed:  # the store is away: next time
                    keys.extend(failed)
                    log.debug("event retention: %d deletes failed; next time", len(failed))
                    return
            del self._unpublish[job_id]

    async def start(self) -> None:
        """Publish what a previous run left unpublished, then keep publishing."""
        if not self._trimming:
            self._trimming = True
            self._tasks.spawn(self._trim_loop(), name="event-retention")
        if self._store is None:
            return
        # Events emitted before start() are queued already and are among the
        # unpublished ones: queue each once, oldest first, so that the store
        # creates them in this node's order.
        while not self._queue.empty():
            self._queue.get_nowait()
            self._queue.task_done()
        for event in self._db.unpublished_events():
            self._queue.put_nowait(event)
        self._publishing = self._tasks.spawn(self._publish(), name="event-publisher") is not None

    async def stop(self, timeout: float = 5.0) -> None:
        """Write and publish what is queued (bounded by ``timeout``), then stop."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._db.backlog.wait_empty()
                if self._publishing:
                    await self._queue.join()
        await self._db.backlog.stop()
        self._publishing = False
        await self._tasks.aclose()

    async def flush(self, timeout: float = 5.0) -> None:
        """Wait until every event emitted so far is in the store (bounded by ``timeout``)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._db.backlog.wait_empty()
                if self._publishing:
                    await self._queue.join()

    async def _publish(self) -> None:
        """Publish what is queued as store batches, one after the other, each whole or not at all.

        One batch is one round trip however many events it holds, and the
        next is sent only once this one is written, so the store creates a
        node's events in the node's own order (see the module docstring).
        """
        assert self._store is not None
        store = self._store
        backoff = 0.05
        while True:
            queued = [await self._queue.get()]
            while not self._queue.empty():
                queued.append(self._queue.get_nowait())
            for batch in publication_batches(queued):
                items = [(published_key(e), e.record().encode()) for e in batch]
                while True:
                    try:
                        await store.put_batch(items)
                    except Exception as exc:  # retried whole, before anything newer
                        if not isinstance(exc, StoreError):
                            log.error("publishing events failed unexpectedly: %r", exc)
                        log.warning("cannot publish %d events yet: %s", len(batch), exc)
                        await asyncio.sleep(backoff)  # retry with backoff while the store is away
                        backoff = min(backoff * 2, 1.0)
                        continue
                    backoff = 0.05
                    break
                try:
                    self._db.mark_published(e.seq for e in batch)
                except Exception as exc:
                    # They are in the store; unmarked, they are only published again
                    # (same keys) at the next start. Never let the publisher die of it.
                    if not is_storage_fault(exc):
                        log.exception("cannot mark %d events published", len(batch))
            for _ in queued:
                self._queue.task_done()

    # store outages: every store.lost of a job is followed by its store.back

    def store_lost(
        self, job_id: str, source: EventSource, message: str, tag: str | None = None
    ) -> bool:
        """Say ``store.lost`` for ``job_id``, once per outage; True when it was said now.
        ``tag``: which job of the id (:attr:`Event.job_tag`); its ``store.back`` says it too."""
        if job_id in self._store_lost:
            return False
        self._store_lost[job_id] = (self._clock.monotonic(), source, tag)
        self.emit(job_id, source, EventKind.STORE_LOST, message, job_tag=tag)
        return True

    def _reopen_store_outages(self) -> None:
        """Take up the outages a previous run of this daemon said ``store.lost`` for and
        stopped before it could say ``store.back`` (read from this node's own events: the
        database is the record, so nothing else needs keeping). Their duration is counted
        from the ``store.lost``'s wall time, the one clock both runs share."""
        if not self._db.is_open:
            return
        try:
            outages = self._db.open_store_outages()
        except sqlite3.Error as exc:  # a damaged row: no store.back owed is better than no daemon
            log.warning("cannot read the store outages of a previous run: %s", exc)
            return
        now_wall, now = self._clock.time(), self._clock.monotonic()
        for job_id, (lost_wall, source, tag) in outages.items():
            lost_at = now - max(0.0, now_wall - lost_wall)
            self._store_lost[job_id] = (lost_at, cast(EventSource, source), tag)
        if outages:
            log.info("store outages still open from a previous run: %s", ", ".join(outages))

    def store_back(self, job_id: str | None = None) -> list[str]:
        """The store answers again: ``store.back`` for ``job_id`` if it was told
        ``store.lost`` (``None``: for every job told it); the jobs told now.

        The agent says it when the store serves its rendezvous again; the node
        (its lease renewed: :class:`~elasticd.node.cluster.Cluster`) says it for
        every job still waiting, whether or not its agent still runs here.
        """
        jobs = list(self._store_lost) if job_id is None else [job_id]
        now = self._clock.monotonic()
        told = []
        for job in jobs:
            lost = self._store_lost.pop(job, None)
            if lost is None:
                continue
            lost_at, source, tag = lost
            self.emit(
                job,
                source,
                EventKind.STORE_BACK,
                f"{self._node} reaches the store again after {now - lost_at:.1f} s",
                duration_s=now - lost_at,
                job_tag=tag,
            )
            told.append(job)
        return told

    def store_lost_jobs(self) -> list[str]:
        """Jobs told ``store.lost`` and not yet ``store.back``."""
        return list(self._store_lost)

    def quiet_since(self, before: float) -> list[str]:
        """Jobs this node holds events of, the newest older than ``before``."""
        return self._db.jobs_quiet_since(before)

    def forget_others(self, job_id: str, tag: str) -> None:
        """The id names the job ``tag`` names now: drop this node's events of the jobs of
        the id before it (deleted; this node saw the id taken again between two looks,
        and no deletion in between to :meth:`forget` them for)."""
        self._forgets += 1
        self._db.delete_events_of_others(job_id, tag)
        self._finished.pop(job_id, None)  # the old job's end: the new one runs
        self._summarised.discard(job_id)

    def forget(self, job_id: str) -> None:
        """Drop this node's records of a deleted job."""
        self._forgets += 1
        self._parsed.forget(job_id)
        self._store_lost.pop(job_id, None)
        self._db.delete_events(job_id)
        self._since_trim.pop(job_id, None)
        self._unpublish.pop(job_id, None)
        self._finished.pop(job_id, None)
        self._summarised.discard(job_id)

    # reading: this node's own events

    def read(
        self, job_id: str, after: int = 0, limit: int = 1000, tag: str | None = None
    ) -> list[Event]:
        """This node's events of the job after ``after``; ``tag``: only the job it names
        (:func:`of_job`)."""
        return [e for e in self._db.list_events(job_id, after, limit) if of_job(e, tag)]

    async def follow(
        self, job_id: str, after: int, timeout: float, limit: int = 1000, tag: str | None = None
    ) -> list[Event]:
        """This node's events after ``after``; waits up to ``timeout`` for the first one.
        ``tag``: as for :meth:`read`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            changed = self._changed
            batch = self._db.list_events(job_id, after, limit)
            events = [e for e in batch if of_job(e, tag)]
            if batch and not events:  # only another job's: read on past them
                after = batch[-1].seq
                continue
            remaining = deadline - loop.time()
            if events or remaining <= 0:
                return events
            try:
                async with asyncio.timeout(remaining):
                    await changed.wait()
            except TimeoutError:
                return []

    # reading: every node's events, merged through the store

    async def cluster_events(
        self, job_id: str, after: int = 0, tag: str | None = None, limit: int | None = None
    ) -> list[Event]:
        """Every node's events of the job after ``after``, merged (the first ``limit``);
        ``tag``: only the job it names (:func:`of_job`: a job of the id deleted since has
        none of its events shown)."""
        return (await self._cluster_events(job_id, after, tag, limit)).events

    async def cluster_events_of(
        self, job_id: str, kinds: Collection[EventKind], tag: str | None = None
    ) -> list[Event]:
        """Every node's events of the job of these ``kinds``, in no set order and without
        their merged ``seq`` (for figures that need only kinds and times: the goodput).
        ``tag``: as for :meth:`cluster_events`.

        Only the entries whose stored JSON holds a kind's value (``"job.placed"``,
        quoted) are parsed; the parse then checks the kind. That is sound because a
        kind's value is dots and lowercase letters, which JSON never escapes. It
        spares the event loop :meth:`cluster_events`' parse and renumbering of all of
        a job's events: under a crash loop those are hundreds, and every ``/metrics``
        scrape reads the goodput of each job running here (3 ms and more a scrape).
        """
        if self._store is None:
            return [e for e in self.read(job_id, tag=tag) if e.kind in kinds]
        needles = [f'"{kind.value}"'.encode() for kind in kinds]
        found: list[Event] = []
        for entry in (await self._store.list(event_prefix(job_id))).entries:
            if any(needle in entry.value for needle in needles):
                event = _parsed(entry)
                if event is not None and event.kind in kinds and of_job(event, tag):
                    found.append(event)
        return found

    async def _cluster_events(
        self, job_id: str, after: int, tag: str | None, limit: int | None = None
    ) -> _Merged:
        """The merged read (the first ``limit`` events after ``after``: a page)."""
        if self._store is None:
            return _Merged(self.read(job_id, after, limit or 1000, tag=tag), 0, False)
        listing = await self._store.list(event_prefix(job_id))
        found = [
            (entry.created, event)
            for entry, event in self._parsed.of(job_id, listing.entries)
            # Whole revisions only: the cursor's revision may still hold later events.
            if entry.created >= after // SEQ_STRIDE
        ]
        found.sort(key=lambda pair: merge_key(*pair))
        # Numbered before another job's events are left out: every reader of the id
        # numbers each event alike, whichever job of it they read.
        seqs = merged_seqs([created for created, _ in found])
        events: list[Event] = []
        others = False
        for seq, (_, event) in zip(seqs, found, strict=True):
            if seq <= after:
                continue
            if not of_job(event, tag):
                others = True
            elif limit is None or len(events) < limit:
                events.append(event.model_copy(update={"seq": seq}))
            else:
                break  # the page is full
        return _Merged(events, listing.revision, others)

    async def cluster_page(
        self, job_id: str, after: int, tag: str | None, limit: int | None
    ) -> tuple[list[Event], int]:
        """:meth:`cluster_events`, and the store revision it read at (0: no store)."""
        merged = await self._cluster_events(job_id, after, tag, limit)
        return merged.events, merged.revision

    async def wait_for_events(self, prefix: str, revision: int, timeout: float) -> bool:
        """Wait up to ``timeout`` for a change under ``ev/<prefix>`` after ``revision``
        (any job whose id starts with ``prefix``); False at once without a store."""
        if self._store is None:
            return False
        with contextlib.suppress(StoreCompacted):
            await self._store.watch(EVENTS + prefix, revision, timeout, prefix=True)
        return True

    async def follow_cluster(
        self,
        job_id: str,
        after: int,
        timeout: float,
        tag: str | None = None,
        still: Callable[[], Awaitable[None]] | None = None,
    ) -> list[Event]:
        """Merged events after ``after``, waiting up to ``timeout`` for the first one;
        ``tag``: as for :meth:`cluster_events`. Another job's events do not end the wait:
        ``still()`` is called then, and raises to end it when the id no longer names
        the job followed (the new job's events: the reader's job is gone); it returns
        when they are a late earlier job's, and the wait goes on."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            events, revision, others = await self._cluster_events(job_id, after, tag)
            remaining = deadline - loop.time()
            if events or remaining <= 0 or self._store is None:
                return events
            if others and still is not None:
                await still()
            # Watch from what was just read: a re-published event (same key, same
            # created revision) must not wake this loop over and over.
            with contextlib.suppress(StoreCompacted):
                await self._store.watch(event_prefix(job_id), revision, remaining, prefix=True)
