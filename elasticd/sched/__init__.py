"""The fleet scheduler's decisions (pure): placement, queue, preemption, backfill.

The daemon applies them in :mod:`elasticd.node.scheduler`.
"""

from elasticd.sched.plan import (
    Demand,
    NodeCapacity,
    Notice,
    Outcome,
    Placement,
    Plan,
    Preemption,
    QueueEntry,
    schedule,
)

__all__ = [
    "Demand",
    "NodeCapacity",
    "Notice",
    "Outcome",
    "Placement",
    "Plan",
    "Preemption",
    "QueueEntry",
    "schedule",
]
