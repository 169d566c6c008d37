"""What the agent needs from the node it runs on, as protocols the node implements.

The agent sits below the node's services (see the layers in ``docs/design.md``):
it imports nothing from :mod:`elasticd.node`. The composition root
(:meth:`elasticd.node.jobs.JobService` when it starts an agent) hands in the
node's implementations: its event log (:class:`elasticd.node.events.EventLog`),
its health checks (:class:`elasticd.node.health.NodeHealthChecks`) and the log
followers' growth signal (:meth:`elasticd.node.logfollow.LogGrowth.grew`).

Which side of the boundary: the daemon; declarations only.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

from elasticd.eventkinds import EventKind
from elasticd.models import EventSource, JobSpec
from elasticd.security import Identity

__all__ = ["CheckResult", "EventSink", "HealthChecks", "LogGrown"]

#: Told each time a worker's log file grows (log followers wait on it).
LogGrown = Callable[[Path], None]


class EventSink(Protocol):
    """The node's event log, as the agent uses it."""

    def emit(
        self, job_id: str, source: EventSource, kind: EventKind, message: str = "", **fields: Any
    ) -> object:
        """Record one event of ``job_id`` now; never raises for a disk fault."""

    def store_lost(
        self, job_id: str, source: EventSource, message: str, tag: str | None = None
    ) -> bool:
        """Say ``store.lost`` for ``job_id`` (``tag``: which job of the id), once per outage."""

    def store_back(self, job_id: str | None = None) -> list[str]:
        """The store answers again: ``store.back`` for ``job_id`` if it was told it was lost."""


class CheckResult(Protocol):
    """One health check's verdict."""

    @property
    def name(self) -> str: ...

    @property
    def ok(self) -> bool: ...

    @property
    def skipped(self) -> bool: ...

    @property
    def message(self) -> str: ...

    @property
    def duration_s(self) -> float: ...


#: Notes a failure attributed to this node in its health record, across jobs: ``(kind, job,
#: round, message)`` with kind ``first_failure``, ``hardware`` or ``health_check``; returns
#: whether the node is quarantined now (:mod:`elasticd.node.quarantine`).
Attribute = Callable[[Literal["first_failure", "hardware", "health_check"], str, int | None, str],
                     Awaitable[bool]]  # fmt: skip


class HealthChecks(Protocol):
    """Runs the checks of a job before each (re)start of its workers on this node."""

    async def run(
        self,
        job_id: str,
        spec: JobSpec,
        *,
        identity: Identity | None,
        cuda_visible_devices: str | None,
    ) -> Sequence[CheckResult]:
        """Every check's result (none: the job has no check here)."""
        ...
