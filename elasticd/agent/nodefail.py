"""Whose fault is a failed start: the node's or the job's; and what the agent does next (pure).

A job may end FAILED only when its own workers failed or its budget ran out
(issue 23). A start can fail for the job's reasons (its program does not
exist, its working folder is not its user's to enter, its user is refused)
or for the node's: the daemon is out of descriptors (EMFILE, ENFILE, often a
flood of idle connections), memory or processes (ENOMEM, EAGAIN from fork),
its disk refuses writes, its cgroup is gone, a root stage cannot run.
:func:`classify` decides which, from where the start failed (the
:class:`~elasticd.errors.SpawnStage` a :class:`~elasticd.errors.WorkerSpawnError`
carries) and the OS error; a table in ``tests/agent/test_nodefail.py``.

A node-side failure is never charged to the job. The agent tries again
with backoff (:func:`decide_retry`: a pure function of the first failure,
the tries so far and ``now``), one ``workers.spawn_retry`` event per try
naming the cause, and after ``node_failure_grace`` seconds it gives the job
back: it leaves the round (the others re-form without it, free), and the
node declines the job for a while so that the fleet's scheduler may place
it elsewhere; on a single node the job waits, PENDING or RESTARTING with the
reason, until this node takes it up again. No restart is spent either way.
"""

from __future__ import annotations

import enum
import errno as errnos
from dataclasses import dataclass

from elasticd.errors import SpawnStage, WorkerSpawnError


class Side(enum.Enum):
    """Whose failure a start's failure is."""

    JOB = "job"
    """The job's own: it fails as before (one ``workers.spawn_failed``, the job FAILED)."""
    NODE = "node"
    """This node's: retried, then given back; never charged to the job."""


#: OS errors that say the node ran out of something, wherever they happen.
NODE_ERRNOS = frozenset(
    {
        errnos.EMFILE,  # this process's descriptors
        errnos.ENFILE,  # the system's
        errnos.ENOMEM,
        errnos.EAGAIN,  # fork: RLIMIT_NPROC, pid_max, the cgroup's pids.max
        errnos.ENOSPC,  # the node's disk (logs, heartbeats, state)
        errnos.EIO,
        errnos.EROFS,
    }
)

#: Stages of the daemon's own machinery: any failure there is the node's.
NODE_STAGES = frozenset(
    {
        SpawnStage.TOKEN,
        SpawnStage.CGROUP,
        SpawnStage.JOIN_CGROUP,
        SpawnStage.STAGE,
        SpawnStage.DAEMON,
    }
)


def classify(stage: SpawnStage | None, errno: int | None) -> Side:
    """The side a start that failed at ``stage`` with ``errno`` (None: no OS error) is on.

    * an exhausted resource (:data:`NODE_ERRNOS`) is the node's wherever it happens;
    * the daemon's own stages (:data:`NODE_STAGES`) are the node's;
    * the daemon's fork and exec of its own wrapper is the node's, except
      ``E2BIG`` (the job's arguments and environment are too large) and an
      error without an OS error (a job's environment with a NUL in it);
    * everything else is the job's: its user, its program, its working folder,
      its own folders (a link put in place of a log: ``ELOOP``), a round that
      does not fit its spec, and an unknown stage (as before issue 23).
    """
    if errno is not None and errno in NODE_ERRNOS:
        return Side.NODE
    if stage in NODE_STAGES:
        return Side.NODE
    if stage is SpawnStage.FORK:
        return Side.JOB if errno is None or errno == errnos.E2BIG else Side.NODE
    return Side.JOB


def side_of(exc: WorkerSpawnError) -> Side:
    """:func:`classify` for an error as raised."""
    return classify(exc.stage, exc.errno)


def cause_of(exc: WorkerSpawnError) -> str:
    """A short name of the cause for events: ``EMFILE``, ``cgroup``, ...."""
    if exc.errno is not None:
        return errnos.errorcode.get(exc.errno, str(exc.errno))
    return exc.stage.value if exc.stage is not None else "unknown"


@dataclass(frozen=True)
class RetrySettings:
    """How the agent retries a start the node could not make."""

    grace: float = 60.0
    """Seconds from the first failure after which the node gives the job back."""
    first_delay: float = 0.25
    """Seconds before the first retry; doubled for each one after."""
    max_delay: float = 5.0
    """The longest wait between two tries."""


@dataclass(frozen=True)
class Retry:
    """Try again in ``delay`` seconds."""

    delay: float


@dataclass(frozen=True)
class GiveBack:
    """Stop trying: give the job back (leave the round, decline it for a while)."""

    waited: float
    """Seconds since the first failure."""


def decide_retry(
    first_failure: float, tries: int, now: float, settings: RetrySettings
) -> Retry | GiveBack:
    """After the ``tries``-th failed start in a row (the first at ``first_failure``), at ``now``.

    The delays double from ``first_delay`` up to ``max_delay``; the last
    wait ends at the grace, so one more try is made there; a failure at or
    after ``first_failure + grace`` gives the job back.
    """
    if tries < 1:
        raise ValueError(f"tries must be >= 1, got {tries}")
    waited = now - first_failure
    left = settings.grace - waited
    if left <= 0:
        return GiveBack(waited=waited)
    delay = min(settings.first_delay * 2 ** min(tries - 1, 30), settings.max_delay)
    return Retry(delay=min(delay, left))
