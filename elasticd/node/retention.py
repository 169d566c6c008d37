"""When a finished job may be deleted: measured on this node's own clock, never another's.

A job document's ``finished_at`` is stamped by the wall clock of whichever
node ended the job. Comparing it with this node's wall clock deleted fresh
jobs at once when the two clocks disagreed (a node an hour behind, or a step
of this node's clock), and kept others an hour too long (issue 23, defect 4).
So each node keeps its own record of when it *saw* a job end (the cluster's
job watch delivered the terminal document), on its monotonic clock, which
never steps; retention runs from there. The record is kept in the daemon's
database too, so a restart does not start the count again (nor, worse, treat
the job as ended long ago).

A monotonic clock starts again at every boot: a record from another boot
cannot be compared with it, and the count starts again from when this boot
first sees the job (a job is then kept longer, never deleted early). A record
names the end it belongs to by the document's own ``finished_at``, so a job
id deleted and used again is a new end.

Pure: the caller passes ``now`` (monotonic) and its boot id.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class EndSeen:
    """When this node saw a job's end: ``at`` on the monotonic clock of boot ``boot_id``."""

    finished_at: float | None
    """The job document's own stamp (another node's wall clock): which end this is, not when."""
    boot_id: str
    at: float


class Finished(Protocol):
    """What retention reads of a job (:class:`elasticd.models.Job`)."""

    @property
    def id(self) -> str: ...

    @property
    def finished_at(self) -> float | None: ...


def seen_end(job: Finished, record: EndSeen | None, boot_id: str, now: float) -> EndSeen:
    """This node's record of the end of the finished ``job``: ``record`` when it is of this
    end and this boot, else a new one made ``now``."""
    if record is not None and record.finished_at == job.finished_at and record.boot_id == boot_id:
        return record
    return EndSeen(finished_at=job.finished_at, boot_id=boot_id, at=now)


def retention_due(seen_at: float, now: float, retention: float) -> bool:
    """True when a job whose end this node saw at ``seen_at`` (monotonic) is past
    ``retention`` seconds at ``now``; a ``retention`` of 0 keeps jobs forever."""
    return retention > 0 and now - seen_at >= retention


def expired(
    finished: Iterable[Finished], ends: Mapping[str, EndSeen], now: float, retention: float
) -> list[str]:
    """The finished jobs to delete at ``now``: those whose end this node saw over
    ``retention`` seconds ago. A job without a record is not (its end was not seen yet)."""
    out = []
    for job in finished:
        end = ends.get(job.id)
        if (
            end is not None
            and end.finished_at == job.finished_at
            and retention_due(end.at, now, retention)
        ):
            out.append(job.id)
    return out
