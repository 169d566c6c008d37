"""Barriers, fault records and world decisions over the cluster store (synchronous, torch-free).

Every wait here has the same shape: read the keys that decide it (listing
prefixes, which also returns the store revision of the read), and if the
condition does not hold yet, *watch* the root prefix from that revision
until something changes, then read again. Nothing sleeps and re-reads on a
timer; the only periodic wake-up is the keep-alive that pings the daemon's
heartbeat while a rank legitimately waits (``keepalive`` seconds), so that
a long barrier is not mistaken for a hang.

Scale note: a barrier's waiters wake on every arrival (each rank's watch
sees each write), which is O(n²) answers per barrier: fine for the tens of
ranks per job this is used with today; a counter plus a "complete" key
would make it O(n).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from elasticd.inprocess.keys import Layout, terminated_record
from elasticd.worker import heartbeat
from elasticd.worker.store import ClusterStoreClient

__all__ = ["BarrierResult", "Completion", "Coordinator"]

T = TypeVar("T")


@dataclass(frozen=True)
class BarrierResult:
    """Who reached a barrier, who is known terminated, and who is missing at the timeout."""

    arrived: frozenset[int]
    terminated: frozenset[int]
    missing: frozenset[int]


@dataclass(frozen=True)
class Completion:
    """How waiting for the end of an iteration ended."""

    complete: bool
    reason: str = ""
    timed_out: bool = False


def _json(raw: bytes) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return {}
    return value if isinstance(value, dict) else {}


def _ranks(keys: Collection[str], prefix: str) -> dict[int, str]:
    out: dict[int, str] = {}
    for key in keys:
        tail = key[len(prefix) :]
        if tail.isdigit():
            out[int(tail)] = key
    return out


class Coordinator:
    """One rank's view of the coordination keys of one wrapped call."""

    def __init__(
        self,
        client: ClusterStoreClient,
        layout: Layout,
        call: int,
        rank: int,
        *,
        keepalive: float = 5.0,
        ping: Callable[[], None] = heartbeat.ping,
    ) -> None:
        self.client = client
        self.layout = layout
        self.call = call
        self.rank = rank
        self.keepalive = keepalive
        self._ping = ping

    # -- records -------------------------------------------------------------------

    def terminated(self) -> dict[int, dict[str, Any]]:
        """Every rank known to be gone, with its record."""
        entries, _ = self.client.listing(self.layout.terminated_prefix)
        prefix = self.layout.terminated_prefix
        return {
            int(e.key[len(prefix) :]): _json(e.value)
            for e in entries
            if e.key[len(prefix) :].isdigit()
        }

    def mark_terminated(self, rank: int, reason: str, *, by: str | None = None) -> bool:
        """Record that ``rank`` is gone (first record wins); True if this call wrote it."""
        who = by if by is not None else f"rank {self.rank}"
        return self.client.create(self.layout.terminated(rank), terminated_record(reason, by=who))

    def record_interrupted(self, iteration: int, kind: str, message: str) -> None:
        """Tell every rank that this one interrupted ``iteration`` (exception, timeout...)."""
        value = json.dumps({"kind": kind, "message": message[:2000], "at": time.time()})
        self.client.write(self.layout.interrupted(self.call, iteration, self.rank), value.encode())

    def interruptions(self, iteration: int) -> dict[int, dict[str, Any]]:
        """The ranks that interrupted ``iteration``, with their records."""
        prefix = self.layout.interrupted_prefix(self.call, iteration)
        entries, _ = self.client.listing(prefix)
        return {r: _json(e.value) for e in entries for r in _ranks([e.key], prefix)}

    # -- waits ---------------------------------------------------------------------

    def _wait(self, check: Callable[[], tuple[T | None, int]], deadline: float) -> T | None:
        """Run ``check`` until it returns a value, watching the root between tries.

        ``check`` returns ``(value or None, revision of its first read)``.
        Returns None at ``deadline``.
        """
        while True:
            value, revision = check()
            if value is not None:
                return value
            now = time.monotonic()
            if now >= deadline:
                return None
            self._ping()
            self.client.watch(
                self.layout.root, revision, min(deadline - now, self.keepalive), prefix=True
            )

    def arrive(self, iteration: int, phase: str) -> None:
        """Record this rank's arrival at ``phase`` of ``iteration``."""
        self.client.write(self.layout.arrived(self.call, iteration, phase, self.rank), b"1")

    def barrier(
        self, iteration: int, phase: str, world: Sequence[int], timeout: float
    ) -> BarrierResult:
        """Arrive, then wait until every rank of ``world`` arrived or is terminated.

        At the timeout the result lists the ranks still missing.
        """
        self.arrive(iteration, phase)
        prefix = self.layout.phase_prefix(self.call, iteration, phase)
        members = frozenset(world)
        seen: list[BarrierResult] = []

        def check() -> tuple[BarrierResult | None, int]:
            entries, revision = self.client.listing(prefix)
            arrived = frozenset(_ranks([e.key for e in entries], prefix)) & members
            terminated = frozenset(self.terminated()) & members
            result = BarrierResult(arrived, terminated, members - arrived - terminated)
            seen.append(result)
            return (result if not result.missing else None), revision

        done = self._wait(check, time.monotonic() + timeout)
        return done if done is not None else seen[-1]

    def decide_world(self, iteration: int, proposal: Sequence[int]) -> tuple[list[int], bool]:
        """Pin the world of ``iteration``: the first proposal written wins.

        Returns ``(world, True if it was this rank's proposal)``.
        """
        key = self.layout.world(self.call, iteration)
        won = self.client.create(key, json.dumps(sorted(proposal)).encode())
        if won:
            return sorted(proposal), True
        raw = self.client.wait_for(key, timeout=self.client.timeout)
        try:
            world = [int(r) for r in json.loads(raw)]
        except (ValueError, TypeError) as exc:
            raise RuntimeError(
                f"the world of iteration {iteration} is not a list: {raw!r}"
            ) from exc
        return world, False

    def wait_completion(self, iteration: int, active: Sequence[int], timeout: float) -> Completion:
        """Wait until every active rank finished ``iteration``, or a fault says restart."""
        prefix = self.layout.phase_prefix(self.call, iteration, "done")
        members = frozenset(active)

        def check() -> tuple[Completion | None, int]:
            entries, revision = self.client.listing(prefix)
            done = frozenset(_ranks([e.key for e in entries], prefix)) & members
            if done == members:
                return Completion(True), revision
            interrupted = self.interruptions(iteration)
            if interrupted:
                rank, record = min(interrupted.items())
                what = record.get("kind", "fault")
                return Completion(False, f"rank {rank} interrupted iteration: {what}"), revision
            gone = (frozenset(self.terminated()) & members) - done
            if gone:
                return Completion(False, f"rank {min(gone)} terminated"), revision
            return None, revision

        result = self._wait(check, time.monotonic() + timeout)
        if result is None:
            return Completion(False, f"not every rank finished within {timeout:g} s", True)
        return result
