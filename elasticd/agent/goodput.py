"""The agent's goodput hook: what this node sees of each attempt, kept in the store.

One record per job and node, ``gp/<job>/<node>`` (:func:`elasticd.keys.goodput_key`),
written by this node only (a put, through a coalescing
:class:`~elasticd.agent.publish.GroupPublisher`): each attempt's spawn,
first progress, first and highest step, checkpoints and end
(:class:`elasticd.goodput.AttemptFacts`). Any daemon joins the nodes'
records into the job's accounting (:mod:`elasticd.goodput`), so it survives
rank 0 moving to another node, and a daemon that restarts reads its record
back before it adds to it.

Its times are on a :class:`~elasticd.clock.SteadyWallClock` made with the hook
(issue 33): wall time as the clock read then, carried on by the monotonic
clock, so a step of the daemon's wall clock while the job runs (NTP
correcting it by an hour) moves no fact against another, and no interval
between them goes negative or jumps. The agent's wall stamps (a spawn, a
failure's detection) are placed on it by their age.

Volume is bounded: no write per step. While an attempt runs, the hook reads
the heartbeat files (the daemon's own descriptors, one ``pread`` each) every
:data:`FAST_SAMPLE_S` until the first progress, then every :data:`SAMPLE_S`;
a first progress, a first step, a checkpoint and an end are written at
once, a higher step at most every :data:`WRITE_EVERY_S`. The record holds at
most :data:`~elasticd.goodput.MAX_ATTEMPTS` attempts of at most
:data:`~elasticd.goodput.MAX_SAMPLES` step samples each.

Which side of the boundary: the daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Sequence

from pydantic import BaseModel, ValidationError

from elasticd.agent.publish import GroupPublisher
from elasticd.clock import Clock, SteadyWallClock
from elasticd.errors import ElasticdError
from elasticd.goodput import (
    MAX_ATTEMPTS,
    MAX_PAGES,
    PAGE_ATTEMPTS,
    AttemptFacts,
    End,
    NodeGoodput,
    Observation,
    begin_attempt,
    close_open,
    end_attempt,
    join_pages,
    observe,
    seal,
)
from elasticd.keys import goodput_key, goodput_page_key
from elasticd.models import tagged_for
from elasticd.store import Entry, Store
from elasticd.tasks import cancel_and_wait

__all__ = [
    "FAST_SAMPLE_S",
    "SAMPLE_S",
    "WRITE_EVERY_S",
    "GoodputHook",
    "end_of",
    "parse_record",
    "read_records",
]

log = logging.getLogger("elasticd.agent")

#: Seconds between heartbeat reads until the attempt's first progress.
FAST_SAMPLE_S = 0.2
#: Seconds between heartbeat reads after it.
SAMPLE_S = 1.0
#: Most frequent write of a record whose only news is a higher step.
WRITE_EVERY_S = 15.0

#: How the agent's recovery causes end an attempt (anything else: stopped).
_ENDS = {
    "worker failure": End.FAILED,
    "hang": End.HUNG,
    "a participant's lease expired": End.FAILED,  # a node was lost: the work since is lost
    "the rendezvous was closed": End.FINISHED,
}


def end_of(cause: str) -> End:
    """How a recovery's ``cause`` (``agent.machine``'s, a rendezvous change's) ends an attempt."""
    return _ENDS.get(cause, End.STOPPED)


def parse_record(raw: bytes, node: str, tag: str | None = None) -> NodeGoodput | None:
    """A stored record (untrusted: anyone with the cluster token writes the store) of
    ``node``, about the job ``tag`` names (an untagged one, an older daemon's, counts)."""
    try:
        record = NodeGoodput.model_validate_json(raw)
    except ValidationError:
        return None
    if record.node != node or not tagged_for(record.job_tag, tag):
        return None
    return record


