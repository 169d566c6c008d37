"""The state of one rank across restart iterations, and the pure rank-assignment rules.

Ranks are identified by their **initial rank** (``RANK`` at process start),
which never changes; the rank a process has in an iteration is its position
in that iteration's ``world`` (a tuple of initial ranks). A rank assignment
maps the previous world and the set of terminated initial ranks to the next
world; a rank filter then picks the *active* ranks, which call the wrapped
function and form the process group. Inactive ranks (spares) wait.

Everything here is pure and deterministic: every rank computes the same
result from the same inputs, which the wrapper also pins down by deciding
the next world once, in the store (create-if-absent).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection
from dataclasses import dataclass

__all__ = [
    "ActiveWorldSizeDivisibleBy",
    "FillGaps",
    "MaxActiveWorldSize",
    "RankAssignment",
    "RankFilter",
    "ShiftRanks",
    "State",
]


@dataclass(frozen=True)
class State:
    """Where this rank stands in the current iteration."""

    initial_rank: int
    initial_world_size: int
    iteration: int
    world: tuple[int, ...]
    """Initial ranks taking part in this iteration, in rank order."""
    active_world: tuple[int, ...]
    """Initial ranks that call the wrapped function (the process group), in rank order."""

    @classmethod
    def initial(cls, rank: int, world_size: int) -> State:
        """Iteration 0 before any failure: every rank is in the world and active."""
        everyone = tuple(range(world_size))
        return cls(rank, world_size, 0, everyone, everyone)

    @property
    def rank(self) -> int:
        """This rank's position in the world (``-1`` if it is not in it)."""
        return self.world.index(self.initial_rank) if self.initial_rank in self.world else -1

    @property
    def world_size(self) -> int:
        return len(self.world)

    @property
    def active(self) -> bool:
        """Whether this rank calls the wrapped function in this iteration."""
        return self.initial_rank in self.active_world

    @property
    def active_rank(self) -> int | None:
        """This rank's rank in the process group, None for a spare."""
        if self.initial_rank not in self.active_world:
            return None
        return self.active_world.index(self.initial_rank)

    @property
    def active_world_size(self) -> int:
        return len(self.active_world)

    def replace(self, **changes: object) -> State:
        """A copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


#: ``(state, terminated initial ranks) -> state`` with the next ``world``.
RankAssignment = Callable[[State, Collection[int]], State]
#: ``state -> bool``: whether the rank this state describes is active.
RankFilter = Callable[[State], bool]


class ShiftRanks:
    """Drop terminated ranks; the others keep their order and shift down (NVIDIA's default)."""

    def __call__(self, state: State, terminated: Collection[int]) -> State:
        world = tuple(r for r in state.world if r not in terminated)
        return state.replace(world=world, active_world=world)

    def __repr__(self) -> str:
        return "ShiftRanks()"


class FillGaps:
    """Drop terminated ranks; the highest survivors fill the gaps, the others keep their rank."""

    def __call__(self, state: State, terminated: Collection[int]) -> State:
        survivors = [r for r in state.world if r not in terminated]
        size = len(survivors)
        slots: list[int | None] = [r if r not in terminated else None for r in state.world[:size]]
        movers = [r for r in state.world[size:] if r not in terminated]
        world = tuple(r if r is not None else movers.pop(0) for r in slots)
        return state.replace(world=world, active_world=world)

    def __repr__(self) -> str:
        return "FillGaps()"


class MaxActiveWorldSize:
    """At most ``n`` active ranks (the lowest ranks); the rest are spares."""

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"MaxActiveWorldSize needs n >= 1, not {n}")
        self.n = n

    def __call__(self, state: State) -> bool:
        return state.rank < self.n


class ActiveWorldSizeDivisibleBy:
    """Keep the active world a multiple of ``d`` (e.g. the tensor-parallel size)."""

    def __init__(self, d: int) -> None:
        if d < 1:
            raise ValueError(f"ActiveWorldSizeDivisibleBy needs d >= 1, not {d}")
        self.d = d

    def __call__(self, state: State) -> bool:
        return state.rank < state.world_size // self.d * self.d


def apply_filter(state: State, rank_filter: RankFilter | None) -> State:
    """``state`` with ``active_world`` computed by evaluating the filter for every rank."""
    if rank_filter is None:
        return state.replace(active_world=state.world)
    active = tuple(r for r in state.world if rank_filter(state.replace(initial_rank=r)))
    return state.replace(active_world=active)
