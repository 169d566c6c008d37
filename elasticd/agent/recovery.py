"""The recovery timeline of one node: from the failure's detection to the new workers.

A recovery starts when the agent learns that the running group must end (a
worker failure, a hang, a membership change) and ends when the next
attempt's workers are spawned. :class:`RecoveryTimeline` keeps its marks
(detected, workers stopped, rendezvous done, spawned) and turns them into a
:class:`~elasticd.models.Recovery`, split in phases; the agent emits the
``recovery.*`` events and folds the result into the job document
(:func:`elasticd.agent.edits.merge_recovery`). Pure: times come in as
arguments.

Which side of the boundary: the daemon; no IO.
"""

from __future__ import annotations

from dataclasses import dataclass

from elasticd.models import Recovery

__all__ = ["RecoveryTimeline"]


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
