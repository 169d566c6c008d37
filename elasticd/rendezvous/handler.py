"""The rendezvous executor: applies the pure decisions of :mod:`.protocol` over the store.

A node first announces itself: one lease-bound *presence* key
(``rdzv/<job>/node/<name>``) holding its join info. Each step then reads the
job's rendezvous prefix in one request (the state document and every
presence key, at one revision), decides, and either writes with
compare-and-set (a lost race just means deciding again on the winner's
state) or watches. A node waiting inside an open round watches the state key
only, so a thousand announcements do not wake a thousand watchers each;
every other wait (a running node, the wait list, a hot spare) watches the
whole prefix, so a lease expiry (a presence key deleted) wakes it at once.
Nothing sleeps on a timer: the only timed wake-ups are the deadlines the
protocol names (the last call, the join timeout).
"""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

from elasticd.agent.ranks import NodeSlot
from elasticd.clock import SYSTEM_CLOCK, Clock
from elasticd.errors import (
    RendezvousClosed,
    RendezvousError,
    RendezvousTimeout,
    StoreCompacted,
)
from elasticd.rendezvous.protocol import (
    Action,
    Change,
    Kind,
    NodeInfo,
    Settings,
    State,
    decide_close,
    decide_exit,
    decide_join,
    watch_reason,
)
from elasticd.store import Store

log = logging.getLogger("elasticd.rendezvous")

#: Longest single watch; a watch that times out just re-reads (no busy loop).
MAX_WATCH = 30.0
#: Seconds a participant other than the first gives the first to complete a round.
STRAGGLER_GRACE = 1.0


@dataclass(frozen=True)
class RoundInfo:
    """What a node learns from a completed round."""

    round: int
    group_rank: int
    group_world_size: int
    nodes: list[NodeSlot]
    master_addr: str
    master_port: int
    participants: dict[str, int]


class Rendezvous(Protocol):
    """The agent's view of a rendezvous."""

    async def next_round(self) -> RoundInfo:
        """Leave the current round if in one, join the next and return once it is complete."""
        ...

    async def wait_for_change(self, my_round: int) -> Change:
        """Return the first reason the running round must be re-formed."""
        ...

    async def close(self) -> None:
        """Mark the rendezvous closed: the job is over, no further rounds."""
        ...

    async def leave(self) -> None:
        """Leave every list for good (the daemon is stopping)."""
        ...


def free_port(addr: str = "") -> int:
    """A TCP port that is free on ``addr`` right now (the kernel picks it)."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((addr, 0))
        except OSError:
            sock.bind(("", 0))
        port: int = sock.getsockname()[1]
        return port


def notice_worthy(before: State, after: State) -> bool:
    """Does this write change what nodes waiting inside an open round wait for?"""
    return (
        after.complete != before.complete
        or after.closed != before.closed
        or after.deadline != before.deadline
        or after.round != before.round
    )


class Presence(Mapping[str, NodeInfo]):
    """Announced nodes, decoding a node's join info only when it is looked up."""

    def __init__(self, raw: dict[str, bytes]) -> None:
        self._raw = raw
        self._decoded: dict[str, NodeInfo] = {}

    def __getitem__(self, node: str) -> NodeInfo:
        info = self._decoded.get(node)
        if info is None:
            try:
                info = NodeInfo.from_json(json.loads(self._raw[node]))
            except (ValueError, TypeError) as exc:
                raise RendezvousError(f"node {node!r} announced a malformed join info") from exc
            self._decoded[node] = info
        return info

    def __iter__(self) -> Iterator[str]:
        return iter(self._raw)

    def __len__(self) -> int:
        return len(self._raw)

    def __contains__(self, node: object) -> bool:
        return node in self._raw


_DECODED: dict[tuple[bytes, int], State] = {}


def decode_state(raw: bytes, version: int) -> State:
    """``State.decode`` with a small cache: a process running many agents for one job
    (tests, simulations) decodes each version of the document once."""
    key = (raw, version)  # the whole document: two stores may reuse a version number
    state = _DECODED.get(key)
    if state is None:
        state = State.decode(raw)
        if len(_DECODED) > 64:
            _DECODED.clear()
        _DECODED[key] = state
    return state


