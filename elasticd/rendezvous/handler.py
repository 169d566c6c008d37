"""Rendezvous executors over the store."""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from typing import Any, Protocol

from elasticd.agent.ranks import NodeSlot
from elasticd.errors import RendezvousClosed, RendezvousError
from elasticd.store import Store


@dataclass(frozen=True)
class RoundInfo:
    """What a node learns from a completed round."""

    round: int
    group_rank: int
    group_world_size: int
    nodes: list[NodeSlot]
    master_addr: str
    master_port: int


class Rendezvous(Protocol):
    """The agent's view of a rendezvous."""

    async def next_round(self) -> RoundInfo:
        """Join the next round and return once it is complete."""
        ...

    async def close(self) -> None:
        """Mark the rendezvous closed: the job is over, no further rounds."""
        ...


def free_port(addr: str = "") -> int:
    """A TCP port that is free on ``addr`` right now (the kernel picks it)."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((addr, 0))
        port: int = sock.getsockname()[1]
        return port


def rendezvous_key(job_id: str) -> str:
    return f"rdzv/{job_id}"


class SoloRendezvous:
    """The rendezvous of a single-node job: one participant, a new round each time.

    It goes through the store like the multi-node protocol: the round counter
    lives in the job's rendezvous document and advances by compare-and-set.
    """

    def __init__(
        self,
        store: Store,
        job_id: str,
        *,
        node: str,
        role: str,
        local_world_size: int,
        advertise_addr: str,
        master_addr: str | None = None,
        master_port: int | None = None,
    ) -> None:
        self._store = store
        self._key = rendezvous_key(job_id)
        self._node = node
        self._slot = NodeSlot(group_rank=0, role=role, local_world_size=local_world_size)
        self._advertise = advertise_addr
        self._master_addr = master_addr
        self._master_port = master_port

    async def next_round(self) -> RoundInfo:
        for _ in range(100):
            entry = await self._store.get(self._key)
            state: dict[str, Any] = json.loads(entry.value) if entry else {"round": -1}
            if not isinstance(state, dict) or not isinstance(state.get("round"), int):
                raise RendezvousError(f"rendezvous document {self._key} is malformed")
            if state.get("closed"):
                raise RendezvousClosed(f"rendezvous {self._key} is closed")
            addr = self._master_addr or self._advertise
            port = self._master_port or free_port(addr if self._master_addr is None else "")
            new = {
                "round": state["round"] + 1,
                "closed": False,
                "participants": {self._node: 0},
                "master_addr": addr,
                "master_port": port,
            }
            result = await self._store.compare_and_set(
                self._key, json.dumps(new).encode(), entry.version if entry else None
            )
            if result.ok:
                return RoundInfo(
                    round=new["round"],
                    group_rank=0,
                    group_world_size=1,
                    nodes=[self._slot],
                    master_addr=addr,
                    master_port=port,
                )
        raise RendezvousError(f"rendezvous {self._key}: too many lost races")

    async def close(self) -> None:
        for _ in range(100):
            entry = await self._store.get(self._key)
            state = json.loads(entry.value) if entry else {"round": -1}
            state["closed"] = True
            result = await self._store.compare_and_set(
                self._key, json.dumps(state).encode(), entry.version if entry else None
            )
            if result.ok:
                return
