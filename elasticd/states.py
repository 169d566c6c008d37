"""The states of a worker group and of a job, and the transitions allowed between them.

Dependency-free on purpose: the agent, the API and the tests import it, and
nothing here does IO. A refused transition raises ``InvalidTransition``;
terminal states are final.

Worker group (per node, per job), torch.distributed.elastic's ``WorkerState``::

    INIT ──► HEALTHY ⇄ UNHEALTHY
               │  ╲       │
               │   ╲      ▼
               │    ─► STOPPED ──► INIT (restart)
               ▼          │
        SUCCEEDED | FAILED ◄┘

Job (the cluster view)::

    PENDING ──► RUNNING ⇄ RESTARTING
       │           │          │
       └───────────┴──────────┴──► SUCCEEDED | FAILED | CANCELLED
"""

from __future__ import annotations

from enum import StrEnum

from elasticd.errors import InvalidTransition


class WorkerState(StrEnum):
    """State of the local worker group of one job on one node.

    UNKNOWN:   an action was half-applied (an internal error); the agent cannot
               tell what the workers are doing. Recovery stops them.
    INIT:      the group is created (first start or after a restart) and its
               workers are not running yet.
    HEALTHY:   every worker is running and, where the job asks for progress
               heartbeats, reporting progress.
    UNHEALTHY: the workers run but one has stopped reporting progress or a
               health check failed.
    STOPPED:   the agent stopped the workers on purpose (to restart them, to
               re-rendezvous, or because the job was cancelled).
    SUCCEEDED: every worker exited with code 0. Terminal.
    FAILED:    a worker failed and no restart is left, or the group could not
               be started. Terminal.
    """

    UNKNOWN = "UNKNOWN"
    INIT = "INIT"
    HEALTHY = "HEALTHY"
    UNHEALTHY = "UNHEALTHY"
    STOPPED = "STOPPED"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"

    @property
    def is_running(self) -> bool:
        return self in WORKERS_RUNNING

    @property
    def is_terminal(self) -> bool:
        return self in WORKERS_TERMINAL


WORKERS_RUNNING = frozenset({WorkerState.HEALTHY, WorkerState.UNHEALTHY})
WORKERS_TERMINAL = frozenset({WorkerState.SUCCEEDED, WorkerState.FAILED})

_WORKER_MOVES: dict[WorkerState, frozenset[WorkerState]] = {
    WorkerState.INIT: frozenset({WorkerState.HEALTHY, WorkerState.STOPPED, WorkerState.FAILED}),
    WorkerState.HEALTHY: frozenset(
        {WorkerState.UNHEALTHY, WorkerState.STOPPED, WorkerState.SUCCEEDED, WorkerState.FAILED}
    ),
    WorkerState.UNHEALTHY: frozenset(
        {WorkerState.HEALTHY, WorkerState.STOPPED, WorkerState.SUCCEEDED, WorkerState.FAILED}
    ),
    WorkerState.STOPPED: frozenset({WorkerState.INIT, WorkerState.FAILED}),
    WorkerState.UNKNOWN: frozenset({WorkerState.STOPPED, WorkerState.FAILED}),
    WorkerState.SUCCEEDED: frozenset(),
    WorkerState.FAILED: frozenset(),
}


def worker_transition(current: WorkerState, target: WorkerState) -> WorkerState:
    """Return ``target`` if the group may move there from ``current``; else raise.

    Any non-terminal state may fall to UNKNOWN (an internal error).
    """
    if target is WorkerState.UNKNOWN and not current.is_terminal:
        return target
    if target not in _WORKER_MOVES[current]:
        raise InvalidTransition(f"worker group cannot go from {current.value} to {target.value}")
    return target


class JobState(StrEnum):
    """State of a job as the cluster sees it.

    PENDING:    accepted, waiting for enough nodes (min_nodes) to rendezvous.
    RUNNING:    the workers of the current round are running.
    RESTARTING: a failure or membership change stopped the workers; a new
                round is being formed.
    SUCCEEDED:  every worker of the final round exited 0. Terminal.
    FAILED:     the restart budget is spent, the job could not start, or the
                daemon running it stopped. Terminal.
    CANCELLED:  a user cancelled the job. Terminal.
    """

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    RESTARTING = "RESTARTING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def is_terminal(self) -> bool:
        return self in JOB_TERMINAL


JOB_ACTIVE = frozenset({JobState.PENDING, JobState.RUNNING, JobState.RESTARTING})
JOB_TERMINAL = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})

_JOB_MOVES: dict[JobState, frozenset[JobState]] = {
    JobState.PENDING: frozenset({JobState.RUNNING} | JOB_TERMINAL - {JobState.SUCCEEDED}),
    JobState.RUNNING: frozenset({JobState.RESTARTING, JobState.PENDING} | JOB_TERMINAL),
    JobState.RESTARTING: frozenset({JobState.RUNNING, JobState.PENDING} | JOB_TERMINAL),
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
}


def job_transition(current: JobState, target: JobState) -> JobState:
    """Return ``target`` if a job may move there from ``current``; else raise."""
    if target not in _JOB_MOVES[current]:
        raise InvalidTransition(f"job cannot go from {current.value} to {target.value}")
    return target
