"""The job service: what the REST routes call, and the local scheduler of agents.

Jobs live in the cluster store, one JSON document per job (``job/<id>``),
written once by the daemon that took the POST and then updated only by
compare-and-set, so every daemon serves the same answer and concurrent
updates from several nodes never lose each other. Every daemon watches the
job prefix and starts an agent for each active job whose ``node_selector``
matches its labels and that fits its free slots; the rendezvous decides which
of those agents actually run workers.

Events are recorded in this daemon's SQLite first (so an acknowledged event
is on disk) and published to the store (``ev/<job>/<node>/<seq>``) for the
merged, cluster-wide view; an event's ``seq`` in the API comes from the store
revision that created it (see :mod:`elasticd.node.events`), which gives all nodes'
events one order that keeps each node's own.

Job documents are read back through one check (``parse_job``, the cluster's
:func:`~elasticd.node.cluster.check_job_document`), so a document written into the
store by hand never names a folder outside the log root. Worker logs are
read through :func:`~elasticd.supervise.files.open_worker_file` (no link, no
FIFO, a regular file of the worker's own), in a thread.

A full or failing state disk (:mod:`elasticd.storage`): ``submit`` refuses
new jobs with :class:`~elasticd.errors.StorageFull` (507) while the disk
refuses writes, since accepting means a durable record; running jobs go on
(their events wait, in order, and land later), and each gets one
``storage.back`` event when the disk takes writes again. An agent task that
dies of an exception its own error path could not handle is never silent:
its workers are stopped, ``agent.crashed`` is recorded and the job resumes as
a new attempt like after a daemon crash (after ``MAX_AGENT_CRASHES`` within
``AGENT_CRASH_WINDOW`` this node gives the job up until it restarts, and the
job is never FAILED for it; ``_after_agent_crash``), rather than left
RUNNING unwatched.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, Literal

from typing_extensions import Unpack

from elasticd.agent.agent import AgentContext, ConsoleSink, JobAgent, decode_group
from elasticd.agent.nodefail import RetrySettings
from elasticd.clock import SYSTEM_CLOCK, Clock
from elasticd.config import Config
from elasticd.errors import (
    InvalidTransition,
    JobConflict,
    JobForbidden,
    JobNotFound,
    LogNotFound,
    ShuttingDown,
    SpawnStage,
    StorageFull,
    StoreError,
    ValueTooLarge,
    WorkerSpawnError,
)
from elasticd.eventkinds import EventKind
from elasticd.identity import (
    ADMIN,
    Action,
    Deny,
    JobFacts,
    JobTokens,
    Principal,
    PrincipalKind,
    authorize,
)
from elasticd.keys import group_key, group_prefix, job_key, keys_of_job, refusal_key
from elasticd.logs import LogLayout, stream_file
from elasticd.models import (
    Event,
    GroupView,
    Job,
    JobEdit,
    JobList,
    JobMutation,
    JobOwner,
    JobSpec,
    QueueView,
    WorkersView,
    valid_job_id,
)
from elasticd.node.cluster import JOB_PREFIX, Cluster, check_job_document, valid_node_url
from elasticd.node.db import Database
from elasticd.node.events import EventLog
from elasticd.node.health import NodeHealthChecks
from elasticd.node.logfollow import LogGrowth
from elasticd.node.retention import EndSeen, expired, seen_end
from elasticd.rendezvous import Settings, StoreRendezvous, presence_prefix
from elasticd.sched.plan import Plan
from elasticd.security import Identity
from elasticd.states import JOB_ACTIVE, JobState, WorkerState, job_transition
from elasticd.storage import Degraded, StorageHealth
from elasticd.store import Entry, Store
from elasticd.supervise.files import UnsafeWorkerFile, open_worker_file
from elasticd.supervise.spawn import DEFAULT_POLICY, boot_id
from elasticd.tasks import TaskSet

log = logging.getLogger("elasticd.node.jobs")

#: Seconds a stopping daemon spends recording why its jobs stopped (the store may not
#: acknowledge writes: a full disk under the embedded store). A restart resumes them anyway.
STOP_RECORD_TIMEOUT = 10.0

DAEMON_STOPPED = (
    "the elasticd daemon stopped while the job was running (e.g. systemctl restart); "
    "the job resumes as a new attempt when the daemon is back, no restart charged"
)
DAEMON_CRASHED = (
    "the elasticd daemon was not running (it crashed or was killed) while the job was running; "
    "the job resumes as a new attempt, no restart charged"
)
#: Agent deaths (internal errors) after which a job is FAILED instead of resumed.
MAX_AGENT_CRASHES = 3
#: Seconds within which MAX_AGENT_CRASHES deaths make this node give a job up.
AGENT_CRASH_WINDOW = 600.0
MAX_LOG_BYTES = 8 * 1024 * 1024
CAS_ATTEMPTS = 100


def owner_of(principal: Principal, user: str | None) -> JobOwner:
    """What a job keeps of its submitter: the name, and the rights the fleet applies to it.

    ``unix_user``: the user the job runs as by its owner's own right (a local
    caller's self, or one of an identity's ``users``), which every node then
    honours without ``allowed_users``; an admin's job obeys each node's policy.
    """
    own_right = principal.kind in (PrincipalKind.LOCAL, PrincipalKind.TOKEN)
    return JobOwner(
        name=principal.name,
        local=principal.unix_named,
        admin=principal.admin,
        unix_user=user if own_right and user in principal.users else None,
        may_preempt=principal.may_preempt,
        slot_quota=principal.slot_quota,
    )


def facts_of(job: Job) -> JobFacts:
    """What :func:`elasticd.identity.authorize` needs of a job."""
    owner = job.owner.name if job.owner is not None else ADMIN.name
    local = job.owner.local if job.owner is not None else False
    return JobFacts(
        owner=owner,
        owner_unix_named=local,
        user=job.spec.user,
        priority=job.spec.priority,
        job_id=job.id,
    )


#: What another identity sees of a job's env values and arguments.
HIDDEN = "<hidden>"


def redacted(job: Job) -> Job:
    """The job without what is its owner's alone: env values, arguments, health check."""
    spec = job.spec.model_copy(
        update={
            "env": dict.fromkeys(job.spec.env, HIDDEN),
            "args": [HIDDEN] if job.spec.args else [],
            "health_check": [HIDDEN] if job.spec.health_check else None,
        }
    )
    return job.model_copy(update={"spec": spec, "error": None})