def read_records(entries: Iterable[Entry], prefix: str, tag: str | None) -> dict[str, NodeGoodput]:
    """Every node's record of the job, its pages joined in, from a listing of ``prefix``
    (``gp/<job>/``); a record or page that is not this job's, or not its node's, is left
    out, and so is a page without its record (the record is what says the node ran it)."""
    records: dict[str, NodeGoodput] = {}
    pages: dict[str, list[NodeGoodput]] = {}
    for entry in entries:
        node, _, page = entry.key.removeprefix(prefix).partition("/")
        record = parse_record(entry.value, node, tag)
        if record is None:
            continue
        if not page:
            if record.page is None:
                records[node] = record
        elif record.page is not None and str(record.page) == page:
            pages.setdefault(node, []).append(record)
    return {node: join_pages(r, pages.get(node, ())) for node, r in records.items()}


def _compact(record: BaseModel) -> bytes:
    """The record without the fields at their defaults (a crash loop's attempt is its round,
    spawn and end: 80 bytes, not 240): it is rewritten at every attempt, up to
    MAX_ATTEMPTS of them, and each copy stays in the store's watch history for a while
    (issue 34: 62 KB records were most of its bytes). A reader fills the defaults in."""
    return record.model_dump_json(exclude_defaults=True).encode()


