"""The fleet scheduler's decisions (pure): placement, queue, preemption, backfill.

The daemon applies them in :mod:`elasticd.node.scheduler`.
"""

from elasticd.sched.plan import (
    Demand,
    FleetPlan,
    NodeCapacity,
    Notice,
    Placement,
    Preemption,
    QueueEntry,
    ScheduleResult,
    schedule,
)

__all__ = [
    "Demand",
    "NodeCapacity",
    "Notice",
    "ScheduleResult",
    "Placement",
    "FleetPlan",
    "Preemption",
    "QueueEntry",
    "schedule",
]