def incarnation(job: Job) -> str:
    """Which job of its id ``job`` is: its log folders on each node say so (:mod:`elasticd.logs`).

    A deleted job's id may be taken again, by another owner; its files stay on disk.
    """
    owner = job.owner or JobOwner(name=ADMIN.name)
    return json.dumps([job.id, job.submitted_to, job.created_at, owner.name, owner.local])


def parse_job(job_id: str, raw: bytes) -> Job:
    """A job document from the store; a refused one is a clear JobConflict, not a crash.

    The same rule as the cluster's watch (:func:`elasticd.node.cluster.check_job_document`):
    a valid job whose id is the one in its key.
    """
    job, reason = check_job_document(job_key(job_id), raw)
    if job is None:
        raise JobConflict(
            f"the stored document of job {job_id!r} is refused: {reason}; it was not written "
            f"by elasticd: delete the store key {job_key(job_id)!r} or use another id"
        )
    return job


class JobService:
    """Jobs of the cluster as this daemon sees them, and the agents it runs."""

    def __init__(
        self,
        config: Config,
        events: EventLog,
        store: Store,
        cluster: Cluster,
        *,
        token_file: str | None = None,
        slots: int,
        gpu_ids: list[str] | None = None,
        console: ConsoleSink | None = None,
        clock: Clock = SYSTEM_CLOCK,
        base_env: dict[str, str] | None = None,
        storage: StorageHealth | None = None,
        job_base_env: dict[str, str] | None = None,
        db: Database | None = None,
    ) -> None:
        """``db``: where this node keeps when it saw jobs end (retention survives a
        restart); None keeps it in memory only."""
        self.config = config
        self.logs = LogLayout(config.logs)
        #: Log followers wait on it; the agents' output pipes tell it when a log grew.
        self.log_growth = LogGrowth()
        #: How workers are spawned (users, registry, containment): the daemon sets it.
        self.spawn_policy = DEFAULT_POLICY
        self.storage = storage
        self.events = events
        self.store = store
        self.cluster = cluster
        self.clock = clock
        self.console = console
        self._token_file = token_file
        self._slots = slots
        self._gpu_ids = gpu_ids
        self._free = list(range(slots))
        self._allocated: dict[str, list[int]] = {}
        self._agents: dict[str, JobAgent] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._done_here: set[str] = set()
        self._accepting = True
        self._base_env = dict(os.environ if base_env is None else base_env)
        #: What a job's processes start from (None: ``base_env``):
        #: :func:`elasticd.supervise.env.job_base_env`.
        self._job_base_env = job_base_env
        self._known: dict[str, Job] = {}
        self._watched = False
        #: When this node saw each finished job end, on its monotonic clock
        #: (:mod:`elasticd.node.retention`); loaded from ``db`` at the first watch.
        self._db = db
        self._boot_id = boot_id()
        self._ends: dict[str, EndSeen] = {}
        #: The fleet's plan as last seen (``sched/plan``): agents run only where it places them.
        self.plan: Plan | None = None
        #: Jobs whose agent here is being stopped because the plan no longer places them here.
        self._unplaced: set[str] = set()
        #: Work nobody awaits where it starts (slot counts, refusals, a dead agent's
        #: clean-up): owned here, finished or cancelled by stop_agents.
        self._background = TaskSet("jobs")
        #: How often each job's agent died of an internal error in this daemon's life.
        self._agent_crashes: dict[str, list[float]] = {}  # job -> when its agents died
        self._crashing: set[str] = set()  # jobs whose dead agent is being cleaned up
        if storage is not None:
            storage.on_state_back(self._storage_back)
        #: Raises WorkerSpawnError when this node refuses to run jobs as that user.
        self.check_user: Callable[..., object] | None = None
        #: The tokens of this node's jobs' workers, and the folder of their files (the
        #: daemon's own, 0711): each job's file belongs to its user, 0400.
        self.job_tokens: JobTokens | None = None
        self.token_dir: Path | None = None

    @property
    def node(self) -> str:
        return self.config.node_name

    # lifecycle

    async def recover(self) -> None:
        """After a start: a job this node was running resumes, never failed for the daemon's sake.

        A job with other live members carries on without us; this node will
        rejoin it through the normal scheduling path (as an arriving node).
        A job only this node ran was interrupted by this daemon's own stop or
        crash, not by its workers: it is marked RESTARTING with the reason
        and the scheduling path starts it again as a new attempt. No restart
        is charged (:data:`DAEMON_CRASHED`).
        """
        try:
            jobs = await self._all_jobs()
        except ValueTooLarge as exc:
            # Never a crash loop at start: serve, and say what is wrong with the store.
            log.error("cannot recover the jobs of this node: %s", exc)
            return
        for job in jobs:
            if job.state not in JOB_ACTIVE or job.launcher != "elasticd":
                continue
            ours = await self.store.get(group_key(job.id, self.node))
            if ours is not None:
                await self._mark_stopped(ours)
            members = await self._live_members(job.id)
            if members - {self.node}:
                continue
            if ours is None and self.node not in members and not self._started_here(job.id):
                continue
            self.events.emit(job.id, "daemon", EventKind.JOB_RESUMED, DAEMON_CRASHED)
            if job.state is JobState.RUNNING:
                with contextlib.suppress(InvalidTransition):
                    await self.update_job(
                        job.id, state=JobState.RESTARTING, reason="the daemon was restarted"
                    )

    async def _mark_stopped(self, entry: Entry) -> None:
        """Our group view from before the restart: its workers died with the daemon."""
        view = decode_group(entry.value)
        if view is None or view.state.is_terminal or view.state is WorkerState.STOPPED:
            return
        view.state = WorkerState.STOPPED
        view.updated_at = self.clock.time()
        for worker in view.workers:
            if not worker.state.is_terminal:
                worker.state = WorkerState.STOPPED
        await self.store.compare_and_set(
            entry.key, view.model_dump_json().encode(), entry.version
        )  # a lost race means a newer view was written: fine

    def _started_here(self, job_id: str) -> bool:
        """Whether this node's own event log says it started workers of the job."""
        after = 0
        while batch := self.events.read(job_id, after=after, limit=1000):
            if any(e.kind == EventKind.WORKERS_STARTED for e in batch):
                return True
            after = batch[-1].seq
        return False

    def stop_accepting(self) -> None:
        self._accepting = False

    @property
    def accepting(self) -> bool:
        return self._accepting

    async def stop_agents(self) -> None:
        """Stop every agent: each stops its workers (shielded) and leaves the rendezvous.

        A job no other live node is part of is then RESTARTING, with an event
        that says why: it resumes when a daemon takes it up again.
        """
        self._accepting = False
        tasks = list(self._tasks.items())
        for _, task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*(t for _, t in tasks), return_exceptions=True)
        # Bounded: with a disk that refuses writes the store acknowledges nothing, and a
        # stop must still end (a restarted daemon resumes these jobs: ``recover``).
        bound = STOP_RECORD_TIMEOUT
        if self.storage is not None and self.storage.state_degraded() is not None:
            bound = 2.0  # nothing is acknowledged before the disk frees; do not wait long
        deadline = asyncio.get_running_loop().time() + bound
        for job_id, _ in tasks:
            try:
                async with asyncio.timeout_at(deadline):
                    await self._record_stop(job_id)
            except TimeoutError:
                log.warning("job %s: could not record the daemon stop in time", job_id)
        # A dead agent's clean-up stops its workers: let it finish (bounded) before the rest
        # is cancelled, so nothing of the service outlives it.
        await self._background.aclose(grace=max(0.0, deadline - asyncio.get_running_loop().time()))

    async def _record_stop(self, job_id: str) -> None:
        """After this daemon stopped its agent: the job resumes later, and says why."""
        try:
            job = await self.get(job_id)
            if job.state.is_terminal or await self._live_members(job_id) - {self.node}:
                return
            # Not the job's failure: it resumes when this daemon (or another node) is back.
            self.events.emit(job_id, "daemon", EventKind.DAEMON_STOPPED, DAEMON_STOPPED)
            if job.state is JobState.RUNNING:
                await self.update_job(
                    job_id, state=JobState.RESTARTING, reason="the daemon stopped"
                )
        except (StoreError, InvalidTransition, JobNotFound) as exc:
            log.warning("job %s: could not record the daemon stop: %s", job_id, exc)

    async def _live_members(self, job_id: str) -> set[str]:
        """Nodes whose presence key in the job's rendezvous is alive."""
        prefix = presence_prefix(job_id)
        listing = await self.store.list(prefix)
        return {e.key[len(prefix) :] for e in listing.entries}

    # writes

    async def submit(self, spec: JobSpec, principal: Principal = ADMIN) -> tuple[Job, bool]:
        """Accept a job of ``principal``. Returns (job, created); same id + same spec + same
        owner returns the existing one.

        Who it runs as is decided here, once, by :func:`elasticd.identity.authorize`:
        the submitter's own user by default (a local caller), an identity's first
        user, or the node's ``run_as`` for the admin; every node then checks that
        user against its own policy before anything of the job runs.
        """
        decision = authorize(
            principal,
            Action.SUBMIT,
            JobFacts(owner=principal.name, user=spec.user, priority=spec.priority),
        )
        if isinstance(decision, Deny):
            raise JobForbidden(decision.reason)
        if decision.user != spec.user:
            spec = spec.model_copy(update={"user": decision.user})
        owner = owner_of(principal, decision.user)
        if not self._accepting:
            raise ShuttingDown("the daemon is shutting down and accepts no new jobs")
        degraded = self.storage.state_degraded() if self.storage is not None else None
        if degraded is not None:
            # Accepting means a durable record; the disk cannot make one now. Refuse, so
            # that nothing acknowledged can be lost and nothing unacknowledged runs.
            raise StorageFull(
                f"node {self.node} cannot accept jobs: its disk refuses writes since "
                f"{degraded.since:.0f} ({degraded.source}: {degraded.reason}); "
                "try again when space is freed, or submit to another node"
            )
        if self.check_user is not None:
            try:
                self.check_user(spec.user, owner_user=owner.unix_user)
            except WorkerSpawnError as exc:
                raise JobForbidden(str(exc)) from None
        job_id = spec.id or uuid.uuid4().hex[:12]
        spec = spec.model_copy(update={"id": job_id})
        job = Job(
            id=job_id,
            spec=spec,
            state=JobState.PENDING,
            max_restarts=spec.max_restarts,
            created_at=self.clock.time(),
            submitted_to=self.node,
            owner=owner,
        )
        result = await self.store.compare_and_set(
            job_key(job_id), job.model_dump_json().encode(), None
        )
        if not result.ok:
            assert result.entry is not None
            existing = parse_job(job_id, result.entry.value)
            before = existing.owner or JobOwner(name=ADMIN.name)
            same_owner = (before.name, before.local) == (owner.name, owner.local)
            if existing.spec.without_id() == spec.without_id() and same_owner:
                return existing, False
            if not same_owner:
                raise JobConflict(f"job id {job_id!r} is taken by another owner; choose another id")
            raise JobConflict(
                f"job {job_id!r} exists with a different spec; choose another id "
                "or submit the identical spec to get the existing job"
            )
        self.events.emit(
            job_id,
            "daemon",
            EventKind.JOB_SUBMITTED,
            f"job accepted by {self.node}: {spec.nproc_per_node} x {spec.entrypoint} "
            f"{' '.join(spec.args)}".rstrip(),
            state=JobState.PENDING.value,
        )
        return job, True

    async def authorized(self, job_id: str, principal: Principal, action: Action) -> Job:
        """The job, when ``principal`` may do ``action`` to it; ``JobForbidden`` (403) if not."""
        job = await self.get(job_id)
        decision = authorize(principal, action, facts_of(job))
        if isinstance(decision, Deny):
            raise JobForbidden(decision.reason)
        return job

    def as_seen_by(self, job: Job, principal: Principal) -> Job:
        """The job as ``principal`` may see it: its spec's env and args are its owner's."""
        if authorize(principal, Action.READ_DETAIL, facts_of(job)):
            return job
        return redacted(job)

    async def cancel(self, job_id: str) -> Job:
        job = await self.get(job_id)
        if job.launcher != "elasticd":
            raise JobConflict(
                f"job {job_id!r} is run by {job.launcher}, not by elasticd: stop its "
                f"{job.launcher} processes"
            )
        if job.state.is_terminal:
            raise JobConflict(
                f"job {job_id!r} already ended as {job.state.value}; nothing to cancel"
            )
        self.events.emit(
            job_id, "daemon", EventKind.JOB_CANCEL_REQUESTED, f"cancel requested on {self.node}"
        )
        job = await self.update_job(job_id, state=JobState.CANCELLED, reason="cancelled by user")
        # Closing the rendezvous tells every node's agent to stop its workers.
        await self._close_rendezvous(job_id)
        return job

    async def expire(self, retention: float) -> list[str]:
        """Delete the jobs that ended more than ``retention`` seconds ago; their ids.

        Every daemon may run this: a job deleted meanwhile by another one is
        skipped (the deletion is a compare-and-set on the job document).
        """
        # Measured from when this node saw the end, on its monotonic clock: the document's
        # finished_at is another node's wall clock, which may be hours off this one's.
        finished = [job for job in self._known.values() if job.state.is_terminal]
        deleted = []
        for job_id in expired(finished, self._ends, self.clock.monotonic(), retention):
            try:
                await self.delete(job_id)
            except (JobNotFound, JobConflict):
                continue
            deleted.append(job_id)
        if deleted:
            log.info("deleted %d job(s) finished over %.0f s ago", len(deleted), retention)
        if self._watched:
            # Events of jobs deleted while this daemon was down: nobody else drops them.
            # Their times are this node's own clock, and only jobs gone from the store
            # lose them, so a step of the clock cannot delete a live job's events.
            cutoff = self.clock.time() - retention
            for job_id in self.events.quiet_since(cutoff):
                if job_id not in self._known:
                    self.events.forget(job_id)
        return deleted

    async def delete(self, job_id: str) -> None:
        """Forget a finished job: its document, events, groups and rendezvous keys.

        Worker log files stay on disk (they are the user's data). A job that
        has not ended cannot be deleted: cancel it first; a torchrun-launched
        run with no live torchrun left may be deleted in any state.
        """
        job = await self.get(job_id)
        abandoned = job.launcher != "elasticd" and not await self._live_members(job_id)
        if not job.state.is_terminal and not abandoned:
            # A torchrun run whose torchruns are all gone (stopped by a signal, torch's
            # launcher skips its shutdown then) keeps its last state for ever: it may go.
            raise JobConflict(f"job {job_id!r} is {job.state.value}; cancel it before deleting it")
        entry = await self.store.get(job_key(job_id))
        if entry is None or not await self.store.delete(job_key(job_id), entry.version):
            raise JobConflict(f"job {job_id!r} changed while being deleted; try again")
        for prefix in keys_of_job(job_id):
            for item in (await self.store.list(prefix)).entries:
                await self.store.delete(item.key)
        self.events.forget(job_id)
        self._done_here.discard(job_id)
        self._forget_end(job_id)

    async def _close_rendezvous(self, job_id: str) -> None:
        rdzv = self._rendezvous(await self.get(job_id))
        with contextlib.suppress(StoreError):
            await rdzv.close()

    async def update_job(
        self, job_id: str, *, mutate: JobMutation | None = None, **changes: Unpack[JobEdit]
    ) -> Job:
        """Change the job document by compare-and-set; state changes are checked and evented.

        ``changes`` are set as given; ``mutate(job)`` decides more from the
        current document (and may run again when another node's write wins).
        A ``state`` that is already the job's state is not a change. Terminal
        states are final: asking to leave one raises ``InvalidTransition``.
        """
        for _ in range(CAS_ATTEMPTS):
            entry = await self.store.get(job_key(job_id))
            if entry is None:
                raise JobNotFound(f"no job with id {job_id!r}")
            job = parse_job(job_id, entry.value)
            new = self._apply(job, changes, mutate)
            if new == job:
                return job
            if new.state is not job.state:
                # Whoever sees the new state must also see every event that led to it.
                await self.events.flush()
            result = await self.store.compare_and_set(
                job_key(job_id), new.model_dump_json().encode(), entry.version
            )
            if result.ok:
                if new.state is not job.state:
                    self.events.emit(
                        job_id,
                        "daemon",
                        EventKind.JOB_STATE,
                        f"job {job.state.value} -> {new.state.value}"
                        + (f": {new.reason}" if new.reason else ""),
                        state=new.state.value,
                        error=new.error if new.state is JobState.FAILED else None,
                    )
                    if new.state.is_terminal:
                        # A finished job's last word is in the store before anyone acts on
                        # the end (a shutdown, a deletion). On the restart path the event
                        # goes out with the publisher's next batch instead of delaying it.
                        await self.events.flush()
                return new
        raise StoreError(f"job {job_id}: too many concurrent updates")  # pragma: no cover

    def _apply(self, job: Job, given: JobEdit, mutate: JobMutation | None) -> Job:
        changes: JobEdit = {**given, **(mutate(job) if mutate is not None else {})}
        target = changes.pop("state", None)
        now = self.clock.time()
        updates: dict[str, Any] = {k: v for k, v in changes.items() if getattr(job, k) != v}
        if target is not None and target is not job.state:
            job_transition(job.state, target)
            updates["state"] = target
            if target is JobState.RUNNING and job.started_at is None:
                updates["started_at"] = now
            if target.is_terminal:
                updates["finished_at"] = now
        elif job.state.is_terminal and updates:
            raise InvalidTransition(f"job {job.id} already ended as {job.state.value}")
        return job.model_copy(update=updates) if updates else job

    # reads

    async def get(self, job_id: str) -> Job:
        entry = await self.store.get(job_key(job_id))
        if entry is None:
            raise JobNotFound(f"no job with id {job_id!r}")
        return self._as_served(parse_job(job_id, entry.value))

    def _as_served(self, job: Job) -> Job:
        """The job with its place in the fleet's plan (queue entry, nodes) filled in."""
        if self.plan is None or job.state.is_terminal:
            return job
        nodes = self.plan.nodes_of(job.id)
        return job.model_copy(update={"queue": self.plan.entry(job.id), "nodes": nodes or None})

    def queue(self) -> QueueView:
        """The fleet's queue in order, and where the placed jobs run (``GET /queue``)."""
        plan = self.plan or Plan()
        return QueueView(
            queue=list(plan.queue),
            placements={j: p.model_copy() for j, p in plan.placements.items()},
        )

    async def _all_jobs(self) -> list[Job]:
        from elasticd.node.cluster import parse_jobs

        return parse_jobs((await self.store.list(JOB_PREFIX)).entries)

    async def list_jobs(self, state: list[JobState] | None, limit: int, offset: int) -> JobList:
        jobs = await self._all_jobs()
        if state is not None:
            wanted = set(state)
            jobs = [j for j in jobs if j.state in wanted]
        jobs.sort(key=lambda j: (-j.created_at, j.id))
        page = [self._as_served(j) for j in jobs[offset : offset + limit]]
        next_offset = offset + len(page) if offset + len(page) < len(jobs) else None
        return JobList(jobs=page, total=len(jobs), next_offset=next_offset)

    async def workers(self, job_id: str) -> WorkersView:
        job = await self.get(job_id)
        listing = await self.store.list(group_prefix(job_id))
        groups = [g for g in (decode_group(e.value) for e in listing.entries) if g]
        agent = self._agents.get(job_id)
        if agent is not None:
            agent.refresh_progress()
        if agent is not None and agent.view is not None:  # our own group: freshest copy
            groups = [g for g in groups if g.node != agent.view.node] + [agent.view]
        current = [g for g in groups if g.round == job.round] or groups
        current = [await self._as_seen(g) for g in current]
        return WorkersView(
            job_id=job.id,
            state=job.state,
            restart_count=job.restart_count,
            max_restarts=job.max_restarts,
            remaining_restarts=max(0, job.max_restarts - job.restart_count),
            round=job.round,
            groups=sorted(current, key=lambda g: (g.group_rank, g.node)),
        )

    async def _as_seen(self, group: GroupView) -> GroupView:
        """A running group of a node that is gone (its lease expired) is shown UNKNOWN.

        Its agent can no longer publish, so its last view (HEALTHY, with pids)
        may no longer be true; a view is thus never more than a lease stale.
        """
        if group.node == self.node or group.state.is_terminal:
            return group
        if group.state is WorkerState.STOPPED or await self.cluster.node(group.node) is not None:
            return group
        workers = [
            w if w.state.is_terminal else w.model_copy(update={"state": WorkerState.UNKNOWN})
            for w in group.workers
        ]
        return group.model_copy(update={"state": WorkerState.UNKNOWN, "workers": workers})

    async def list_events(self, job_id: str, after: int, limit: int) -> list[Event]:
        await self.get(job_id)
        return (await self.events.cluster_events(job_id, after))[:limit]

    async def follow_events(self, job_id: str, after: int, timeout: float) -> list[Event]:
        await self.get(job_id)
        return await self.events.follow_cluster(job_id, after, timeout)

    async def wait(self, job_id: str, timeout: float | None = None) -> Job:
        """Wait until the job is terminal (for ``elasticd run`` and tests)."""
        async with asyncio.timeout(timeout):
            key = job_key(job_id)
            while True:
                # Watch from the listing's revision, not the document's version: an old
                # version may be past the store's history (StoreCompacted at once, a spin).
                listing = await self.store.list(key)
                entry = next((e for e in listing.entries if e.key == key), None)
                if entry is None:
                    raise JobNotFound(f"no job with id {job_id!r}")
                job = parse_job(job_id, entry.value)
                if job.state.is_terminal:
                    return job
                with contextlib.suppress(StoreError):
                    await self.store.watch(key, listing.revision, 30.0)

    async def retain_logs(self, job_ids: list[str] | None = None) -> dict[str, list[int]]:
        """Apply log retention (``log_retention_*``) to these jobs' folders (default: all).

        A job whose agent runs here keeps its newest folder whatever the
        policy says (it may be the running attempt's). Returns what went.
        """
        removed: dict[str, list[int]] = {}
        for job_id in job_ids if job_ids is not None else self.logs.job_ids():
            if not valid_job_id(job_id):
                continue
            gone = await asyncio.to_thread(
                self.logs.retain,
                job_id,
                self.config.log_retention_attempts,
                self.config.log_retention_bytes,
                job_id in self._agents,
            )
            if gone:
                removed[job_id] = gone
                log.info("job %s: log retention removed %d attempt folders", job_id, len(gone))
        return removed

    def log_attempts(self, job_id: str, incarnation: str) -> list[int]:
        """The attempts of the job that have a log folder on this node, oldest first.

        ``incarnation`` (:func:`incarnation`): the job asked about; a folder left by
        an earlier job of that id (deleted, its id taken again) has none of its attempts.
        """
        if not valid_job_id(job_id) or not self.logs.belongs(job_id, incarnation):
            return []
        return self.logs.attempts(job_id)

    def open_log(
        self,
        job_id: str,
        local_rank: int,
        stream: Literal["stdout", "stderr"],
        attempt: int | None,
        *,
        incarnation: str,
    ) -> BinaryIO:
        """One worker log of this node, opened for reading; ``LogNotFound`` when there is none.

        Blocking (run it in a thread from the event loop). The file is opened
        through :func:`~elasticd.supervise.files.open_worker_file` only: a link,
        a FIFO or a hard link the worker put in its place is refused, never read.
        Only a folder of the job ``incarnation`` names is read: an earlier job of
        that id (deleted, its id taken again, maybe by another owner) is another's.
        """
        if not valid_job_id(job_id):
            raise LogNotFound(f"{job_id!r} is not a valid job id")
        if not self.logs.belongs(job_id, incarnation):
            raise LogNotFound(f"job {job_id!r} has no logs on node {self.node}")
        if attempt is None:
            attempts = self.log_attempts(job_id, incarnation)
            if not attempts:
                raise LogNotFound(f"job {job_id!r} has no logs on node {self.node}")
            attempt = attempts[-1]
        where = f"job {job_id!r}, attempt {attempt}, local rank {local_rank} on node {self.node}"
        worker_dir = self.logs.worker_dir(job_id, attempt, local_rank)
        try:
            fd = open_worker_file(worker_dir, stream_file(stream))
        except FileNotFoundError:
            raise LogNotFound(f"no {stream} log for {where}") from None
        except UnsafeWorkerFile:
            raise LogNotFound(
                f"the {stream} log of {where} is not a regular file of the worker's own (the "
                "job replaced it, e.g. with a link or a FIFO); the daemon does not read it"
            ) from None
        except OSError as exc:
            raise LogNotFound(
                f"the {stream} log of {where} cannot be read: {exc.strerror or exc}"
            ) from None
        return os.fdopen(fd, "rb", buffering=0)

    async def read_log(
        self,
        job: Job,
        local_rank: int,
        stream: Literal["stdout", "stderr"],
        attempt: int | None,
        tail: int | None,
    ) -> str:
        """The last :data:`MAX_LOG_BYTES` of one worker log (the last ``tail`` lines), as text."""
        which = incarnation(job)

        def read() -> bytes:
            with self.open_log(job.id, local_rank, stream, attempt, incarnation=which) as fh:
                size = os.fstat(fh.fileno()).st_size
                if size > MAX_LOG_BYTES:
                    fh.seek(size - MAX_LOG_BYTES)
                chunks = []
                got = 0
                while got < MAX_LOG_BYTES and (chunk := fh.read(MAX_LOG_BYTES - got)):
                    chunks.append(chunk)
                    got += len(chunk)
                return b"".join(chunks)

        text = (await asyncio.to_thread(read)).decode("utf-8", errors="replace")
        if tail is not None:
            lines = text.splitlines(keepends=True)
            text = "".join(lines[-tail:]) if tail > 0 else ""
        return text

    async def check_log(
        self,
        job: Job,
        local_rank: int,
        stream: Literal["stdout", "stderr"],
        attempt: int | None,
    ) -> None:
        """Raise ``LogNotFound`` unless the log can be opened now."""
        fh = await asyncio.to_thread(
            functools.partial(
                self.open_log, job.id, local_rank, stream, attempt, incarnation=incarnation(job)
            )
        )
        fh.close()

    async def node_url(self, node: str) -> str:
        """The API address of another live node, for proxying its logs (the token goes there).

        Only a record bound to a lease (a daemon keeps it alive) and naming
        ``http(s)://host:port`` and nothing more is used.
        """
        record = await self.cluster.node(node)
        if record is None:
            raise LogNotFound(f"node {node!r} is not a live member of the cluster")
        if not valid_node_url(record.url):
            raise LogNotFound(
                f"node {node!r} publishes the address {record.url!r}, which is not "
                "http(s)://host:port; its logs are not fetched"
            )
        return record.url

    # scheduling

    def on_refused(self, key: str, reason: str) -> None:
        """A job document in the store was refused (see ``Cluster``): say so, touch nothing.

        With a valid job id in its key the refusal is an event of that job;
        otherwise there is no job to attach it to, and a record under
        ``refused/<node>/`` in the store says it (the daemon's log has it too).
        """
        job_id = key.removeprefix(JOB_PREFIX)
        message = (
            f"node {self.node} refused the job document at store key {key!r}: {reason}. No "
            "agent runs it and nothing on disk is touched; delete the key or write a job "
            "through the API"
        )
        if key.startswith(JOB_PREFIX) and valid_job_id(job_id):
            self.events.emit(job_id, "daemon", EventKind.JOB_REFUSED, message)
            return
        record = json.dumps(
            {"key": key, "reason": reason, "node": self.node, "time": self.clock.time()}
        ).encode()
        digest = hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()[:32]
        self._background.spawn(
            self._record_refusal(refusal_key(self.node, digest), record), name="record-refusal"
        )

    async def _record_refusal(self, key: str, record: bytes) -> None:
        try:
            await self.store.put(key, record)
        except StoreError as exc:
            log.warning("cannot record the refusal under %s: %s", key, exc)

    def on_jobs(self, jobs: list[Job]) -> None:
        """Called with every job document whenever one changes."""
        first = not self._watched
        self._watched = True  # _known now mirrors the store
        known = {j.id: j for j in jobs}
        for gone in self._known.keys() - known.keys():
            # Deleted (by a user, or by retention) on some daemon: drop our records too.
            self.events.forget(gone)
            self._done_here.discard(gone)
            self._agent_crashes.pop(gone, None)
            self._forget_end(gone)
        self._known = known
        self._see_ends(first)
        self._reconcile()

    def _see_ends(self, first: bool) -> None:
        """Record when this node first saw each finished job end (retention counts from it)."""
        if first and self._db is not None and self._db.is_open:
            self._ends = self._db.job_ends()  # from before a restart: still counting
        now = self.clock.monotonic()
        for job_id in list(self._ends):
            job = self._known.get(job_id)
            if job is None or not job.state.is_terminal:  # deleted while down, or id reused
                self._forget_end(job_id)
        for job in self._known.values():
            if not job.state.is_terminal:
                continue
            before = self._ends.get(job.id)
            end = seen_end(job, before, self._boot_id, now)
            if end != before:
                self._ends[job.id] = end
                if self._db is not None and self._db.is_open:
                    self._db.record_job_end(job.id, end)

    def _forget_end(self, job_id: str) -> None:
        if self._ends.pop(job_id, None) is not None and self._db is not None and self._db.is_open:
            self._db.forget_job_end(job_id)

    def store_answers(self) -> None:
        """The store answers again (this node's lease was renewed).

        A job told ``store.lost`` whose agent no longer runs here (the plan
        dropped this node meanwhile, or the agent ended) gets its ``store.back``
        now; a running agent says it itself once the store serves its round.
        """
        for job_id in self.events.store_lost_jobs():
            if job_id not in self._agents:
                self.events.store_back(job_id)

    def on_plan(self, plan: Plan) -> None:
        """Called with the fleet's plan whenever it changes (:mod:`elasticd.node.scheduler`)."""
        self.plan = plan
        self._reconcile()

    def _reconcile(self) -> None:
        """Start the agents the plan places here; stop the ones it no longer places here.

        A placement is a share of this node's slots held for the job; the
        agent starts as soon as the slots are free here (a job the plan took
        them from may still be stopping its workers within their grace).
        """
        if not self._accepting or self.plan is None:
            return
        plan = self.plan
        for job in sorted(self._known.values(), key=lambda j: (-j.spec.priority, j.created_at)):
            if job.state not in JOB_ACTIVE:
                continue
            here = self.node in plan.nodes_of(job.id)
            if job.id in self._agents:
                if not here and job.id not in self._unplaced:
                    self._stop_unplaced(job.id)
                continue
            if (
                not here
                or job.launcher != "elasticd"  # torch's agents run it: shown, never run
                or job.id in self._done_here
                or job.id in self._crashing  # its dead agent's workers are still being stopped
                or job.spec.nproc_per_node > len(self._free)
            ):
                continue
            self._start_agent(job)

    def _stop_unplaced(self, job_id: str) -> None:
        """The plan took this node from the job (preempted, shrunk, spare given back)."""
        self._unplaced.add(job_id)
        task = self._tasks.get(job_id)
        agent = self._agents.get(job_id)
        if agent is not None:
            agent.leave_first = True
        if task is not None:
            log.info("job %s: no longer placed on %s; stopping its agent", job_id, self.node)
            task.cancel()  # stops the workers with their grace and leaves the rendezvous

    async def _after_unplaced(self, job_id: str) -> None:
        """A job the plan no longer places anywhere goes back to PENDING (queued), uncharged."""
        plan = self.plan
        if plan is None or plan.nodes_of(job_id):
            return  # still placed elsewhere (shrunk) or here again: nothing to record
        entry = plan.entry(job_id)
        reason = f"waiting in the queue: {entry.message}" if entry else "waiting in the queue"

        def back_to_queue(job: Job) -> JobEdit:
            # Its workers were stopped for another job: a failure they met on the way out
            # (a peer already stopped) is never charged; not even one recorded later.
            edit: JobEdit = {
                "pending_failure": None,
                "charged_round": max(job.charged_round, job.round),
            }
            if job.state in (JobState.RUNNING, JobState.RESTARTING):
                edit |= {"state": JobState.PENDING, "reason": reason}
            return edit

        try:
            job = await self.get(job_id)
            if not job.state.is_terminal:
                await self.update_job(job_id, mutate=back_to_queue)
        except (StoreError, InvalidTransition, JobNotFound, JobConflict) as exc:
            log.warning("job %s: could not record its return to the queue: %s", job_id, exc)

    def _rendezvous(self, job: Job) -> StoreRendezvous:
        spec = job.spec
        assert spec.max_nodes is not None
        return StoreRendezvous(
            self.store,
            job.id,
            node=self.node,
            role=spec.role,
            local_world_size=spec.nproc_per_node,
            advertise_addr=self.config.advertise,
            settings=Settings(
                min_nodes=spec.min_nodes,
                max_nodes=spec.max_nodes,
                join_timeout=spec.join_timeout,
                last_call_timeout=spec.last_call_timeout,
            ),
            lease=self.cluster.lease,
            master_addr=spec.master_addr,
            master_port=spec.master_port,
            clock=self.clock,
        )

    def _start_agent(self, job: Job) -> None:
        slots = self._free[: job.spec.nproc_per_node]
        del self._free[: job.spec.nproc_per_node]
        self._allocated[job.id] = slots
        cuda = None
        if self._gpu_ids is not None:
            cuda = ",".join(self._gpu_ids[s] for s in slots)
        ctx = AgentContext(
            node=self.node,
            advertise_addr=self.config.advertise,
            daemon_url=self.config.url,
            logs=self.logs,
            store=self.store,
            events=self.events,
            update_job=self.update_job,
            rendezvous=self._rendezvous(job),
            base_env=self._base_env,
            job_base_env=self._job_base_env,
            token_file=self._token_file,
            cuda_visible_devices=cuda,
            console=self.console,
            clock=self.clock,
            fence_after=self.config.lease_ttl,
            lease_lapsed=self.cluster.lease_lapsed,
            health=NodeHealthChecks(
                base_env=self._base_env,
                job_base_env=self._job_base_env,
                node_command=self.config.health_check,
                nvidia_smi=self.config.nvidia_smi,
                policy=self.spawn_policy,
            ),
            storage=self.storage,
            policy=self.spawn_policy,
            job_token=self._job_token if self.job_tokens is not None else None,
            log_growth=self.log_growth.grew,
            node_failure=RetrySettings(grace=self.config.node_failure_grace),
        )
        agent = JobAgent(job, ctx)
        try:
            # The job's log folder is this job's: one left by an earlier job of this id
            # (deleted, the id taken again) is moved aside, never read or appended to.
            self.logs.claim(job.id, incarnation(job))
        except OSError as exc:  # its logs are then not served (no folder names it)
            log.warning("job %s: cannot claim its log folder: %s", job.id, exc)
        # A job this node ran before (before a daemon restart) goes on with the next
        # attempt number: its earlier attempts' logs stay where they are.
        agent.spawn_seq = self.logs.last_attempt(job.id)
        self._agents[job.id] = agent
        task = asyncio.create_task(agent.run(), name=f"agent-{job.id}")
        self._tasks[job.id] = task
        task.add_done_callback(self._agent_done(job.id))
        self._publish_slots()

    def _job_token(self, job_id: str, identity: Identity | None) -> str | None:
        """Make the job's token on this node, in a file only its user reads; the path.

        Only for a job that runs as another user than the daemon's: one that
        runs as the daemon's own user (``elasticd run``, a user's own daemon)
        could read the daemon's token file anyway, and gets its path, as before.
        The folder is the daemon's and no job may write it, so the file is
        made where it is meant to be (no link can redirect it), then handed to
        the job's user. A new token replaces the job's previous one here.
        """
        if identity is None:
            return self._token_file
        assert self.job_tokens is not None
        assert self.token_dir is not None
        token = self.job_tokens.mint(job_id)
        path = self.token_dir / f"{job_id}.token"
        temp = self.token_dir / f".{job_id}.{uuid.uuid4().hex[:8]}"
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o400)
            try:
                os.write(fd, token.encode() + b"\n")
                if identity is not None:
                    os.fchown(fd, identity.uid, identity.gid)
            finally:
                os.close(fd)
            os.replace(temp, path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                temp.unlink()
            raise WorkerSpawnError(
                f"cannot write the job's token file {path}: {exc}", stage=SpawnStage.TOKEN
            ) from exc
        return str(path)

    def _forget_token(self, job_id: str) -> None:
        if self.job_tokens is None or self.token_dir is None:
            return
        self.job_tokens.revoke(job_id)
        with contextlib.suppress(OSError):
            (self.token_dir / f"{job_id}.token").unlink()

    def _agent_done(self, job_id: str) -> Callable[[asyncio.Task[None]], None]:
        def done(task: asyncio.Task[None]) -> None:
            self._forget_token(job_id)
            agent = self._agents.pop(job_id, None)
            self._tasks.pop(job_id, None)
            crash = None if task.cancelled() else task.exception()
            if crash is not None and agent is not None:
                # The agent's own error path raised: never silent. Its workers are
                # stopped before its slots are given back, and the job is not left
                # RUNNING with nobody supervising it (_after_agent_crash).
                log.error(
                    "the agent of job %s died: %s: %s",
                    job_id,
                    type(crash).__name__,
                    crash,
                    exc_info=crash,
                )
                # No new agent until the dead one's workers are stopped and its slots,
                # taken now, are given back (a new agent would get the same ones).
                self._crashing.add(job_id)
                slots = self._allocated.pop(job_id, [])
                self._background.spawn(
                    self._after_agent_crash(job_id, agent, crash, slots),
                    name=f"agent-crash-{job_id}",
                )
                return
            # The job is done here (for now): its old attempts' logs go (log retention).
            self._background.spawn(self.retain_logs([job_id]), name=f"log-retention-{job_id}")
            if job_id in self._unplaced:
                self._unplaced.discard(job_id)
                self._background.spawn(self._after_unplaced(job_id), name=f"unplaced-{job_id}")
            elif not task.cancelled():
                self._done_here.add(job_id)  # declined (published with the slots) if active
                if agent is not None and agent.gave_back:
                    # The node's own trouble (elasticd.agent.nodefail): declined for a
                    # while so another node may take it, then this one tries again.
                    self._background.spawn(
                        self._take_back_later(job_id, self.config.node_failure_grace),
                        name=f"take-back-{job_id}",
                    )
            self._release(job_id)
            self._reconcile()

        return done

    async def _take_back_later(self, job_id: str, after: float) -> None:
        """Stop declining a job this node gave back for its own trouble, ``after`` seconds on.

        On a single node that is when the job is tried again (it waited PENDING or
        RESTARTING meanwhile, with the reason); elsewhere another node may have it.
        """
        await asyncio.sleep(max(after, 1.0))
        if job_id in self._done_here and job_id not in self._agents:
            log.info("job %s: %s takes it up again after giving it back", job_id, self.node)
            self._done_here.discard(job_id)
            self._publish_slots()
            self._reconcile()

    def _storage_back(self, first: Degraded, seconds: float) -> None:
        """The state disk takes writes again: each job run here gets one event saying so.

        Emitted after everything the backlog held (it lands in order behind it).
        """
        for job_id in list(self._agents):
            self.events.emit(
                job_id,
                "daemon",
                EventKind.STORAGE_BACK,
                f"{self.node} could not write its state for {seconds:.1f} s ({first.source}: "
                f"{first.reason}); what happened meanwhile was kept in memory and is now "
                "recorded, in order",
                duration_s=seconds,
            )

    def _release(self, job_id: str) -> None:
        self._free.extend(self._allocated.pop(job_id, []))
        self._free.sort()
        self._publish_slots()

    async def _after_agent_crash(
        self, job_id: str, agent: JobAgent, crash: BaseException, slots: list[int]
    ) -> None:
        """An agent task died of an exception its own handler could not deal with.

        Decision: that is this daemon's fault, not the job's workers', so it is
        treated as a crash of the daemon (issue 12, 11): the agent's workers
        are stopped and it leaves the rendezvous, ``agent.crashed`` names the
        error, the job is RESTARTING and resumes as a new attempt under a new
        agent, no restart charged. A bug that kills every agent would loop, so
        after :data:`MAX_AGENT_CRASHES` deaths within :data:`AGENT_CRASH_WINDOW`
        this node gives the job up until the daemon restarts (other nodes carry
        on without it). The job is never FAILED for it: only its workers or its
        budget may fail a job. Never left RUNNING unwatched.
        """
        now = self.clock.monotonic()
        recent = [t for t in self._agent_crashes.get(job_id, []) if now - t < AGENT_CRASH_WINDOW]
        recent.append(now)
        self._agent_crashes[job_id] = recent
        error = f"{type(crash).__name__}: {crash}"
        give_up = len(recent) >= MAX_AGENT_CRASHES
        try:
            with contextlib.suppress(Exception):
                await agent.abandon()
            if give_up:
                self.events.emit(
                    job_id,
                    "daemon",
                    EventKind.AGENT_CRASHED,
                    f"the agent on {self.node} died of an internal error {len(recent)} times in "
                    f"{AGENT_CRASH_WINDOW:.0f} s (last: {error}); this node gives the job up "
                    "until the daemon restarts: report it as a bug of elasticd",
                )
            else:
                self.events.emit(
                    job_id,
                    "daemon",
                    EventKind.AGENT_CRASHED,
                    f"the agent on {self.node} died of an internal error ({error}); the job "
                    "resumes as a new attempt, no restart charged",
                )
            with contextlib.suppress(InvalidTransition, JobNotFound):
                job = await self.get(job_id)
                if job.state is JobState.RUNNING:
                    await self.update_job(
                        job_id, state=JobState.RESTARTING, reason="the agent crashed"
                    )
        except Exception as exc:
            log.error("job %s: could not record the agent's death: %s", job_id, exc)
        finally:
            self._free.extend(slots)
            self._free.sort()
            if give_up:
                self._done_here.add(job_id)
            self._publish_slots()
            self._crashing.discard(job_id)
            if not give_up and self._accepting:
                self._reconcile()  # a new agent takes the job up

    def _publish_slots(self) -> None:
        """Publish the free slots, and the active jobs this node gave up (the scheduler's
        ``declined``: it places them on other nodes)."""
        if self._accepting:
            declined = sorted(
                j
                for j in self._done_here
                if (job := self._known.get(j)) is not None and job.state in JOB_ACTIVE
            )
            self._background.spawn(
                self.cluster.publish(free_slots=len(self._free), declined=declined),
                name="publish-slots",
            )

    def view_of(self, job_id: str) -> GroupView | None:
        agent = self._agents.get(job_id)
        return agent.view if agent else None
