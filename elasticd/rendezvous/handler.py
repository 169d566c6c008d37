"""The rendezvous executor: applies the pure decisions of :mod:`.protocol` over the store.

The keys of one job are drawn in :mod:`.layout`.

A running node, a waiting one and a hot spare watch ``m/``, so that a lease
expiry (a presence key deleted) wakes them at once. Nothing sleeps on a
timer: the only timed wake-ups are the deadlines the protocol names (the last
call, the join timeout) and the absorber's hold.

**Joining costs O(1) requests and O(1) listings per node.** A joining node
announces itself, then reads the state key alone. Placed (by anyone's
write): it waits on ``signal/done`` and reads the state key again. Not
placed: it needs someone to list the presence keys and write the placement.
Were every node to do that, a thousand nodes arriving together would each
list a thousand keys and race to write nearly the same document (measured:
13.9 s over HTTP, 23 s on etcd for one round). So the listing is done by
the node holding the absorber role (a create-if-absent key bound to its
lease, with a hold time; jobs under ``ABSORBER_FROM`` nodes skip it and each
unplaced node lists the few keys itself): it lists, places every announced node in one
compare-and-set, lists again to catch late arrivals, and lets go once a list
finds nobody new. The others wait for the role to be released (or its
holder's lease to expire, or its hold to run out), and then usually find
themselves placed. The role never guards correctness, only effort: every
write is still a compare-and-set that a stale writer loses.

**In jobs of ``ABSORBER_FROM`` nodes or more a node reads O(1) bytes**
(issue 16). The document holds every node, so a node that reads it reads
O(N) bytes, and N nodes O(N²): 10,000 nodes could not form a round over HTTP
in 120 s. There, a node never reads the document unless it writes it:

* the node that completes a round writes every participant's *seat* (its
  ranks, computed for all in one pass as torch's rank 0 does since
  pytorch/pytorch#124982, and the master), the round's roster, then the
  *head* (``signal/done``: the round's number and status, :class:`~.protocol.Head`);
* a joining node reads the head and the absorber role (one listing of
  ``signal/``, which the agents of one process share), announces itself, and
  waits on ``signal/`` for the head to say its round is complete; then it
  reads its seat (:meth:`StoreRendezvous._gather`, :func:`~.protocol.look`).
  It leaves a round without reading the document when the head shows a
  newer round (:func:`~.protocol.skip_exit`); the node that opens the next
  round for all takes the absorber role first and places everybody;
* while workers run, the participants of group rank below ``SENTINELS``
  watch the membership (a loss, an arrival) and start the next round; the
  others watch the head only.

The document is read, as before, only by the absorber, by whoever opens or
closes a round, and by a node whose deadline is due.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from enum import Enum

from elasticd.clock import SYSTEM_CLOCK, Clock
from elasticd.errors import (
    RendezvousClosed,
    RendezvousError,
    RendezvousTimeout,
    StoreCompacted,
)
from elasticd.rendezvous.interface import RoundInfo, free_port
from elasticd.rendezvous.layout import (
    Presence,
    decode_state,
    membership_prefix,
    presence_prefix,
    roster_key,
    state_key,
)
from elasticd.rendezvous.protocol import (
    Action,
    Change,
    Head,
    Kind,
    Look,
    Next,
    NodeInfo,
    Seat,
    Settings,
    State,
    after_lost_write,
    decide_close,
    decide_exit,
    decide_join,
    decide_reopen,
    head_lags,
    holder_follows,
    look,
    needs_placing,
    next_look,
    seats,
    skip_exit,
    watch_reason,
)
from elasticd.rendezvous.signals import (
    ABSORBER_HOLD,
    MAX_WATCH,
    AbsorberRole,
    Signals,
    unless_relet,
    write_seats,
)
from elasticd.store import Store
from elasticd.store.base import CasResult, Entry

log = logging.getLogger("elasticd.rendezvous")

#: Seconds a participant other than the first gives the first to complete a round.
STRAGGLER_GRACE = 1.0
#: Jobs of at least this many nodes use the absorber role. Below, a node not yet
#: placed lists the few presence keys itself: two requests fewer on the restart path.
ABSORBER_FROM = 16
#: In a large job, a node whose announcement was not among the first this many
#: writes after it looked waits ABSORBER_PATIENCE for one of those to take the role.
CANDIDATES = 4
ABSORBER_PATIENCE = ABSORBER_HOLD  # the take may queue behind the crowd
#: In jobs of ``ABSORBER_FROM`` nodes or more, the participants of group rank
#: below this watch the membership while workers run (and start the next round
#: on a loss or an arrival); the others watch the small head key only.
SENTINELS = 3
#: Closures made in error (the job still runs) one node's rendezvous undoes at most.
MAX_REOPENS = 3


@dataclass(frozen=True)
class Deadline:
    """A join's deadline, kept on the monotonic clock.

    The protocol compares deadlines with wall time (the last call's deadline is
    shared in the document, as torch's is), but a join's own timeout is this
    node's business: a step of its wall clock (NTP, an operator) must neither
    time the join out at once nor stretch it. So the deadline is fixed on the
    monotonic clock and handed to each decision as the wall time it falls at
    now (:meth:`wall`).
    """

    monotonic: float

    @staticmethod
    def after(clock: Clock, seconds: float) -> Deadline:
        return Deadline(_monotonic(clock) + seconds)

    def wall(self, clock: Clock) -> float:
        """The wall time, by ``clock`` as it reads now, at which the deadline falls."""
        return clock.time() + (self.monotonic - _monotonic(clock))


def _monotonic(clock: Clock) -> float:
    """``clock``'s monotonic time; a clock made for the protocol's wall time alone (a test's,
    a simulation's) has none, and then its wall time stands in."""
    read = getattr(clock, "monotonic", None)
    return read() if callable(read) else clock.time()


class _Step(Enum):
    """What the join loop does after :meth:`StoreRendezvous._check_in`."""

    DONE = "done"
    AGAIN = "again"
    DECIDE = "decide"


def notice_worthy(before: State, after: State) -> bool:
    """Does this write change what nodes waiting inside an open round wait for?"""
    return (
        after.complete != before.complete
        or after.closed != before.closed
        or after.deadline != before.deadline
        or after.round != before.round
    )


class StoreRendezvous:
    """The dynamic rendezvous of one job, for one node, over the cluster store."""

    def __init__(
        self,
        store: Store,
        job_id: str,
        *,
        node: str,
        role: str,
        local_world_size: int,
        advertise_addr: str,
        settings: Settings,
        lease: Callable[[], Awaitable[int]],
        master_addr: str | None = None,
        master_port: int | None = None,
        clock: Clock = SYSTEM_CLOCK,
        absorber_from: int = ABSORBER_FROM,
        seats_from: int = ABSORBER_FROM,
        absorber_overdue: float = ABSORBER_HOLD,
        still_active: Callable[[], Awaitable[bool]] | None = None,
    ) -> None:
        """``still_active()``: whether the job this rendezvous is for still runs (its
        document, that job's and not another of its id, has not ended); given, a closure
        found while it does is taken for one made in error and undone (:meth:`_reopened`)."""
        self._store = store
        self._still_active = still_active
        self._reopens = 0
        self._job = job_id
        self._prefix = membership_prefix(job_id)  # the state and the presence keys
        self._state_key = state_key(job_id)
        self._node_prefix = presence_prefix(job_id)
        self._announced: NodeInfo | None = None  # this node's presence key as last written
        self._announced_lease: int | None = None  # and the lease it is bound to
        self._round_seen: tuple[int, float] | None = None  # (round, when this node first saw it)
        self._deadline_seen: tuple[float, Deadline] | None = None  # a deadline, and its bound
        self._absorber_from = absorber_from
        # Jobs this large join from the head and their own seat (O(1) bytes each),
        # never the document, unless a deadline is due (see _gather).
        self._large = settings.max_nodes >= max(seats_from, absorber_from)
        self._sig = Signals(store, job_id, node, clock, self._relet)  # signal/, as last seen
        self._done_key = self._sig.done_key
        self._absorber = AbsorberRole(
            store, self._sig, node, clock, lease, keep=self._large, overdue=absorber_overdue
        )
        self._seat: Seat | None = None  # this node's latest seat
        self._seat_read = False  # looked for a seat of an earlier incarnation
        self._me = node
        self._role = role
        self._lws = local_world_size
        self._addr = advertise_addr
        self._settings = settings
        self._lease = lease
        self._master_addr = master_addr
        self._master_port = master_port
        self._clock = clock

    # reads

    async def snapshot(self) -> tuple[State, int | None, Presence, int]:
        """(state, its version, announced nodes, store revision) in one request.

        Presence values are decoded only when a decision places that node
        (:class:`Presence`): with a thousand nodes each step reads a thousand
        keys but decodes only the few that are new.
        """
        listing = await self._store.list(self._prefix)
        state, version = State(), None
        raw: dict[str, bytes] = {}
        for entry in listing.entries:
            if entry.key == self._state_key:
                state, version = decode_state(entry.value, entry.version), entry.version
            elif entry.key.startswith(self._node_prefix):
                raw[entry.key[len(self._node_prefix) :]] = entry.value
        return state, version, Presence(raw), listing.revision

    async def _state_only(self) -> tuple[State, int | None, int]:
        """The state document alone, its version and the store revision it was read at
        (for steps that need no presence: leaving, closing, a placed node's check)."""
        listing = await self._store.list(self._state_key)  # a get with the revision
        for entry in listing.entries:
            if entry.key == self._state_key:
                return decode_state(entry.value, entry.version), entry.version, listing.revision
        return State(), None, listing.revision

    async def _wait(self, key: str, prefix: bool, revision: int, until: float | None) -> None:
        timeout = MAX_WATCH
        if until is not None:
            timeout = max(0.0, min(MAX_WATCH, until - self._clock.time()))
        if timeout <= 0:
            return
        try:
            await unless_relet(
                self._relet, self._store.watch(key, revision, timeout, prefix=prefix)
            )
        except StoreCompacted:
            return  # re-read from now

    async def _relet(self) -> bool:
        """Was this node's announcement made under a lease that is gone? (Its presence key
        went with it: nobody can place the node until it announces again.)"""
        return self._announced is not None and await self._lease() != self._announced_lease

    async def _apply(self, decide: Callable[[State], Action]) -> State:
        """Leave or close: read the state key, decide, write once (again after a lost race)."""
        state, version, _ = await self._state_only()
        while True:
            action = decide(state)
            if action.kind is Kind.FINISH:
                return state
            if action.kind is not Kind.WRITE or action.state is None:  # pragma: no cover
                raise RendezvousError(f"unexpected step while leaving or closing: {action}")
            result = await self._store.compare_and_set(
                self._state_key, action.state.encode(), version
            )
            if result.ok:
                log.debug("%s: %s", self._me, action.why)
                await self._notify(state, action.state, result)
                return action.state
            if result.entry is None:  # the document was deleted meanwhile
                state, version = State(), None
            else:  # decide again on the winner's document
                state = decode_state(result.entry.value, result.entry.version)
                version = result.entry.version

    async def _notify(self, before: State, after: State, written: CasResult) -> None:
        """After a won write of the document: the seats of a round it completed, then the
        head, unless a head of a newer version of the document is there already.

        A write that changes nothing nodes wait for still brings a head that lags it
        up to date (:func:`~.protocol.head_lags`): the writer of the last change may
        have died, or lost the store, between its document and its head, and the nodes
        that follow the head alone would wait for ever for a round they are in.
        """
        entry = await self._store.get(self._done_key)
        stored = None if entry is None else Head.decode(entry.value)
        if not notice_worthy(before, after) and not head_lags(stored, after):
            return
        if self._large and after.complete and not after.closed:
            await write_seats(self._store, self._job, after)
        head = Head.of(after, written.entry.version if written.entry is not None else 0)
        while head.supersedes(stored):
            result = await self._store.compare_and_set(
                self._done_key, head.encode(), None if entry is None else entry.version
            )
            if result.ok:
                return
            entry = result.entry
            stored = None if entry is None else Head.decode(entry.value)

    async def _join(
        self, info: NodeInfo, join_deadline: Deadline, *, holding: bool = False
    ) -> State:
        """Apply join decisions until this node is a participant of a complete round.

        CLOSED and TIMEOUT raise. The node reads the state key alone first
        and, while it finds itself placed, waits without listing (see
        :meth:`_check_in`): only a node that is not placed yet lists the
        presence keys, and (from ``ABSORBER_FROM`` nodes) only while it holds
        the absorber role, so that of a
        thousand nodes arriving together one lists and places them all and the
        others read one small key each.
        """
        me, settings = self._me, self._settings
        # How the next pass reads (protocol.Next): the state key alone first, unless
        # this node holds the absorber role and must list anyway.
        read = Next.LIST if holding else Next.LIGHT
        view: tuple[State, int | None, Presence, int] | None = None
        try:
            while True:
                if read is Next.LIGHT:
                    step, state, info, holding = await self._check_in(info, holding, join_deadline)
                    if step is _Step.DONE:
                        return state
                    if step is _Step.AGAIN:
                        continue
                if read is not Next.REUSE or view is None:
                    view = await self.snapshot()
                state, version, present, revision = view
                state = self._bounded(state)
                read, view = Next.LIST, None
                if me not in present or info.round < state.round:
                    # Our lease was lost and renewed, or a new round opened: announce again.
                    info = replace(info, round=max(info.round, state.round))
                    await self._announce(info)
                    continue
                action = decide_join(
                    state,
                    me,
                    settings,
                    self._clock.time(),
                    present,
                    join_deadline.wall(self._clock),
                    self._seen_open(state),
                )
                if action.kind is Kind.WRITE:
                    assert action.state is not None
                    result = await self._store.compare_and_set(
                        self._state_key, action.state.encode(), version
                    )
                    if result.ok:
                        log.debug("%s: %s", me, action.why)
                        await self._notify(state, action.state, result)
                        if holding and self._large and result.entry is not None:
                            # Decide again on what we wrote, with the presence we hold: the
                            # next watch (from the view's revision) brings whatever changed
                            # meanwhile. Listing ten thousand keys after each write would
                            # cost the holder O(N) per batch of arrivals.
                            read = Next.REUSE
                            view = (action.state, result.entry.version, present, revision)
                        # Else decide again on a fresh view: everyone may have joined now
                        # (no last call to wait out), or, holding the role, more arrived.
                        continue
                    if holding or result.entry is None:
                        continue
                    # Lost the race: the winner's document may say we are done or placed.
                    there = self._bounded(decode_state(result.entry.value, result.entry.version))
                    read = after_lost_write(there, me)
                    if read is Next.DONE:
                        return there
                    if read is Next.LIGHT:
                        await self._wait_open_round(there, result.entry.version, there.deadline)
                    continue
                if holding and holder_follows(action, state, large=self._large):
                    # Keep the role and place the arrivals from the watch's events; the
                    # waiting peers of a large job watch the head only, not the role.
                    view, holding = await self._follow(
                        state, version, present, revision, action.until
                    )
                    if view is not None:
                        read = Next.REUSE
                        continue
                if holding:
                    holding = False
                    await self._absorber.release()
                if action.kind is Kind.WAIT:
                    if action.presence:
                        await self._wait(self._prefix, True, revision, action.until)
                    else:
                        await self._wait_open_round(state, revision, action.until)
                        # Woken by a change: read the state key alone again. Woken by
                        # the time: decide on a fresh view (see _check_in).
                        mine = self._my_deadline(state, action.until)
                        if mine is None or self._clock.time() < mine:
                            read = Next.LIGHT
                    continue
                if action.kind is Kind.FINISH:
                    return state
                if action.kind is Kind.CLOSED:
                    raise RendezvousClosed(f"the rendezvous of {self._job} is closed")
                raise RendezvousTimeout(action.why)
        finally:
            if holding:
                await self._absorber.release()

    async def _check_in(
        self, info: NodeInfo, holding: bool, join_deadline: Deadline
    ) -> tuple[_Step, State, NodeInfo, bool]:
        """The join's cheap step: the state key alone, and a wait while placed.

        Returns (what next, the state read, our announcement, whether we hold
        the absorber role). DONE: we are in the complete round. AGAIN: we
        waited (inside an open round, or for the absorber role); read again.
        DECIDE: list and decide (we hold the role, or our round is due).
        """
        state, _, revision = await self._state_only()
        state = self._bounded(state)
        if state.closed:
            raise RendezvousClosed(f"the rendezvous of {self._job} is closed")
        if state.complete and self._me in state.participants:
            return _Step.DONE, state, info, holding
        if info.round < state.round:
            info = replace(info, round=state.round)  # a new round opened meanwhile
            await self._announce(info)
        elif await self._relet():
            await self._announce(info)  # its presence key went with its old lease
        if not holding and needs_placing(state, self._me):
            if self._settings.max_nodes < self._absorber_from:
                return _Step.DECIDE, state, info, holding  # a few nodes: each places itself
            holding = await self._absorber.take(join_deadline.wall(self._clock), self._wait)
            return (_Step.DECIDE if holding else _Step.AGAIN), state, info, holding
        if not state.complete and self._me in state.participants:
            look = next_look(state, self._settings, self._clock.time(), self._seen_open(state))
            by = join_deadline.wall(self._clock)
            until = min(look if look is not None else by, by)
            mine = self._my_deadline(state, until)
            if mine is None or self._clock.time() < mine:
                await self._wait_open_round(state, revision, until)
                if mine is not None and self._clock.time() >= mine:
                    # Woken by the time, not by a change: the last call is over, or the
                    # nodes that never said they are coming may now be presumed dead.
                    return _Step.DECIDE, state, info, holding
                return _Step.AGAIN, state, info, holding
        return _Step.DECIDE, state, info, holding

    def _due(self, deadline: float | None) -> float | None:
        """The last call's ``deadline`` as this node acts on it: at most
        ``last_call_timeout`` after it first saw that deadline, on its own monotonic clock.

        The deadline is a wall time the node that started the last call wrote. Written
        by a node whose clock ran an hour ahead (and was corrected since), it would hold
        the round open for an hour; each node bounds the wait by what the deadline can
        mean (a last call lasts ``last_call_timeout``).
        """
        if deadline is None:
            return None
        if self._deadline_seen is None or self._deadline_seen[0] != deadline:
            by = Deadline.after(self._clock, self._settings.last_call_timeout)
            self._deadline_seen = (deadline, by)
        return min(deadline, self._deadline_seen[1].wall(self._clock))

    def _bounded(self, state: State) -> State:
        """``state`` with its last call's deadline as this node acts on it (:meth:`_due`)."""
        due = self._due(state.deadline)
        return state if due == state.deadline else replace(state, deadline=due)

    def _seen_open(self, state: State) -> float:
        """When this node first saw ``state``'s round, by its own clock."""
        if self._round_seen is None or self._round_seen[0] != state.round:
            self._round_seen = (state.round, self._clock.time())
        return self._round_seen[1]

    def _my_deadline(self, state: State, until: float | None) -> float | None:
        """When this node acts on an open round's deadline ``until``.

        The first participant (by name) completes the round at the deadline;
        the others give it a grace period first, then any of them does, so a
        dead first participant cannot stall the round.
        """
        if until is not None and state.participants and min(state.participants) != self._me:
            until += STRAGGLER_GRACE
        return until

    async def _follow(
        self,
        state: State,
        version: int | None,
        present: Presence,
        revision: int,
        until: float | None,
    ) -> tuple[tuple[State, int | None, Presence, int] | None, bool]:
        """As the absorber, wait for the membership to change and apply the watch's events.

        Returns the updated view (``None`` when the role was lost) and whether
        the role is still held. The hold is renewed while it lasts.
        """
        if not await self._absorber.still_held():
            return None, False  # taken over meanwhile
        wake = self._absorber.wake_at()
        mine = self._my_deadline(state, until)
        if mine is not None:
            wake = min(wake, mine)
        timeout = min(MAX_WATCH, wake - self._clock.time())
        if timeout <= 0:
            return (state, version, present, revision), True
        return await self._next_view(state, version, present, revision, timeout), True

    async def _next_view(
        self, state: State, version: int | None, present: Presence, revision: int, timeout: float
    ) -> tuple[State, int | None, Presence, int]:
        """Watch the membership for up to ``timeout`` and apply its events to the view.

        What a running node and the absorber do instead of listing the prefix
        again at each change: with N nodes, a listing per event would cost
        O(N) per node for each of the O(N) announcements of a re-rendezvous.
        """
        try:
            events = await self._store.watch(self._prefix, revision, timeout, prefix=True)
        except StoreCompacted:
            return await self.snapshot()
        for event in events:
            revision = max(revision, event.revision)
            value = None if event.kind == "delete" else event.value
            if event.key == self._state_key:
                state = State() if value is None else decode_state(value, event.revision)
                version = None if value is None else event.revision
            elif event.key.startswith(self._node_prefix):
                present.apply(event.key[len(self._node_prefix) :], value)
        return state, version, present, revision

    async def _wait_open_round(self, state: State, revision: int, until: float | None) -> None:
        """Inside an open round: wake when it is completed or closed, or at the deadline.

        Newcomers are placed by whoever lists the presence keys, so nothing
        they write concerns the nodes already placed. See :meth:`_my_deadline`.
        """
        await self._wait(self._done_key, False, revision, self._my_deadline(state, until))

    async def _announce(self, info: NodeInfo) -> Entry:
        """(Re)write this node's presence key, bound to its current lease."""
        lease = await self._lease()
        entry = await self._store.put(
            self._node_prefix + self._me, json.dumps(info.to_json()).encode(), lease=lease
        )
        self._announced, self._announced_lease = info, lease
        return entry

    async def leaving(self, my_round: int) -> None:
        """Say, before stopping this round's workers, that this node heads for the next.

        One write of the presence key (:attr:`NodeInfo.seen`): the other nodes
        wait for a node that said it, and presume dead after ``ack_timeout``
        a waiting node that did not (see :func:`protocol._everyone_joined`).
        """
        info = self._announced
        if info is not None and info.heading_for <= my_round:
            await self._announce(replace(info, seen=my_round + 1))

    # large jobs: the head, the absorber role and this node's seat

    async def _read_seat(self) -> Seat | None:
        self._seat_read = True
        return await self._sig.read_seat()

    async def _next_round_large(self, info: NodeInfo) -> Seat:
        """``next_round`` in a large job: O(1) reads but for the few nodes that write.

        Leaving reads the document only when this node may be a participant of
        the complete round (:func:`~.protocol.skip_exit`); joining waits on
        the head and the absorber role (:meth:`_gather`), and ends with a read
        of this node's own seat.
        """
        me, settings = self._me, self._settings
        if self._sig.revision is None or self._sig.head() is None:
            await self._sig.read()  # a read shared with the other agents of this process
        head = self._sig.head()
        earlier = False  # an earlier incarnation of this node may be placed
        if self._seat is None and not self._seat_read:
            # This agent's first join. An earlier incarnation of this node (a daemon
            # killed and started again within its lease) may still be announced, and
            # placed in a round that is open, or complete, or completing while the head
            # lags: then it leaves through the document, as a participant would, and is
            # placed anew on its own announcement. Without an announcement of its own
            # (a fresh start of a large job: no document read) nothing placed it.
            earlier = await self._store.get(self._node_prefix + me) is not None
            if not earlier and head is not None and head.complete:
                self._seat = await self._read_seat()
            self._seat_read = True
        looked_at = self._sig.revision or 0
        announce = skip_exit(head, self._seat.round if self._seat is not None else None)
        if earlier:
            announce = None
        opened = holding = False
        if announce is None:
            # Likely to open the next round for all: take the absorber role first, so
            # that the crowd this wakes finds it taken (a take queued behind their
            # announcements would come after their patience).
            holding = await self._absorber.try_once()
            now = self._clock.time()
            try:
                left = await self._apply(lambda state: decide_exit(state, me, settings, now=now))
            except BaseException:
                if holding:
                    await self._absorber.release()
                raise
            opened = left.round > (head.round if head is not None else 0)
            announce = left.round + (1 if left.complete else 0)
        info = replace(info, round=announce)
        try:
            written = await self._announce(info)
        except BaseException:
            if holding:
                await self._absorber.release()
            raise
        # Who asks for the absorber role at once: the node that opened this round,
        # or one of the first to announce since it looked. The crowd behind them
        # waits for the role to be taken (effort only: it takes it after that).
        first = opened or written.version <= looked_at + CANDIDATES
        patience = None if first else self._clock.time() + ABSORBER_PATIENCE
        join_deadline = Deadline.after(self._clock, settings.join_timeout)
        if holding:
            seat = await self._decided(info, join_deadline, holding=True)
        else:
            seat = await self._gather(info, join_deadline, patience)
        self._seat = seat
        return seat

    async def _gather(
        self, info: NodeInfo, join_deadline: Deadline, patient_until: float | None = None
    ) -> Seat:
        """Wait for this node's seat, from the head and the absorber role (:func:`~.protocol.look`).

        One node holds the absorber role and places everybody (:meth:`_join`,
        holding it); the others wait for the head to say the round is
        complete and read their seat. A node reads the document only when a
        deadline is due, its seat is missing, or it holds the role.
        """
        tried = False
        while True:
            if await self._relet():
                await self._announce(info)  # its presence key went with its old lease
            head = self._sig.head() or Head()
            head = replace(head, deadline=self._due(head.deadline))
            step, until = look(
                head,
                self._sig.absorber(),
                self._me,
                info.round,
                self._clock.time(),
                join_deadline.wall(self._clock),
                STRAGGLER_GRACE,
                tried,
                patient_until,
                self._absorber.overdue,
            )
            if step is Look.CLOSED:
                raise RendezvousClosed(f"the rendezvous of {self._job} is closed")
            if step is Look.SEAT:
                seat = await self._read_seat()
                if seat is not None and seat.round == head.round:
                    return seat
                step = Look.DECIDE  # not seated in the complete round (a spare, or odd)
            if step is Look.DECIDE:
                return await self._decided(info, join_deadline, holding=False)
            if step is Look.REANNOUNCE:
                info = replace(info, round=head.round)
                await self._announce(info)
                continue
            if step is Look.TAKE:
                if await self._absorber.try_once():
                    return await self._decided(info, join_deadline, holding=True)
                # Lost to a holder: wait for it. Found a stale hold and deleted it: ask again.
                tried = self._absorber.key in self._sig.seen
                continue
            assert until is not None
            before = self._sig.seen.get(self._absorber.key)
            await self._sig.watch(until)
            if self._sig.seen.get(self._absorber.key) != before:
                tried = False  # the role changed hands: free again, perhaps

    async def _decided(self, info: NodeInfo, join_deadline: Deadline, *, holding: bool) -> Seat:
        """The document's way (:meth:`_join`), for the few nodes that write or a deadline."""
        state = await self._join(info, join_deadline, holding=holding)
        return seats(state)[self._me]

    # the agent's interface

    def _fresh_port(self) -> int:
        return self._master_port or free_port(self._addr)  # fresh for every round

    def solo_round(self, last: RoundInfo) -> RoundInfo | None:
        if (
            self._settings.max_nodes != 1
            or self._large
            or last.seat is not None
            or last.participants != {self._me: 0}
            or len(last.nodes) != 1
        ):
            return None
        return RoundInfo(
            round=last.round + 1,
            group_rank=0,
            group_world_size=1,
            nodes=list(last.nodes),
            master_addr=self._master_addr or self._addr,
            master_port=self._fresh_port(),
            participants={self._me: 0},
        )

    async def next_round(self, *, port: int | None = None) -> RoundInfo:
        """Join the next round (:class:`~elasticd.rendezvous.interface.Rendezvous`); a
        closure made in error is undone and the join made again (:meth:`_reopened`)."""
        while True:
            try:
                return await self._next_round(port)
            except RendezvousClosed:
                if not await self._reopened():
                    raise

    async def _reopened(self) -> bool:
        """Open the rendezvous again if it was closed while its job still runs.

        Whoever closes a rendezvous writes its job's end first (the agents, a cancel), so
        a closed rendezvous of a job still active was closed by something else: the late
        close of an agent of a deleted job of the id, on any node, whose new job the id
        now names. Undone (the same round, as it was), the new job's nodes go on as if
        nothing happened, instead of each ending its agent, which would leave the job
        active with nothing running it.
        At most :data:`MAX_REOPENS` times per node's agent (a writer of the store who
        closes it over and over gets the job stopped, not a loop).

        The job is read again after the reopen's write: one that ended between the first
        read and the write (a cancel: its end, then its close, a no-op on the closed
        state, landed there) is closed again, and its end stands.
        """
        if self._still_active is None or self._reopens >= MAX_REOPENS:
            return False
        if not await self._still_active():
            return False
        self._reopens += 1
        log.warning("%s: the rendezvous of %s was closed while it runs: opening it again",
                    self._me, self._job)  # fmt: skip
        await self._apply(decide_reopen)
        if not await self._still_active():  # it ended meanwhile: its closure stands
            await self._apply(decide_close)
            return False
        if self._large:  # the head as written now, not the closed one last seen
            await self._sig.read()
        return True

    async def _next_round(self, port: int | None) -> RoundInfo:
        me, settings = self._me, self._settings
        info = NodeInfo(
            addr=self._master_addr or self._addr,
            role=self._role,
            local_world_size=self._lws,
            port=port or self._fresh_port(),
        )
        if self._large:
            return RoundInfo.of_seat(await self._next_round_large(info))
        now = self._clock.time()
        left = await self._apply(lambda state: decide_exit(state, me, settings, now=now))
        # Announce after leaving (our workers are stopped): for the round now open
        # or next, with this round's fresh port.
        info = replace(info, round=left.round + (1 if left.complete else 0))
        await self._announce(info)
        state = await self._join(info, Deadline.after(self._clock, settings.join_timeout))
        master = state.master()
        if master is None:  # pragma: no cover - FINISH implies a complete round
            raise RendezvousError("the completed round has no rank 0")
        return RoundInfo(
            round=state.round,
            group_rank=state.participants[me],
            group_world_size=len(state.participants),
            nodes=state.slots(),
            master_addr=master[0],
            master_port=master[1],
            participants=dict(state.participants),
        )

    async def wait_for_change(
        self, my_round: int, on_contact: Callable[[], None] | None = None
    ) -> Change:
        """Read the membership once, then follow the watch's events (see :meth:`_next_view`).

        In a large job only the sentinels (group ranks below ``SENTINELS``) do;
        the others watch the head, which the next round's opener writes. A closure made
        in error (:meth:`_reopened`) is undone, and the watch goes on.
        """
        while True:
            change = await self._wait_for_change(my_round, on_contact)
            if change is not Change.CLOSED or not await self._reopened():
                return change

    async def _wait_for_change(
        self, my_round: int, on_contact: Callable[[], None] | None
    ) -> Change:
        if self._large and self._seat is not None and self._seat.group_rank >= SENTINELS:
            return await self._follow_head(my_round, on_contact)
        state, version, present, revision = await self.snapshot()
        while True:
            if on_contact is not None:
                on_contact()
            change = watch_reason(
                state, self._me, my_round, frozenset(present), self._settings, present.round_of
            )
            if change is not None:
                return change
            state, version, present, revision = await self._next_view(
                state, version, present, revision, MAX_WATCH
            )

    async def _follow_head(self, my_round: int, on_contact: Callable[[], None] | None) -> Change:
        """A non-sentinel's watch: the round changes when the head names another (or closes)."""
        if self._sig.revision is None:
            await self._sig.read()
        while True:
            if on_contact is not None:
                on_contact()
            head = self._sig.head()
            if head is not None and head.closed:
                return Change.CLOSED
            # The head may lag the document, never lead it: one older than this node's
            # round (read before the round completed) says nothing of a change.
            if head is not None and head.round > my_round:
                return Change.NEW_ROUND
            await self._sig.watch(self._clock.time() + MAX_WATCH, relet=False)

    async def roster(self, round_: RoundInfo) -> RoundInfo:
        """``round_`` with every participant named: from its roster key, else the document."""
        if round_.roster_known:
            return round_
        entry = await self._store.get(roster_key(self._job, round_.round))
        if entry is not None:
            try:
                doc = json.loads(entry.value)
                return replace(round_, participants={str(k): int(v) for k, v in doc.items()})
            except (ValueError, TypeError, AttributeError) as exc:
                raise RendezvousError(f"the roster of round {round_.round} is malformed") from exc
        state, _, _ = await self._state_only()
        if state.round == round_.round and state.complete:
            return replace(round_, participants=dict(state.participants))
        raise RendezvousError(f"the participants of round {round_.round} are no longer known")

    async def resume(self, round_: RoundInfo) -> None:
        """Go on in ``round_`` after the daemon's re-exec: this node's seat, and its presence
        key as it was last written (:meth:`leaving` rewrites it); nothing is written."""
        self._seat, self._seat_read = round_.seat, True
        entry = await self._store.get(self._node_prefix + self._me)
        if entry is not None:
            with contextlib.suppress(ValueError, TypeError, KeyError, AttributeError):
                self._announced = NodeInfo.from_json(json.loads(entry.value))
                # The lease it is bound to, as announced: without it every wait of this
                # node would take its lease for one granted anew (see _relet).
                self._announced_lease = entry.lease

    async def close(self) -> None:
        await self._apply(decide_close)

    async def leave(self) -> None:
        """Withdraw the presence key first (so nobody re-places us), then leave every list."""
        me, settings = self._me, self._settings
        await self._store.delete(self._node_prefix + me)
        now = self._clock.time()  # the re-formed round's opened_at (see protocol.dissolve)
        await self._apply(lambda state: decide_exit(state, me, settings, for_good=True, now=now))
