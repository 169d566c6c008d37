"""Jobs as this daemon serves and runs them; :class:`JobService` is the facade.

The routes and the daemon call :class:`~elasticd.node.jobs.service.JobService`
only. Behind it, one module per job: ``documents`` (the job documents in the
store, changed by compare-and-set), ``queries`` (what the routes read),
``reconcile`` (plan application: which agents run on this node's slots),
``groups`` (replica groups: a parent job's children and its derived state),
``merged`` (a parent's events with its groups') and ``supervision`` (the
agents' tasks, their deaths, a daemon's stop and recovery). Each part is
handed what it needs; none imports the facade.
"""

from elasticd.models import incarnation, incarnation_tag
from elasticd.node.jobs.documents import (
    facts_of,
    owner_of,
    parse_job,
    redacted,
    same_job,
)
from elasticd.node.jobs.service import JobService
from elasticd.node.jobs.supervision import AGENT_CRASH_WINDOW, MAX_AGENT_CRASHES

__all__ = [
    "AGENT_CRASH_WINDOW",
    "MAX_AGENT_CRASHES",
    "JobService",
    "facts_of",
    "incarnation",
    "incarnation_tag",
    "owner_of",
    "parse_job",
    "redacted",
    "same_job",
]
