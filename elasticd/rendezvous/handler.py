"""The rendezvous executor: applies the pure decisions of :mod:`.protocol` over the store.

Each step reads the job's rendezvous prefix in one request (the state
document and every node's lease-bound ``alive`` key, at one revision),
decides, and either writes with compare-and-set (a lost race just means
deciding again on the winner's state) or watches the prefix from that
revision. Nothing sleeps on a timer: a node wakes when the document changes,
when a lease expires (its ``alive`` key is deleted), or at the one deadline
the protocol names (the last call, the join timeout).
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Awaitable, Callable
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
        self._alive_prefix = self._prefix + "alive/"
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

    async def snapshot(self) -> tuple[State, int | None, frozenset[str], int]:
        """(state, its version, live nodes, store revision) in one request."""
        listing = await self._store.list(self._prefix)
        state, version = State(), None
        alive: set[str] = set()
        for entry in listing.entries:
            if entry.key == self._state_key:
                state, version = State.decode(entry.value), entry.version
            elif entry.key.startswith(self._alive_prefix):
                alive.add(entry.key[len(self._alive_prefix) :])
        return state, version, frozenset(alive), listing.revision

    async def _wait(self, revision: int, until: float | None) -> None:
        timeout = MAX_WATCH
        if until is not None:
            timeout = max(0.0, min(MAX_WATCH, until - self._clock.time()))
        if timeout <= 0:
            return
        try:
            await self._store.watch(self._prefix, revision, timeout, prefix=True)
        except StoreCompacted:
            return  # re-read from now

    async def _execute(self, decide: Callable[[State, frozenset[str]], Action]) -> State:
        """Apply decisions until one says FINISH; CLOSED and TIMEOUT raise."""
        while True:
            state, version, alive, revision = await self.snapshot()
            action = decide(state, alive)
            if action.kind is Kind.WRITE:
                assert action.state is not None
                result = await self._store.compare_and_set(
                    self._state_key, action.state.encode(), version
                )
                if result.ok:
                    log.debug("%s: %s", self._me, action.why)
                continue  # decide again on what is there now (ours or the winner's)
            if action.kind is Kind.WAIT:
                await self._wait(revision, action.until)
                continue
            if action.kind is Kind.FINISH:
                return state
            if action.kind is Kind.CLOSED:
                raise RendezvousClosed(f"the rendezvous of {self._prefix[5:-1]} is closed")
            raise RendezvousTimeout(action.why)

    async def _announce(self) -> None:
        """(Re)bind this node's alive key to its current lease."""
        lease = await self._lease()
        await self._store.put(self._alive_prefix + self._me, b"", lease=lease)

    # the agent's interface

    async def next_round(self) -> RoundInfo:
        await self._announce()
        me, settings = self._me, self._settings
        await self._execute(lambda state, alive: decide_exit(state, me, settings))
        addr = self._master_addr or self._addr
        info = NodeInfo(
            addr=addr,
            role=self._role,
            local_world_size=self._lws,
            port=self._master_port or free_port(self._addr),
        )
        join_deadline = self._clock.time() + settings.join_timeout

        def join(state: State, alive: frozenset[str]) -> Action:
            return decide_join(state, me, info, settings, self._clock.time(), alive, join_deadline)

        state = await self._execute(join)
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
            state, _, alive, revision = await self.snapshot()
            change = watch_reason(state, self._me, my_round, alive, self._settings)
            if change is not None:
                return change
            await self._wait(revision, None)

    async def close(self) -> None:
        await self._execute(lambda state, alive: decide_close(state))

    async def leave(self) -> None:
        me, settings = self._me, self._settings
        await self._execute(lambda state, alive: decide_exit(state, me, settings))
        await self._store.delete(self._alive_prefix + me)
