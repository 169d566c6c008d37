"""The job service: the one object the REST routes and the daemon call for jobs.

A thin facade over the package's parts, each with one job:

- :mod:`~elasticd.node.jobs.documents`: the job documents in the store, read
  through one check and changed only by compare-and-set;
- :mod:`~elasticd.node.jobs.queries`: what the routes read (jobs as served,
  the queue, groups, events, logs);
- :mod:`~elasticd.node.jobs.reconcile`: plan application, the agents the
  fleet's plan places on this node's slots;
- :mod:`~elasticd.node.jobs.supervision`: agent supervision, one task per
  job, what ends it, a dead agent's clean-up, a daemon's stop and recovery.

What is decided here is what a caller may do: submit (who the job runs as,
:func:`elasticd.identity.authorize`), cancel, delete, expire.

Events are recorded in this daemon's SQLite first (so an acknowledged event
is on disk) and published to the store (``ev/<job>/<node>/<seq>``) for the
merged, cluster-wide view; an event's ``seq`` in the API comes from the store
revision that created it (see :mod:`elasticd.node.events`), which gives all nodes'
events one order that keeps each node's own.

A full or failing state disk (:mod:`elasticd.storage`): ``submit`` refuses
new jobs with :class:`~elasticd.errors.StorageFull` (507) while the disk
refuses writes, since accepting means a durable record; running jobs go on
(their events wait, in order, and land later), and each gets one
``storage.back`` event when the disk takes writes again.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path

from typing_extensions import Unpack

from elasticd.agent.agent import ConsoleSink
from elasticd.agent.handover import AgentHandover, CarriedFailure
from elasticd.clock import SYSTEM_CLOCK, Clock
from elasticd.config import Config
from elasticd.errors import (
    JobConflict,
    JobForbidden,
    JobNotFound,
    OverShare,
    OverShareBytes,
    ShuttingDown,
    StorageFull,
    StoreError,
    WorkerSpawnError,
)
from elasticd.eventkinds import EventKind
from elasticd.identity import ADMIN, Action, Deny, JobFacts, JobTokens, Principal, authorize
from elasticd.keys import job_key, refusal_key
from elasticd.logs import LogLayout
from elasticd.models import (
    Job,
    JobEdit,
    JobMutation,
    JobOwner,
    JobSpec,
    Launcher,
    incarnation,
    incarnation_tag,
    valid_job_id,
)
from elasticd.node.cluster import JOB_PREFIX, Cluster
from elasticd.node.db import Database
from elasticd.node.events import EventLog
from elasticd.node.jobs.documents import (
    JobDocuments,
    JobsSide,
    already_ended,
    cancelled,
    facts_of,
    owner_of,
    parse_job,
    redacted,
    same_job,
)
from elasticd.node.jobs.groups import (
    MAX_STEPS,
    GroupKeeper,
    belongs,
    children_of,
    derive_parent,
    parent_of_spec,
    plan_groups,
    taken_edit,
)
from elasticd.node.jobs.queries import JobQueries
from elasticd.node.jobs.reconcile import Reconciler, Slots
from elasticd.node.jobs.supervision import AgentSupervisor
from elasticd.node.logfollow import LogGrowth
from elasticd.node.retention import expired
from elasticd.sched.plan import FleetPlan
from elasticd.shares import JobShare, Usage, job_share_problem
from elasticd.states import JobState
from elasticd.storage import StorageHealth
from elasticd.store import Store
from elasticd.supervise.spawn import SpawnPolicy
from elasticd.tasks import TaskSet

#: Seconds a job document this node wrote counts toward its owner's share before the
#: job watch must have shown it (it shows it within milliseconds while the store answers).
RECENT_SECONDS = 30.0

log = logging.getLogger("elasticd.node.jobs")


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
        self.storage = storage
        self.events = events
        self.store = store
        self.cluster = cluster
        self.clock = clock
        #: Job documents this node wrote for a share-bound owner, until its watch shows
        #: them: key -> ((owner, local), bytes, monotonic time written).
        self._recent: dict[str, tuple[tuple[str, bool], int, float]] = {}
        self._share_lock = asyncio.Lock()
        self.documents = JobDocuments(store, events, clock)
        side = JobsSide(config, self.documents, events, cluster, self.logs)
        #: Work nobody awaits where it starts (slot counts, refusals, a dead agent's
        #: clean-up): owned here, finished or cancelled by stop_agents.
        self._background = TaskSet("jobs")
        self.supervisor = AgentSupervisor(
            side,
            ended=lambda ended: self.reconciler.agent_ended(ended),
            attempt_ended=lambda job_id: self.reconciler.attempt_ended(job_id),
            log_growth=self.log_growth,
            token_file=token_file,
            console=console,
            base_env=base_env,
            job_base_env=job_base_env,
            storage=storage,
            busy_slots=lambda: self.reconciler.slots.busy,
        )
        self.queries = JobQueries(
            side,
            plan=lambda: self.reconciler.plan,
            agents=self.supervisor.agents,
            agent_of=self.supervisor.agent_of,
        )
        self.reconciler = Reconciler(
            side,
            self.supervisor,
            Slots(slots, gpu_ids),
            self._background,
            retain_logs=self.queries.retain_logs,
            db=db,
        )
        # The reads are JobQueries' own, bound here as they are (one signature each).
        self.get = self.queries.get
        self.queue = self.queries.queue
        self.list_jobs = self.queries.list_jobs
        self.workers = self.queries.workers
        self.goodput = self.queries.goodput
        self.goodput_of = self.queries.goodput_of
        self.running_here = self.queries.running_here
        self.list_events = self.queries.list_events
        self.follow_events = self.queries.follow_events
        self.wait = self.queries.wait
        self.retain_logs = self.queries.retain_logs
        self.log_attempts = self.queries.log_attempts
        self.open_log = self.queries.open_log
        self.read_log = self.queries.read_log
        self.check_log = self.queries.check_log
        self.node_url = self.queries.node_url
        #: Creates a parent's missing replica groups and derives its state from theirs.
        self.groups = GroupKeeper(self._background, self._keep_groups)
        if storage is not None:
            storage.on_state_back(self.supervisor.storage_back)
        #: Raises WorkerSpawnError when this node refuses to run jobs as that user.
        self.check_user: Callable[..., object] | None = None

    @property
    def node(self) -> str:
        return self.config.node_name

    @property
    def spawn_policy(self) -> SpawnPolicy:
        """How workers are spawned (users, registry, containment): the daemon sets it."""
        return self.supervisor.spawn_policy

    @spawn_policy.setter
    def spawn_policy(self, policy: SpawnPolicy) -> None:
        self.supervisor.spawn_policy = policy

    def use_job_tokens(self, tokens: JobTokens, folder: Path) -> None:
        """Give each job run here its own token, in a file of ``folder`` (the daemon's, 0711)."""
        self.supervisor.job_tokens = tokens
        self.supervisor.token_dir = folder

    def use_lighthouse(self, lighthouse: Callable[[str], Awaitable[str]] | None) -> None:
        """This node's torchft Lighthouse: a parent job's id -> the address its replica
        groups' workers here get as TORCHFT_LIGHTHOUSE (agents started from now on)."""
        self.supervisor.lighthouse = lighthouse

    # lifecycle

    async def recover(
        self,
        adopt: Sequence[AgentHandover] = (),
        refused: Mapping[str, str] | None = None,
        failures: Mapping[str, CarriedFailure] | None = None,
    ) -> None:
        """After a start: resume the jobs a previous run left active. ``adopt``: attempts the
        daemon's previous program image handed over (re-exec), taken up by the jobs' next
        agents here; ``refused``: why a job was not (it resumes as a new attempt);
        ``failures``: what the agents of those jobs saw and had not recorded (recorded first)."""
        self.reconciler.adoptions = {a.job_id: a for a in adopt}
        await self.supervisor.record_carried(failures or {})
        await self.supervisor.recover(skip=frozenset(self.reconciler.adoptions), why=refused)

    def not_ready(self) -> dict[str, str]:
        """The jobs whose agent cannot hand its attempt over now, and why (re-exec)."""
        return self.supervisor.not_ready()

    async def record_failures(self, job_ids: Iterable[str]) -> None:
        """Failures seen and not recorded yet by the agents of ``job_ids`` (re-exec)."""
        await self.supervisor.record_failures(job_ids)

    def carried_failures(self, job_ids: Iterable[str]) -> dict[str, CarriedFailure]:
        """What the agents of ``job_ids`` (not handed over) have not recorded (re-exec)."""
        return self.supervisor.carried_failures(job_ids)

    def hand_over(self) -> tuple[list[AgentHandover], dict[str, str]]:
        """Every running attempt for the daemon's next program image (re-exec)."""
        return self.supervisor.hand_over(dict(self.reconciler.slots.held))

    async def close_standbys(self) -> None:
        """Kill every job's standby interpreters (before a re-exec: the new program image
        would not know them; its agents start new ones)."""
        for agent in list(self.supervisor.agents.values()):
            await agent.readoption.close_standbys()

    def pending_exit(self) -> bool:
        """A worker of this node was reaped and its exit is not delivered yet (re-exec)."""
        return any(agent.readoption.pending_exit() for agent in self.supervisor.agents.values())

    @property
    def adopting(self) -> int:
        """Jobs handed over by the previous program image not taken up yet (``/readyz``)."""
        pending = sum(1 for agent in self.supervisor.agents.values() if agent.adopting)
        return pending + len(self.reconciler.adoptions)

    def abandon_adoptions(self) -> list[AgentHandover]:
        """The handed-over attempts no agent took up (the plan no longer places the job here,
        or it ended meanwhile): the caller ends their workers."""
        left, self.reconciler.adoptions = list(self.reconciler.adoptions.values()), {}
        return left

    def stop_accepting(self) -> None:
        self.reconciler.accepting = False

    @property
    def accepting(self) -> bool:
        return self.reconciler.accepting

    async def stop_agents(self) -> None:
        """Stop every agent (:meth:`AgentSupervisor.stop_all`), then the background work."""
        self.reconciler.accepting = False
        deadline = await self.supervisor.stop_all()
        # A dead agent's clean-up stops its workers: let it finish (bounded) before the rest
        # is cancelled, so nothing of the service outlives it.
        await self._background.aclose(grace=max(0.0, deadline - asyncio.get_running_loop().time()))

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
        if not self.reconciler.accepting:
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
        if spec.replica_groups is not None:
            job = parent_of_spec(job)
        children = children_of(job)
        if children:
            await self._check_group_ids(job)
        document = job.model_dump_json().encode()
        sizes = {c.id: len(c.model_dump_json()) for c in children} | {job_id: len(document)}
        share = self._job_share(principal)
        if share is None:
            result = await self.store.compare_and_set(job_key(job_id), document, None)
        else:
            async with self._share_lock:  # one check-and-write of a share at a time here
                self._check_share(owner, job_key(job_id), sum(sizes.values()), share, len(sizes))
                result = await self.store.compare_and_set(job_key(job_id), document, None)
                if result.ok:
                    for written, size in sizes.items():
                        self._recent[job_key(written)] = (
                            (owner.name, owner.local),
                            size,
                            self.clock.monotonic(),
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
            job_tag=incarnation_tag(job),
        )
        if children:
            # Acknowledged once the parent is written: a daemon that dies before its groups
            # are leaves them to the others (GroupKeeper), which write what is missing.
            with contextlib.suppress(StoreError):
                await self._create_groups(children)
        return job, True

    async def _check_group_ids(self, parent: Job) -> None:
        """``JobConflict`` (409) when an id of ``parent``'s groups names another job: one
        not of a parent of its id and owner (a submission again of the same job finds its
        own groups there; the parent's document then decides, as for any job)."""
        owner = parent.owner
        taken = [
            other.id
            for other in (await self.documents.children(parent)).values()
            if other.group_of != parent.id or other.owner != owner
        ]
        if taken:
            raise JobConflict(
                f"job {parent.id!r} would have replica groups {', '.join(taken)}, ids other "
                "jobs hold; choose another id"
            )

    async def _create_groups(self, children: Sequence[Job]) -> list[Job]:
        """Write the groups (child jobs) that have no document yet; the ones written."""
        written = []
        for child in children:
            document = child.model_dump_json().encode()
            if (await self.store.compare_and_set(job_key(child.id), document, None)).ok:
                written.append(child)
                self.events.emit(
                    child.id,
                    "daemon",
                    EventKind.JOB_SUBMITTED,
                    f"replica group {child.replica_group} of job {child.group_of}, "
                    f"written by {self.node}",
                    state=JobState.PENDING.value,
                    job_tag=incarnation_tag(child),
                )
        return written

    async def _keep_groups(self, parent_id: str) -> None:
        """One pass over a parent (:func:`~elasticd.node.jobs.groups.plan_groups`), read
        fresh: its missing groups written, its active ones ended when it ended, its state
        derived from theirs. Each write a compare-and-set: any daemon may run it."""
        try:
            parent = await self.documents.read(parent_id)
        except JobNotFound:
            return
        children = await self.documents.children(parent)
        plan = plan_groups(parent, children)
        if plan.taken and not parent.state.is_terminal:
            await self.update_job(parent_id, mutate=lambda p: taken_edit(p, plan.taken))
            return
        if plan.create:
            written = await self._create_groups(plan.create)
            if written:
                self.events.emit(
                    parent_id,
                    "daemon",
                    EventKind.REPLICAS_CREATED,
                    f"{self.node} wrote {len(written)} replica group(s) the job lacked: "
                    + ", ".join(c.id for c in written),
                    job_tag=incarnation_tag(parent),
                )
        why = f"its job {parent_id} ended as {parent.state.value}"
        for child in plan.end:
            await self._end_group(child, why)
        for _ in range(MAX_STEPS):
            derive = _derived_from(await self.documents.children(parent))
            if not derive(await self.update_job(parent_id, mutate=derive)):
                return

    async def _end_group(self, child: Job, why: str) -> None:
        """Cancel one group of a parent that ended, and stop its workers everywhere."""

        def edit(job: Job) -> JobEdit:
            if job.state.is_terminal or incarnation(job) != incarnation(child):
                return {}
            return {"state": JobState.CANCELLED, "reason": f"cancelled: {why}"}

        try:
            ended = await self.update_job(child.id, mutate=edit)
        except JobNotFound:
            return
        if ended.state is JobState.CANCELLED and incarnation(ended) == incarnation(child):
            await self._close_rendezvous(ended)
            await self.documents.sweep_unless_there(ended)

    def _job_share(self, principal: Principal) -> JobShare | None:
        """``principal``'s share of job documents; None for the admin and the cluster."""
        if principal.admin:
            return None
        jobs, nbytes = principal.max_jobs, principal.max_job_bytes
        return JobShare(
            max_jobs=self.config.owner_max_jobs if jobs is None else jobs,
            max_bytes=self.config.owner_max_job_bytes if nbytes is None else nbytes,
            jobs_setting="owner_max_jobs" if jobs is None else f"max_jobs of {principal.name}",
            bytes_setting=(
                "owner_max_job_bytes" if nbytes is None else f"max_job_bytes of {principal.name}"
            ),
        )

    def _check_share(
        self, owner: JobOwner, key: str, nbytes: int, share: JobShare, documents: int = 1
    ) -> None:
        """Raise ``OverShare`` (429) or ``OverShareBytes`` (413) when ``documents`` (the
        one at ``key`` and its replica groups') of ``nbytes`` in all would take ``owner``
        past ``share``.

        Counted from the documents this node's job watch holds, plus the ones it wrote
        itself that the watch has not shown yet (kept for :data:`RECENT_SECONDS`).
        """
        who = (owner.name, owner.local)
        now = self.clock.monotonic()
        for done in [k for k, (_, _, at) in self._recent.items() if now - at > RECENT_SECONDS]:
            del self._recent[done]
        usage = self.cluster.owner_usage(who, besides=key)
        seen = self.cluster.holds
        for other, (whose, size, _) in self._recent.items():
            if whose == who and other != key and not seen(other):
                usage = Usage(usage.count + 1, usage.nbytes + size)
        problem = job_share_problem(owner.name, usage, nbytes, share, documents)
        if problem is not None:
            status, message = problem
            raise (OverShareBytes if status == 413 else OverShare)(message)

    async def authorized(
        self, job_id: str, principal: Principal, action: Action, *, tag: str | None = None
    ) -> Job:
        """The job, when ``principal`` may do ``action`` to it; ``JobForbidden`` (403) if not.

        ``tag``: the job a forwarding daemon authorized its caller for
        (:func:`~elasticd.node.jobs.documents.incarnation_tag`); another job of the id
        is a ``JobConflict`` (409), never answered about.
        """
        job = await self.get(job_id)
        same_job(None, job, tag=tag)
        decision = authorize(principal, action, facts_of(job))
        if isinstance(decision, Deny):
            raise JobForbidden(decision.reason)
        return job

    def as_seen_by(self, job: Job, principal: Principal) -> Job:
        """The job as ``principal`` may see it: its spec's env and args are its owner's."""
        if authorize(principal, Action.READ_DETAIL, facts_of(job)):
            return job
        return redacted(job)

    async def cancel(self, job_id: str, seen: Job | None = None) -> Job:
        """End the job as CANCELLED and stop its workers on every node.

        ``seen``: the job its caller was authorized for; a job submitted again
        under its id since then is not cancelled (409).
        """
        job = seen if seen is not None else await self.get(job_id)  # seen: read just now
        await self._refuse_group(job, "cancel")
        if job.launcher == Launcher.TORCHRUN:
            raise JobConflict(
                f"job {job_id!r} is run by {job.launcher}, not by elasticd: stop its "
                f"{job.launcher} processes"
            )
        if job.state.is_terminal:
            raise JobConflict(already_ended(job))
        # Said of the job read: if a delete and a new job of the id win the compare-and-set
        # below, this event is the old job's and the new job's readers never see it.
        self.events.emit(
            job_id,
            "daemon",
            EventKind.JOB_CANCEL_REQUESTED,
            f"cancel requested on {self.node}",
            job_tag=incarnation_tag(job),
        )
        # Decided on the document the compare-and-set writes over: the job may have ended
        # since the read above (its workers failed, a peer cancelled it), and that is a 409.
        job = await self.update_job(job_id, mutate=cancelled(seen))
        if job.is_parent:  # its groups run its workers: each is cancelled (and its rendezvous)
            for child in (await self.documents.children(job)).values():
                if belongs(child, job) and not child.state.is_terminal:
                    await self._end_group(child, f"its job {job_id} was cancelled")
            return job
        # Closing the rendezvous tells every node's agent to stop its workers. The job as
        # written, not read again: a delete may land now that it is CANCELLED, and the
        # cancel stands (200, not 404); the close may then have written the rendezvous of
        # a deleted job again, which the next job of the id must not find closed.
        await self._close_rendezvous(job)
        await self.documents.sweep_unless_there(job)
        return job

    async def expire(self, retention: float) -> list[str]:
        """Delete the jobs that ended more than ``retention`` seconds ago; their ids.

        Every daemon may run this: a job deleted meanwhile by another one is
        skipped (the deletion is a compare-and-set on the job document).
        """
        # Measured from when this node saw the end, on its monotonic clock: the document's
        # finished_at is another node's wall clock, which may be hours off this one's.
        seen = self.reconciler
        # A replica group goes with its parent (deleted with it), unless the parent is gone.
        finished = [
            job
            for job in seen.known.values()
            if job.state.is_terminal
            and not (
                job.group_of is not None
                and (parent := seen.known.get(job.group_of)) is not None
                and belongs(job, parent)
            )
        ]
        deleted = []
        for job_id in expired(finished, seen.ends, self.clock.monotonic(), retention):
            try:
                # Only the job whose end was counted: this node's copy may lag the store,
                # where the id may name a new job by now (its retention is its own).
                await self.delete(job_id, seen.known[job_id])
            except (JobNotFound, JobConflict):
                continue
            deleted.append(job_id)
        if deleted:
            log.info("deleted %d job(s) finished over %.0f s ago", len(deleted), retention)
        if seen.watched:
            # Events of jobs deleted while this daemon was down: nobody else drops them.
            # Their times are this node's own clock, and only jobs gone from the store
            # lose them, so a step of the clock cannot delete a live job's events.
            cutoff = self.clock.time() - retention
            for job_id in self.events.quiet_since(cutoff):
                if job_id not in seen.known:
                    self.events.forget(job_id)
        return deleted

    async def delete(self, job_id: str, seen: Job | None = None) -> None:
        """Forget a finished job: its document, events, groups and rendezvous keys.

        Worker log files stay on disk (they are the user's data). A job that
        has not ended cannot be deleted: cancel it first; a torchrun-launched
        run with no live torchrun left may be deleted in any state. ``seen``: as
        for :meth:`cancel`.
        """
        # One read: the version deleted is the one judged (a job deleted and submitted
        # again under its id between two reads must not be deleted unjudged).
        entry = await self.store.get(job_key(job_id))
        if entry is None:
            raise JobNotFound(f"no job with id {job_id!r}")
        job = parse_job(job_id, entry.value)
        same_job(seen, job)
        await self._refuse_group(job, "delete")
        torch_run = job.launcher == Launcher.TORCHRUN
        abandoned = torch_run and not await self.documents.live_members(job_id)
        if not job.state.is_terminal and not abandoned:
            # A torchrun run whose torchruns are all gone (stopped by a signal, torch's
            # launcher skips its shutdown then) keeps its last state for ever: it may go.
            raise JobConflict(f"job {job_id!r} is {job.state.value}; cancel it before deleting it")
        if job.is_parent:  # its groups first: a parent is never gone while they stay
            await self._delete_groups(job)
        if not await self.store.delete(job_key(job_id), entry.version):
            raise JobConflict(f"job {job_id!r} changed while being deleted; try again")
        # Its keys go after its document, and only keys older than the id's document of
        # now: a job submitted again under the id meanwhile keeps its own.
        await self.documents.sweep(job_id)
        self.reconciler.forget(job_id)

    async def _refuse_group(self, job: Job, action: str) -> None:
        """``JobConflict`` (409) for an action on a replica group whose parent is there:
        its parent's to do (a group whose parent is gone may go)."""
        if job.group_of is None:
            return
        try:
            parent = await self.documents.read(job.group_of)
        except (JobNotFound, JobConflict):  # gone, or another (refused) document of its id
            return
        if belongs(job, parent):
            raise JobConflict(
                f"job {job.id!r} is part of job {parent.id!r}; {action} {parent.id!r}"
            )

    async def _delete_groups(self, parent: Job) -> None:
        """Delete the ended groups of ``parent``; ``JobConflict`` if one still runs."""
        groups = [c for c in (await self.documents.children(parent)).values() if belongs(c, parent)]
        active = [c.id for c in groups if not c.state.is_terminal]
        if active:
            raise JobConflict(
                f"job {parent.id!r} has replica groups still stopping ({', '.join(active)}); "
                "try again"
            )
        for child in groups:
            entry = await self.store.get(job_key(child.id))
            if entry is None:
                continue
            if not await self.store.delete(job_key(child.id), entry.version):
                raise JobConflict(f"job {child.id!r} changed while being deleted; try again")
            await self.documents.sweep(child.id)
            self.reconciler.forget(child.id)

    async def _close_rendezvous(self, job: Job) -> None:
        rdzv = self.supervisor.rendezvous(job)
        with contextlib.suppress(StoreError):
            await rdzv.close()

    async def update_job(
        self, job_id: str, *, mutate: JobMutation | None = None, **changes: Unpack[JobEdit]
    ) -> Job:
        """:meth:`JobDocuments.update`."""
        return await self.documents.update(job_id, mutate=mutate, **changes)

    # the store's watches (Reconciler)

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
        self.reconciler.on_jobs(jobs)
        if self.reconciler.accepting:
            self.groups.on_jobs(jobs)

    def on_plan(self, plan: FleetPlan) -> None:
        """Called with the fleet's plan whenever it changes (:mod:`elasticd.node.scheduler`)."""
        self.reconciler.on_plan(plan)

    def store_answers(self) -> None:
        """The store answers again (this node's lease was renewed).

        A job told ``store.lost`` whose agent no longer runs here (the plan
        dropped this node meanwhile, or the agent ended) gets its ``store.back``
        now; a running agent says it itself once the store serves its round.
        """
        for job_id in self.events.store_lost_jobs():
            if job_id not in self.supervisor.agents:
                self.events.store_back(job_id)


def _derived_from(jobs: Mapping[str, Job]) -> JobMutation:
    """The parent's derived-state edit, from the documents at its groups' ids (pure)."""

    def edit(parent: Job) -> JobEdit:
        groups = {
            c.replica_group: c
            for c in jobs.values()
            if c.replica_group is not None and belongs(c, parent)
        }
        return derive_parent(parent, groups)

    return edit
