"""The outcome of one schedule of a pure part of the simulation (the agent's machine, the
fleet scheduler, goodput): its seed, the violation if any, its trace, and a count of what
it did (machine steps, plan passes, attempts folded)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Outcome:
    seed: int
    violation: str | None
    trace: list[str]
    count: int

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.trace[-lines:])
