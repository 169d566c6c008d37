"""What an agent gets from the daemon that starts it: :class:`AgentContext`, and the
job-scoped event emitter its hooks share (:class:`Emit`).

The composition root (:class:`elasticd.node.jobs.JobService`) builds one
context per agent and hands in the node's implementations of
:mod:`elasticd.agent.ports`; tests can build one cheaply.

Which side of the boundary: the daemon; declarations only.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from typing_extensions import Unpack

from elasticd.agent.attempt import NodeFacts
from elasticd.agent.nodefail import RetrySettings
from elasticd.agent.ports import Attribute, EventSink, HealthChecks, LogGrown
from elasticd.clock import SYSTEM_CLOCK, Clock
from elasticd.console import ConsoleLine
from elasticd.eventkinds import EventKind
from elasticd.logs import LogLayout
from elasticd.models import EventSource, Job, JobEdit, JobMutation
from elasticd.rendezvous import Rendezvous
from elasticd.security import Identity
from elasticd.storage import StorageHealth
from elasticd.store import Store
from elasticd.supervise.spawn import DEFAULT_POLICY, SpawnPolicy

__all__ = ["AgentContext", "ConsoleSink", "Emit", "JobUpdater"]

#: Receives the worker output that reaches the launcher's console (see elasticd.console).
ConsoleSink = Callable[[ConsoleLine], None]


class JobUpdater(Protocol):
    """``JobService.update_job``: a compare-and-set update of the job document."""

    async def __call__(
        self, job_id: str, *, mutate: JobMutation | None = None, **changes: Unpack[JobEdit]
    ) -> Job: ...


@dataclass
class AgentContext:
    """What an agent needs from its daemon; injected so tests can build one cheaply."""

    node: str
    advertise_addr: str
    daemon_url: str
    logs: LogLayout
    store: Store
    events: EventSink
    update_job: JobUpdater
    rendezvous: Rendezvous
    base_env: Mapping[str, str]
    """The daemon's environment: the operator's checks (as the daemon) start from it."""
    token_file: str | None = None
    #: Makes the job's own token on this node (its workers' ELASTICD_TOKEN_FILE, readable
    #: by the job's user only) and returns the file's path; None: ``token_file`` as it is.
    job_token: Callable[[str, Identity | None], str | None] | None = None
    cuda_visible_devices: str | None = None
    console: ConsoleSink | None = None
    clock: Clock = field(default=SYSTEM_CLOCK)
    #: Seconds without the store after which this node stops its workers (the lease TTL).
    fence_after: float = 3.0
    #: Returns once the node's lease may have expired (no renewal got through for
    #: its TTL), with the seconds since the store was last reached; the agent then
    #: fences at once. ``None``: only failed round watches count (tests).
    lease_lapsed: Callable[[], Coroutine[Any, Any, float]] | None = None
    #: The health checks run before every (re)start of a group (None: none).
    health: HealthChecks | None = None
    #: Where log files that refuse writes are reported (the daemon's storage facts).
    storage: StorageHealth | None = None
    #: The daemon's spawn policy: who jobs run as, the spawn registry, containment.
    policy: SpawnPolicy = DEFAULT_POLICY
    #: Told each time a worker's log file grows (log followers wait on it).
    log_growth: LogGrown | None = None
    #: Told the job's id each time an attempt's workers are gone and their output closed:
    #: the node's log retention runs then, not only at its periodic pass (a crash loop
    #: leaves an attempt folder a restart).
    attempt_ended: Callable[[str], None] | None = None
    #: What the job's own processes (workers, its health check) start from, before its
    #: ``env``: the daemon's allowlisted environment (:func:`~elasticd.supervise.env.job_base_env`);
    #: None: ``base_env`` whole.
    job_base_env: Mapping[str, str] | None = None
    #: How a start the node cannot make is retried before the job is given back.
    node_failure: RetrySettings = field(default_factory=RetrySettings)
    #: Notes a failure attributed to this node (its health record); None: not counted.
    attribute: Attribute | None = None
    #: How many of this node's worker slots its jobs' agents hold now (their running
    #: workers, this job's too): a ``prewarm`` job starts its standbys with its workers only
    #: beside CPUs they leave spare. None: only this job's workers count.
    busy_slots: Callable[[], int] | None = None
    #: A replica group's Lighthouse (torchft): the parent job's id -> the address of this
    #: node's Lighthouse for it (its workers' TORCHFT_LIGHTHOUSE). None: no Lighthouse here;
    #: the variable is left unset and the groups run without one.
    lighthouse: Callable[[str], Awaitable[str]] | None = None

    @property
    def job_env_base(self) -> Mapping[str, str]:
        return self.base_env if self.job_base_env is None else self.job_base_env

    def facts(self, token_file: str | None, owner_user: str | None) -> NodeFacts:
        """What an attempt's plan needs of this node, with the job's token and user."""
        return NodeFacts(
            node=self.node,
            logs=self.logs,
            base_env=self.job_env_base,
            daemon_url=self.daemon_url,
            token_file=token_file,
            cuda_visible_devices=self.cuda_visible_devices,
            owner_user=owner_user,
        )


@dataclass(frozen=True)
class Emit:
    """One job's events from this node's agent (and its hooks)."""

    events: EventSink
    job_id: str
    #: False once the job is deleted: what its agent still says (stopping its workers) is
    #: dropped, never filed under a new job of the id (another owner's, maybe).
    live: Callable[[], bool] | None = None
    #: Which job of the id (:func:`~elasticd.models.incarnation_tag`): every event says so,
    #: so one that reaches the store after the id was taken again (this node was cut off
    #: from the store, or another node's agent) is never read as the new job's.
    tag: str | None = None

    def __call__(
        self, kind: EventKind, message: str, source: EventSource = "agent", **fields: Any
    ) -> None:
        if self.live is None or self.live():
            self.events.emit(self.job_id, source, kind, message, job_tag=self.tag, **fields)

    def store_lost(self, message: str) -> bool:
        """Say ``store.lost`` for the job, once per outage (its ``store.back`` says the
        same job); True when it was said now."""
        return self.events.store_lost(self.job_id, "agent", message, tag=self.tag)