class GoodputHook:
    """This node's goodput facts of one job: sampled while an attempt runs, published."""

    def __init__(
        self,
        store: Store,
        job_id: str,
        node: str,
        clock: Clock,
        read: Callable[[Clock], Sequence[Observation]],
        tag: str | None = None,
    ) -> None:
        """``read``: the attempt's heartbeats now, in the given clock's wall time
        (``ProgressHook.observations``); ``tag``: which job of its id
        (:attr:`NodeGoodput.job_tag`)."""
        self._store, self._read = store, read
        self._clock = SteadyWallClock(clock)
        self._job_id, self._key = job_id, goodput_key(job_id, node)
        self._tail = NodeGoodput(node=node, job_tag=tag)
        """The stored record: the newest attempts (the open one among them)."""
        self._sealed: list[AttemptFacts] = []
        """The attempts of the pages this hook sealed or read back, oldest first."""
        self._publisher = GroupPublisher(store, self._key, lambda: self._tail, _compact)
        self._sampler: asyncio.Task[None] | None = None
        self._written_at = float("-inf")  # monotonic

    async def start(self) -> None:
        """Read back what this node recorded before (a daemon restart), then publish."""
        self._publisher.start(f"goodput-{self._key}")
        with contextlib.suppress(ElasticdError):
            entry = await self._store.get(self._key)
            if entry is not None and not self._tail.attempts:
                earlier = parse_record(entry.value, self._tail.node, self._tail.job_tag)
                if earlier is not None:  # this job's, not a deleted one's of the id
                    closed = [close_open(a) for a in earlier.attempts]
                    # Its attempts and pages, never its tag: the hook's is this job's (an
                    # untagged record, an older daemon's or planted, must not untag it).
                    update = {"attempts": closed, "job_tag": self._tail.job_tag}
                    self._tail = earlier.model_copy(update=update)
                    listing = await self._store.list(self._page_key())
                    node, tag = self._tail.node, self._tail.job_tag
                    pages = [parse_record(e.value, node, tag) for e in listing.entries]
                    self._sealed = join_pages(
                        self._tail.model_copy(update={"attempts": []}),
                        [p for p in pages if p is not None],
                    ).attempts

    def _page_key(self, page: int | None = None) -> str:
        return goodput_page_key(self._job_id, self._tail.node, page)

    @property
    def record(self) -> NodeGoodput:
        """This node's record of the job: its sealed pages' attempts and the newest ones."""
        if not self._sealed:
            return self._tail
        attempts = [*self._sealed, *self._tail.attempts][-MAX_ATTEMPTS:]
        return self._tail.model_copy(update={"attempts": attempts})

    def time(self) -> float:
        """Now, on the clock of this node's facts (an account of them is taken as of it)."""
        return self._clock.time()

    @property
    def current(self) -> AttemptFacts | None:
        attempts = self._tail.attempts
        return attempts[-1] if attempts and attempts[-1].end is None else None

    async def began(self, round_: int, spawned_at: float) -> None:
        """An attempt's workers run: record it and sample its heartbeats until it ends.
        ``spawned_at``: the daemon's wall clock, a moment ago."""
        await self._stop_sampler()
        self._tail = begin_attempt(self._tail, round_, self._clock.of_wall(spawned_at))
        await self._seal()
        self._publish()
        self._sampler = asyncio.create_task(self._sample(), name=f"goodput-sample-{self._key}")

    async def _seal(self) -> None:
        """Move the record's oldest page of ended attempts into a page of its own, written
        once, before the record without them (a reader that sees both counts them once);
        a store that refuses the page leaves them in the record until the next attempt."""
        rest, page = seal(self._tail)
        if page is None or page.page is None:
            return
        try:
            await self._store.put(self._page_key(page.page), _compact(page))
        except ElasticdError as exc:
            log.warning("cannot seal goodput page %s/%d: %s", self._key, page.page, exc)
            return
        self._tail = rest
        self._sealed = [*self._sealed, *page.attempts][-MAX_PAGES * PAGE_ATTEMPTS :]
        # The page that left the window one seal ago: the record that no longer counts it
        # has been written since (deleted at once, a reader of the record before would miss
        # it); one the store refused stays until the job is deleted.
        if (gone := page.page - MAX_PAGES - 1) >= 0:
            with contextlib.suppress(ElasticdError):
                await self._store.delete(self._page_key(gone))

    async def resumed(self, round_: int, spawned_at: float) -> None:
        """The daemon re-executed under a running attempt (issue 25): carry on with that
        attempt's facts (read back and closed as stopped by :meth:`start`), sampling again;
        a record without it (never written before the exec) begins it at ``spawned_at``."""
        await self._stop_sampler()
        attempts = self._tail.attempts
        last = attempts[-1] if attempts else None
        if last is not None and last.round == round_ and last.end is End.STOPPED:
            self._replace(last.model_copy(update={"end": None, "ended_at": None}))
        else:
            self._tail = begin_attempt(self._tail, round_, self._clock.of_wall(spawned_at))
        self._publish()
        self._sampler = asyncio.create_task(self._sample(), name=f"goodput-sample-{self._key}")

    def refresh(self) -> None:
        """Read the heartbeats now (an API read wants the freshest figures)."""
        self._observe(force=False)

    async def ended(self, end: End, at: float) -> None:
        """The attempt ended: a last read of its heartbeats (the exited ones' too), then the end.
        ``at``: the daemon's wall clock, a moment ago (never before the attempt's spawn)."""
        if self.current is None:
            return
        await self._stop_sampler()
        self._observe(force=False)
        current = self.current
        if current is not None:
            ended_at = self._clock.of_wall(at, not_before=current.spawned_at)
            self._replace(end_attempt(current, end, ended_at))
            self._publish()

    async def close(self) -> None:
        """Stop sampling and write the record (bounded)."""
        await self._stop_sampler()
        await self._publisher.flush()

    async def _sample(self) -> None:
        while self.current is not None:
            fast = self.current.first_progress_at is None
            await asyncio.sleep(FAST_SAMPLE_S if fast else SAMPLE_S)
            self._observe(force=False)

    def _observe(self, *, force: bool) -> None:
        current = self.current
        if current is None:
            return
        updated, urgent = observe(current, self._read(self._clock), self._clock.time())
        if updated is current:
            return
        self._replace(updated)
        if urgent or force or self._clock.monotonic() - self._written_at >= WRITE_EVERY_S:
            self._publish()

    def _replace(self, attempt: AttemptFacts) -> None:
        attempts = [*self._tail.attempts[:-1], attempt]
        self._tail = self._tail.model_copy(update={"attempts": attempts})

    def _publish(self) -> None:
        self._written_at = self._clock.monotonic()
        self._publisher.request()

    async def _stop_sampler(self) -> None:
        task, self._sampler = self._sampler, None
        if task is not None:
            await cancel_and_wait(task)
