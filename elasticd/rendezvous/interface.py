"""What the agent sees of a rendezvous: the :class:`Rendezvous` protocol and its rounds."""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from elasticd.rendezvous.protocol import Change, Seat
from elasticd.rendezvous.ranks import NodeSlot


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
    #: This node's ranks, computed by the node that completed the round (jobs of
    #: ``ABSORBER_FROM`` nodes or more). Then ``nodes`` is empty, and so is
    #: ``participants`` in rounds of more than ``ROSTER_INLINE`` nodes
    #: (:meth:`StoreRendezvous.roster` reads them).
    seat: Seat | None = None

    @property
    def roster_known(self) -> bool:
        """Does ``participants`` name every participant?"""
        return len(self.participants) == self.group_world_size

    @staticmethod
    def of_seat(seat: Seat) -> RoundInfo:
        return RoundInfo(
            round=seat.round,
            group_rank=seat.group_rank,
            group_world_size=seat.group_world_size,
            nodes=[],
            master_addr=seat.master_addr,
            master_port=seat.master_port,
            participants=dict(seat.participants or {}),
            seat=seat,
        )


class Rendezvous(Protocol):
    """The agent's view of a rendezvous."""

    async def next_round(self, *, port: int | None = None) -> RoundInfo:
        """Leave the current round if in one, join the next and return once it is complete.

        ``port``: this node's master port for the round (default: a fresh one,
        as :meth:`solo_round` picks it).
        """
        ...

    def solo_round(self, last: RoundInfo) -> RoundInfo | None:
        """The round :meth:`next_round` forms after ``last`` when no other node can join.

        Only for a job of one node (``max_nodes = 1``) whose ``last`` round had
        this node alone: the next round is then known before the store is asked
        (the next number, the same slot, a fresh master port), so a restart can
        start its workers while :meth:`next_round` records it (pass the
        round's ``master_port`` to it). None when the next round is not
        determined locally.
        """
        ...

    async def resume(self, round_: RoundInfo) -> None:
        """Go on in ``round_``, which this node joined before the daemon re-executed itself."""
        ...

    async def wait_for_change(
        self, my_round: int, on_contact: Callable[[], None] | None = None
    ) -> Change:
        """Return the first reason the running round must be re-formed.

        ``on_contact`` is called after every store request that succeeded, so
        a caller that counts how long the store has been lost knows when it
        came back even while nothing changes.
        """
        ...

    async def leaving(self, my_round: int) -> None:
        """Say that this node is leaving ``my_round`` for the next (before it stops workers)."""
        ...

    async def close(self) -> None:
        """Mark the rendezvous closed: the job is over, no further rounds."""
        ...

    async def leave(self) -> None:
        """Leave every list for good (the daemon is stopping)."""
        ...

    async def roster(self, round_: RoundInfo) -> RoundInfo:
        """``round_`` with every participant named (read when the round did not carry them)."""
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
