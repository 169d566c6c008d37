"""The recovery timeline of one node: from the failure's detection to the new workers.

A recovery starts when the agent learns that the running group must end (a
worker failure, a hang, a membership change) and ends when the next
attempt's workers are spawned. :class:`RecoveryTimeline` keeps its marks
(detected, workers stopped, rendezvous done, spawned) and turns them into a
:class:`~elasticd.models.Recovery`, split in phases; the agent emits the
``recovery.*`` events and folds the result into the job document
(:func:`elasticd.agent.edits.merge_recovery`). Pure: times come in as
arguments.

After the spawn one mark is still pending, :class:`FirstProgress`: the new
workers' first heartbeat (``recovery.first_progress``, the job's
``first_progress_s``). Its times are wall clock, so it crosses the daemon's
re-exec in the hand-over (:mod:`elasticd.agent.handover`) and the new image
times it as if nothing happened between.

Which side of the boundary: the daemon; no IO.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from elasticd.models import Recovery

__all__ = ["FirstProgress", "RecoveryTimeline"]


@dataclass(frozen=True)
class FirstProgress:
    """A recovery whose new workers have not pinged yet: its round and their spawn (wall)."""

    round: int
    spawned_at: float

    def seconds(self, pinged_at: float) -> float:
        """Spawn to first ping (never negative: a ping file older than the spawn)."""
        return max(0.0, pinged_at - self.spawned_at)

    def to_json(self) -> dict[str, Any]:
        return {"round": self.round, "spawned_at": self.spawned_at}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> FirstProgress:
        return cls(round=int(doc["round"]), spawned_at=float(doc["spawned_at"]))


@dataclass
class RecoveryTimeline:
    """At most one recovery in progress; a later cause during it does not restart the clock."""

    cause: str | None = None
    detected_at: float = 0.0
    stopped_at: float | None = None

    @property
    def active(self) -> bool:
        return self.cause is not None

    def begin(self, cause: str, detected_at: float) -> bool:
        """Start one (True), unless one is already in progress (e.g. a failure while re-forming)."""
        if self.active:
            return False
        self.cause, self.detected_at, self.stopped_at = cause, detected_at, None
        return True

    def stopped(self, now: float) -> float | None:
        """The old workers are gone: the stop phase's seconds, the first time only."""
        if not self.active or self.stopped_at is not None:
            return None
        self.stopped_at = now
        return now - self.detected_at

    def finish(self, round_: int, *, rendezvous_done: float, spawned: float) -> Recovery | None:
        """The new workers run: the recovery in phases (None when none was in progress)."""
        if self.cause is None:
            return None
        stopped = self.stopped_at if self.stopped_at is not None else self.detected_at
        recovery = Recovery(
            round=round_,
            cause=self.cause,
            detected_at=self.detected_at,
            stop_s=stopped - self.detected_at,
            rendezvous_s=max(0.0, rendezvous_done - stopped),
            spawn_s=max(0.0, spawned - rendezvous_done),
            spawned_at=spawned,
            total_s=spawned - self.detected_at,
        )
        self.cause, self.stopped_at = None, None
        return recovery