def rendezvous_prefix(job_id: str) -> str:
    return f"rdzv/{job_id}/"


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
    ) -> None:
        self._store = store
        self._prefix = rendezvous_prefix(job_id)
        self._state_key = self._prefix + "state"
        self._node_prefix = self._prefix + "node/"
        # Written (with the round number) by whoever completes or closes a round or
        # sets its deadline, so that nodes waiting inside an open round wake for
        # what concerns them, not at every join.
        self._done_key = self._prefix + "done"
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

    async def snapshot(self) -> tuple[State, int | None, Mapping[str, NodeInfo], int]:
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

    async def _state_only(self) -> tuple[State, int | None]:
        """The state document alone (for steps that need no presence: leaving, closing)."""
        entry = await self._store.get(self._state_key)
        if entry is None:
            return State(), None
        return decode_state(entry.value, entry.version), entry.version

    async def _wait(self, key: str, prefix: bool, revision: int, until: float | None) -> None:
        timeout = MAX_WATCH
        if until is not None:
            timeout = max(0.0, min(MAX_WATCH, until - self._clock.time()))
        if timeout <= 0:
            return
        try:
            await self._store.watch(key, revision, timeout, prefix=prefix)
        except StoreCompacted:
            return  # re-read from now

    async def _execute(
        self,
        decide: Callable[[State, Mapping[str, NodeInfo]], Action],
        info: NodeInfo | None,
        *,
        once: bool = False,
        presence_needed: bool = True,
    ) -> State:
        """Apply decisions until one says FINISH (or, with ``once``, one write lands).

        CLOSED and TIMEOUT raise. Leaving uses ``once``: another node may place
        this one again right after (it is still announced), and that is the
        point of leaving a round to join the next, not a reason to leave again.
        """
        light = False  # after waiting inside an open round: read the state key alone first
        while True:
            present: Mapping[str, NodeInfo]
            if light:
                light = False
                state, version = await self._state_only()
                if state.closed:
                    raise RendezvousClosed(f"the rendezvous of {self._prefix[5:-1]} is closed")
                if state.complete and self._me in state.participants:
                    return state
            if presence_needed:
                state, version, present, revision = await self.snapshot()
            else:
                state, version = await self._state_only()
                present, revision = {}, version or 0
            if info is not None and self._me not in present:
                await self._announce(info)  # our lease was lost and renewed: announce again
                continue
            action = decide(state, present)
            if action.kind is Kind.WRITE:
                assert action.state is not None
                result = await self._store.compare_and_set(
                    self._state_key, action.state.encode(), version
                )
                if result.ok:
                    log.debug("%s: %s", self._me, action.why)
                    if notice_worthy(state, action.state):
                        await self._store.put(self._done_key, str(action.state.round).encode())
                    if once:
                        return action.state
                # Decide again on what is there now (ours, or the winner's). When that
                # document already says we are done, or that we are placed in its open
                # round, no read is needed: finish, or wait for the round to complete.
                if result.entry is not None and info is not None and not once:
                    now = decode_state(result.entry.value, result.entry.version)
                    if now.complete and self._me in now.participants and not now.closed:
                        return now
                    if not now.complete and not now.closed and self._me in now.participants:
                        await self._wait_open_round(now, result.entry.version, now.deadline)
                        light = True
                continue
            if action.kind is Kind.WAIT:
                if action.presence:
                    await self._wait(self._prefix, True, revision, action.until)
                else:
                    await self._wait_open_round(state, revision, action.until)
                    light = True
                continue
            if action.kind is Kind.FINISH:
                return state
            if action.kind is Kind.CLOSED:
                raise RendezvousClosed(f"the rendezvous of {self._prefix[5:-1]} is closed")
            raise RendezvousTimeout(action.why)

    async def _wait_open_round(self, state: State, revision: int, until: float | None) -> None:
        """Inside an open round: wake when it is completed or closed, or at the deadline.

        Newcomers place themselves, so nothing they write concerns the nodes
        already placed. At the deadline the first participant (by name)
        completes the round; the others give it a grace period first, then any
        of them does, so a dead first participant cannot stall the round.
        """
        if until is not None and state.participants and min(state.participants) != self._me:
            until += STRAGGLER_GRACE
        await self._wait(self._done_key, False, revision, until)

    async def _announce(self, info: NodeInfo) -> None:
        """(Re)write this node's presence key, bound to its current lease."""
        lease = await self._lease()
        await self._store.put(
            self._node_prefix + self._me, json.dumps(info.to_json()).encode(), lease=lease
        )

    # the agent's interface

    async def next_round(self) -> RoundInfo:
        me, settings = self._me, self._settings
        info = NodeInfo(
            addr=self._master_addr or self._addr,
            role=self._role,
            local_world_size=self._lws,
            port=self._master_port or free_port(self._addr),  # fresh for every round
        )
        await self._execute(
            lambda state, present: decide_exit(state, me, settings),
            None,
            once=True,
            presence_needed=False,
        )
        await self._announce(info)  # after leaving: the next round sees this round's fresh port
        join_deadline = self._clock.time() + settings.join_timeout

        def join(state: State, present: Mapping[str, NodeInfo]) -> Action:
            return decide_join(state, me, settings, self._clock.time(), present, join_deadline)

        state = await self._execute(join, info)
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

    async def wait_for_change(self, my_round: int) -> Change:
        while True:
            state, _, present, revision = await self.snapshot()
            change = watch_reason(state, self._me, my_round, frozenset(present), self._settings)
            if change is not None:
                return change
            await self._wait(self._prefix, True, revision, None)

    async def close(self) -> None:
        await self._execute(lambda state, present: decide_close(state), None, presence_needed=False)

    async def leave(self) -> None:
        """Withdraw the presence key first (so nobody re-places us), then leave every list."""
        me, settings = self._me, self._settings
        await self._store.delete(self._node_prefix + me)
        await self._execute(
            lambda state, present: decide_exit(state, me, settings),
            None,
            once=True,
            presence_needed=False,
        )
