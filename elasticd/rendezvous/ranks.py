"""Worker rank assignment across the nodes of one rendezvous round.

Pure: given what every node of the round contributes (its group rank, role
and local world size), compute the ranks of one node's workers the way
torch.distributed.elastic's agent does:

* global ranks are contiguous, node by node in group-rank order;
* role ranks are contiguous among the workers of the same role;
* ``LOCAL_WORLD_SIZE`` is the node's own worker count.

Each node needs the round's node list only, which the rendezvous state
already carries, so assignment costs no extra store round-trip per node. In
large jobs the node that completes the round computes every node's bases
once (``protocol.seats``) and each node expands its own (:func:`ranks_from`),
so no node reads the whole list.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class NodeSlot:
    """One node's share of a round."""

    group_rank: int
    role: str
    local_world_size: int


@dataclass(frozen=True)
class WorkerRanks:
    """Every rank and size one worker is told about."""

    local_rank: int
    rank: int
    role_rank: int
    world_size: int
    role_world_size: int
    local_world_size: int
    group_rank: int
    group_world_size: int
    role_name: str


def assign_ranks(nodes: Sequence[NodeSlot], group_rank: int) -> list[WorkerRanks]:
    """The ranks of the workers on the node with ``group_rank``."""
    ordered = sorted(nodes, key=lambda n: n.group_rank)
    if [n.group_rank for n in ordered] != list(range(len(ordered))):
        raise ValueError("group ranks must be unique and contiguous from 0")
    me = ordered[group_rank]
    world_size = sum(n.local_world_size for n in ordered)
    base_rank = sum(n.local_world_size for n in ordered[:group_rank])
    same_role = [n for n in ordered if n.role == me.role]
    role_world_size = sum(n.local_world_size for n in same_role)
    base_role_rank = sum(n.local_world_size for n in same_role if n.group_rank < group_rank)
    return ranks_from(
        base_rank=base_rank,
        world_size=world_size,
        base_role_rank=base_role_rank,
        role_world_size=role_world_size,
        local_world_size=me.local_world_size,
        group_rank=group_rank,
        group_world_size=len(ordered),
        role=me.role,
    )


def ranks_from(
    *,
    base_rank: int,
    world_size: int,
    base_role_rank: int,
    role_world_size: int,
    local_world_size: int,
    group_rank: int,
    group_world_size: int,
    role: str,
) -> list[WorkerRanks]:
    """The ranks of one node's workers from its bases (what :func:`assign_ranks` computes)."""
    return [
        WorkerRanks(
            local_rank=i,
            rank=base_rank + i,
            role_rank=base_role_rank + i,
            world_size=world_size,
            role_world_size=role_world_size,
            local_world_size=local_world_size,
            group_rank=group_rank,
            group_world_size=group_world_size,
            role_name=role,
        )
        for i in range(local_world_size)
    ]
