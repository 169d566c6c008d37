"""What a node of a large job waits on and holds, outside the document: the keys under
``signal/`` (the head and the absorber role) as it last saw them, the absorber role it
may hold, and the seats (see :mod:`.handler`'s docstring for why they exist).

:class:`Signals` is one node's view of ``signal/``: read in one listing, followed by
a watch. :class:`AbsorberRole` takes, renews, follows and lets go of the advisory role
(a create-if-absent key bound to the holder's lease, with a hold time). The seats of
a complete round are written by its completer (:func:`write_seats`) and read by each
participant (:meth:`Signals.read_seat`).

Which side of the boundary: the daemon (and torchrun's process, for its own rendezvous).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from elasticd.clock import Clock
from elasticd.errors import RendezvousError, StoreCompacted, StoreError
from elasticd.rendezvous.layout import (
    absorber_key,
    roster_bytes,
    roster_key,
    seat_key,
    signal_prefix,
)
from elasticd.rendezvous.protocol import Absorber, Head, Seat, State, seats
from elasticd.store import Store
from elasticd.store.base import MAX_BATCH_KEYS, CasResult, WatchEvent
from elasticd.tasks import cancel_and_wait

log = logging.getLogger("elasticd.rendezvous")

#: Longest single watch; a watch that times out just re-reads (no busy loop).
MAX_WATCH = 30.0
#: Seconds one node may hold the absorber role before the others may take it over.
ABSORBER_HOLD = 15.0
#: A holder that keeps the role renews its hold this long before it runs out:
#: ABSORBER_HOLD - ABSORBER_RENEW seconds after it took it, then every as many.
#: Every renewal wakes every node waiting on the head (they watch the head and
#: the role together), so it comes late enough that a round of 10,000 nodes
#: (under 10 s) needs none; the hold is displaced only ABSORBER_HOLD after it
#: ran out, so a renewal still has 20 s to land.
ABSORBER_RENEW = 5.0
#: Seconds between two looks of a waiting node at its lease (a local read, no request).
LEASE_CHECK = 1.0

T = TypeVar("T")


async def unless_relet(relet: Callable[[], Awaitable[bool]], watch: Awaitable[T]) -> T | None:
    """Await ``watch``, or None once ``relet()`` says this node's lease was granted anew.

    A joining node waits on keys others write (the head, the absorber role, the
    document); the expiry of its own lease deletes its presence key, which it does not
    watch. So every :data:`LEASE_CHECK` seconds it asks its lease (no request: the
    node's lease is kept by the daemon) and, when it changed, stops waiting to
    announce again. Without this a node whose lease lapsed while it waited was
    never placed: the others waited for it until the join timed out.
    """
    task = asyncio.ensure_future(watch)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=LEASE_CHECK)
            if done:
                return task.result()
            if await relet():
                return None
    finally:
        if not task.done():
            await cancel_and_wait(task)  # the caller's own cancellation still goes through
        elif not task.cancelled():
            task.exception()  # seen: a watch that failed as this wait gave up on it


async def write_seats(store: Store, job: str, state: State) -> None:
    """Every participant's seat and the round's roster, before the head says it is complete."""
    batches: list[list[tuple[str, bytes]]] = [[]]
    for node, seat in seats(state).items():
        if len(batches[-1]) == MAX_BATCH_KEYS:
            batches.append([])
        batches[-1].append((seat_key(job, node), seat.encode()))
    batches.append([(roster_key(job, state.round), roster_bytes(state))])
    await asyncio.gather(*(store.put_batch(batch) for batch in batches))
    if state.round >= 2:  # the agent reads a roster just after its round: keep two
        with contextlib.suppress(StoreError):
            await store.delete(roster_key(job, state.round - 2))


class Signals:
    """One node's view of ``signal/`` (the head and the absorber role), and its seat."""

    def __init__(
        self,
        store: Store,
        job: str,
        me: str,
        clock: Clock,
        relet: Callable[[], Awaitable[bool]],
    ) -> None:
        self._store = store
        self._job = job
        self._me = me
        self._clock = clock
        self._relet = relet
        self.prefix = signal_prefix(job)
        #: Written (with the round number) by whoever completes or closes a round or sets
        #: its deadline, so that nodes waiting inside an open round wake for what concerns
        #: them, not at every join.
        self.done_key = self.prefix + "done"
        #: Held (advisory) by the one node that lists the presence keys and places every
        #: announced node (:class:`AbsorberRole`).
        self.absorber_key = absorber_key(job)
        self.seen: dict[str, bytes] = {}  # the head and the absorber as last seen
        self.revision: int | None = None

    async def read(self) -> None:
        """The head and the absorber role, and the revision to watch them from (one read)."""
        listing = await self._store.list(self.prefix)
        self.seen.clear()
        self.seen.update((e.key, e.value) for e in listing.entries)
        self.revision = listing.revision

    async def watch(self, until: float, *, relet: bool = True) -> bool:
        """Wait until the head or the absorber changes (True) or ``until`` (False).

        ``relet``: also False once this node's lease was granted anew (a joining node
        then announces again); a running node, which announces nothing, waits on."""
        if self.revision is None:
            await self.read()
            return True
        timeout = max(0.0, min(MAX_WATCH, until - self._clock.time()))
        if timeout <= 0:
            return False
        watch = self._store.watch(self.prefix, self.revision, timeout, prefix=True)
        events: list[WatchEvent] | None
        try:
            events = await (unless_relet(self._relet, watch) if relet else watch)
        except StoreCompacted:
            await self.read()
            return True
        if events is None:
            return False  # this node's lease is new: it announces again
        for event in events:
            self.revision = max(self.revision, event.revision)
            if event.value is None:
                self.seen.pop(event.key, None)
            else:
                self.seen[event.key] = event.value
        return bool(events)

    def head(self) -> Head | None:
        return Head.decode(self.seen.get(self.done_key))

    def absorber(self) -> Absorber:
        raw = self.seen.get(self.absorber_key)
        if raw is None:
            return Absorber()
        try:
            doc = json.loads(raw)
            return Absorber(holder=str(doc["node"]), until=float(doc["until"]))
        except (ValueError, KeyError, TypeError):
            return Absorber(holder="?", until=0.0)  # malformed: overdue, displaced on a take

    async def read_seat(self) -> Seat | None:
        """This node's seat as written by the last round it sat in (None: none, or malformed)."""
        entry = await self._store.get(seat_key(self._job, self._me))
        if entry is None:
            return None
        try:
            return Seat.decode(entry.value)
        except RendezvousError as exc:
            log.warning("%s: ignoring a malformed seat: %s", self._me, exc)
            return None


class AbsorberRole:
    """The advisory absorber role, as this node takes, holds and lets go of it.

    The role only keeps a thousand arriving nodes from each listing a thousand presence
    keys and racing to write the same placement; correctness never depends on it (every
    write is a compare-and-set). It is bound to the holder's lease (a dead holder frees
    it when its lease expires) and says until when it is held: a holder that has not let
    go by then (its release was lost) is displaced, so a live but stuck daemon cannot
    stall the rendezvous. In large jobs (``keep``) a task renews the hold while it is
    held, whatever the holder is busy with (writing ten thousand seats, say): a hold
    that lapses under load would send every waiting node to displace it at once.
    """

    def __init__(
        self,
        store: Store,
        signals: Signals,
        me: str,
        clock: Clock,
        lease: Callable[[], Awaitable[int]],
        *,
        keep: bool,
        overdue: float,
    ) -> None:
        """``overdue``: how long past its time a hold still counts in a large job (a
        renewal may queue behind the crowd's requests; a dead holder frees the role)."""
        self._store = store
        self._signals = signals
        self._me = me
        self._clock = clock
        self._lease = lease
        self._keep = keep
        self.overdue = overdue
        self.key = signals.absorber_key
        self._version = 0
        self._until = 0.0
        self._keeper: asyncio.Task[None] | None = None

    async def hold(self, expected_version: int | None = None) -> CasResult:
        """Take (``None``) or renew (our version) the role for ABSORBER_HOLD seconds."""
        until = self._clock.time() + ABSORBER_HOLD
        hold = {"node": self._me, "until": until}
        result = await self._store.compare_and_set(
            self.key, json.dumps(hold).encode(), expected_version, lease=await self._lease()
        )
        if result.ok and result.entry is not None:
            self._version, self._until = result.entry.version, until
            if self._keep and expected_version is None:
                await self.stop_keeper()
                self._keeper = asyncio.create_task(self._keep_held())
        return result

    async def _keep_held(self) -> None:
        """Renew the hold ABSORBER_RENEW seconds before it runs out; return once it is lost."""
        while True:
            # A timer to a deadline, not a poll: nothing else says when a hold is due.
            await asyncio.sleep(max(0.0, self._until - ABSORBER_RENEW - self._clock.time()))
            try:
                if not (await self.hold(self._version)).ok:
                    return
            except StoreError as exc:  # try again at the next turn; a lapsed hold is displaced
                log.debug("%s: could not renew the absorber role: %s", self._me, exc)
                return

    async def stop_keeper(self) -> None:
        keeper, self._keeper = self._keeper, None
        if keeper is not None and not keeper.done():
            await cancel_and_wait(keeper)

    async def release(self) -> None:
        """Let go of the role (best effort: an overdue hold is taken over anyway)."""
        await self.stop_keeper()
        try:
            await self._store.delete(self.key, self._version)
        except StoreError as exc:
            log.debug("%s: could not let go of the absorber role: %s", self._me, exc)

    async def take(
        self, cap: float | None, wait: Callable[[str, bool, int, float | None], Awaitable[None]]
    ) -> bool:
        """Try to take the role; False after waiting (with ``wait``, until the hold runs out
        or ``cap``) for the holder to let go, or after taking back a stale hold."""
        result = await self.hold(None)
        if result.ok:
            return True
        held = result.entry
        if held is None:
            return False  # let go just now: read again and retry
        try:
            doc = json.loads(held.value)
            holder, until = str(doc["node"]), float(doc["until"])
        except (ValueError, KeyError, TypeError):
            holder, until = "", 0.0  # malformed: treat as expired
        if holder == self._me or self._clock.time() >= until:
            # Ours from an interrupted attempt, or overdue: take it back from that version.
            await self._store.delete(self.key, held.version)
            return False
        if cap is not None:
            until = min(until, cap)
        await wait(self.key, False, held.version, until)
        return False

    async def try_once(self) -> bool:
        """One attempt at the role; a stale hold (ours, or overdue) is deleted. The view of
        ``signal/`` learns the hold found."""
        seen = self._signals.seen
        result = await self.hold(None)
        if result.ok:
            return True
        held = result.entry
        if held is None:
            seen.pop(self.key, None)
            return False
        seen[self.key] = held.value
        found = self._signals.absorber()
        if found.holder == self._me or self._clock.time() >= found.until + self.overdue:
            await self._store.delete(self.key, held.version)
            seen.pop(self.key, None)
        return False

    async def still_held(self) -> bool:
        """While following arrivals: is the role still ours (renewed here when it is due
        and no keeper renews it)?"""
        if self._keeper is not None:
            return not self._keeper.done()  # a keeper that ended lost the role
        if self._clock.time() >= self._until - ABSORBER_RENEW:
            return (await self.hold(self._version)).ok
        return True

    def wake_at(self) -> float:
        """When a holder that follows arrivals must look at its hold again."""
        if self._keeper is not None:
            # The keeper renews the hold; waking for it here would spin (deciding on
            # ten thousand nodes in a loop) until its renewal, queued behind the
            # crowd's requests, lands.
            return self._clock.time() + MAX_WATCH
        return self._until - ABSORBER_RENEW
