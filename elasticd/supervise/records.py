"""What the daemon remembers of each spawned worker, for the start-up sweep of orphans.

The process supervisor (:mod:`elasticd.supervise.process`) makes a
:class:`WorkerRecord` for every worker it starts and hands it to its
:class:`~elasticd.supervise.spawn.WorkerRegistry`; the daemon's database
(:mod:`elasticd.node.db`) stores it, and the orphan sweep
(:mod:`elasticd.supervise.spawn`) reads them back. It lives here, with the
supervisor, so that the supervisor needs nothing of the node above it.

Which side of the boundary: the daemon; a plain value, no IO.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["WorkerRecord"]


@dataclass(frozen=True)
class WorkerRecord:
    """One spawned worker as the daemon's database remembers it."""

    pid: int
    start_time: int
    """Field 22 of ``/proc/<pid>/stat``: when the process started, in clock ticks since boot."""
    boot_id: str
    job_id: str
    attempt: int | None
    local_rank: int
