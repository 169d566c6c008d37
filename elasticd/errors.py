"""The exception tree of elasticd.

Every IO boundary translates what it catches into one of these, so callers
above it handle a small, documented set::

    ElasticdError
    ├── ConfigError              bad configuration; the daemon refuses to start
    │   └── StateFileDamaged     a state file (the daemon's database) is damaged
    ├── InvalidTransition        a state machine refused an illegal transition
    ├── ShuttingDown             the daemon no longer accepts work
    ├── StorageFull              the local disk refuses writes; no new job can be made durable
    ├── TooManyStreams           the daemon already serves its most live streams
    ├── OverShare                a caller past its share of a shared resource (429)
    │   └── OverShareBytes       ... past its share in bytes (413)
    ├── StoreError               anything the cluster store raises
    │   ├── StoreUnavailable     the store could not be reached (names the URL)
    │   │   └── StoreAuthError   the store refused this client's credentials or access
    │   ├── StoreCompacted       a watch asked for history the store no longer has
    │   ├── LeaseNotFound        the lease expired or was revoked
    │   ├── ValueTooLarge        a value over the store's size limit
    │   │   └── ListingTooLarge  a list answer over the store's size limit
    │   ├── InvalidKey           a key the store refuses (empty, '..', control chars)
    │   └── KeyForbidden         a key outside what the caller may touch (a job's token)
    ├── JobError
    │   ├── JobNotFound          no job with that id
    │   ├── JobConflict          same id, different spec; or cancel of a finished job
    │   ├── JobForbidden         the job asks for something this daemon does not allow
    │   └── LogNotFound          no such log file for that job/rank/attempt
    ├── RendezvousError          the rendezvous could not complete
    │   ├── RendezvousClosed     the job's rendezvous was closed (job is over)
    │   └── RendezvousTimeout    not enough nodes within the join timeout
    ├── WorkerSpawnError         a worker process could not be started
    └── SlurmStepError           a task of a Slurm step lost its step's job (its store host)
"""

from __future__ import annotations

import enum


class ElasticdError(Exception):
    """Base of every error elasticd raises on purpose."""


class ConfigError(ElasticdError):
    """The configuration is invalid; the message says which setting and why."""


class StateFileDamaged(ConfigError):
    """A state file is damaged; the daemon refuses to start (exit 2), naming the file and
    the recovery: a crash loop under ``Restart=on-failure`` would not mend it."""


class InvalidTransition(ElasticdError):
    """A state machine was asked for a transition it does not allow."""


class ShuttingDown(ElasticdError):
    """The daemon is stopping and accepts no new work."""


class StorageFull(ElasticdError):
    """This node's state disk refuses writes (full or failing): nothing new can be accepted."""


class TooManyStreams(ElasticdError):
    """The daemon already serves as many live streams (log follows, SSE) as it allows."""


class OverShare(ElasticdError):
    """A caller is past its share of something every caller needs (jobs, keys, requests):
    the message names the limit and the setting that raises it (:mod:`elasticd.shares`)."""


class OverShareBytes(OverShare):
    """A caller's share in bytes (its job documents, its job's store prefix) is used up."""


class StoreError(ElasticdError):
    """Base of cluster-store errors."""


class StoreUnavailable(StoreError):
    """The store could not be reached or answered with a server error."""


class StoreAuthError(StoreUnavailable):
    """The store refused this client: no or wrong credentials, or no access to a key.

    A configuration problem, not an outage: the message says which setting to change.
    It is a :class:`StoreUnavailable` so that callers that wait for the store keep
    waiting (an operator may fix the store's users while the daemon runs).
    """


class StoreCompacted(StoreError):
    """A watch asked for changes older than the history the store keeps.

    The caller must re-read the current value and watch from its version.
    """

    def __init__(self, message: str, revision: int) -> None:
        super().__init__(message)
        self.revision = revision


class LeaseNotFound(StoreError):
    """The lease does not exist: it expired or was revoked."""


class ValueTooLarge(StoreError):
    """The value is larger than the store accepts."""


class ListingTooLarge(ValueTooLarge):
    """A list answer would be larger than the store allows; list a narrower prefix."""


class InvalidKey(StoreError):
    """The key is not acceptable to the store."""


class KeyForbidden(StoreError):
    """The caller may not touch this key: a job's workers reach only their job's keys."""


class JobError(ElasticdError):
    """Base of errors about a job."""


class JobNotFound(JobError):
    """No job has that id."""


class JobConflict(JobError):
    """The request conflicts with the job's current spec or state."""


class JobForbidden(JobError):
    """The job asks for something the daemon's policy refuses (e.g. a user not allowed)."""


class LogNotFound(JobError):
    """The requested log does not exist."""


class RendezvousError(ElasticdError):
    """The rendezvous could not complete."""


class RendezvousClosed(RendezvousError):
    """The rendezvous is closed; no further rounds happen."""


class RendezvousTimeout(RendezvousError):
    """The rendezvous did not gather enough nodes in time."""


class SpawnStage(enum.Enum):
    """Where a worker's start failed: with the ``errno`` it says whose fault it was
    (:func:`elasticd.agent.nodefail.classify`)."""

    USER = "user"
    """The job's user was refused or unknown (the policy, before anything runs)."""
    TOKEN = "token"
    """The daemon could not write the job's token file (its own state folder)."""
    LOGS = "logs"
    """The worker's log folder or output pipes (the folder is the job user's)."""
    HEARTBEAT = "heartbeat"
    """The worker's heartbeat file (in the job user's folder)."""
    CGROUP = "cgroup"
    """Making the attempt's cgroup (the daemon's cgroup tree)."""
    FORK = "fork"
    """The daemon's own side of the start: pipes, memfd, fork, exec of its wrapper."""
    JOIN_CGROUP = "join_cgroup"
    """The root stage could not move the child into its cgroup (gone, or refused)."""
    STAGE = "stage"
    """A later step of the daemon's root stage (environment, user switch, parent-death signal)."""
    CWD = "cwd"
    """The job's working folder: missing, not a folder, or not the job user's to enter."""
    PROGRAM = "program"
    """The job's program: missing, not executable, or not on its PATH."""
    DAEMON = "daemon"
    """The daemon's own work around the start (an ``OSError`` none of the above caught)."""
    PLAN = "plan"
    """The round gives this node another number of workers than the job asks for."""


class WorkerSpawnError(ElasticdError):
    """A worker process could not be started (bad entrypoint, cwd, permissions; or the node).

    ``stage`` says where (None: not known, treated as the job's), ``errno``
    the OS error when there was one (else that of ``__cause__``).
    """

    def __init__(
        self, message: str, *, stage: SpawnStage | None = None, errno: int | None = None
    ) -> None:
        super().__init__(message)
        self.stage = stage
        self._errno = errno

    @property
    def errno(self) -> int | None:
        if self._errno is not None:
            return self._errno
        cause = self.__cause__
        return cause.errno if isinstance(cause, OSError) else None


class SlurmStepError(ElasticdError):
    """A task of ``elasticd run --nnodes`` in a Slurm step cannot follow the step's job: the
    store host (the first node) is lost, or task 0 never submitted the job."""
