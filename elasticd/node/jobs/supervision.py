"""Agent supervision: start a job's agent, watch its task, stop it, survive its death.

An agent task that dies of an exception its own error path could not handle
is never silent: its workers are stopped, ``agent.crashed`` is recorded and
the job resumes as a new attempt like after a daemon crash (after
``MAX_AGENT_CRASHES`` within ``AGENT_CRASH_WINDOW`` this node gives the job up
until it restarts, and the job is never FAILED for it;
:meth:`AgentSupervisor.after_crash`), rather than left RUNNING unwatched.
Whatever ends an agent is reported to the plan's side
(:class:`~elasticd.node.jobs.reconcile.Reconciler`) as an :class:`AgentEnded`:
it decides what the slots and the job do next.

A daemon that stops, or starts after a crash, leaves its jobs resumable:
``stop_all`` and ``recover`` mark them RESTARTING with a reason, never FAILED.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from typing_extensions import Unpack

from elasticd.agent.agent import AgentContext, ConsoleSink, JobAgent, decode_group
from elasticd.agent.context import JobUpdater
from elasticd.agent.edits import record_carried_failure
from elasticd.agent.handover import AgentHandover, CarriedFailure, not_ready
from elasticd.agent.nodefail import RetrySettings
from elasticd.agent.ports import Attribute
from elasticd.errors import (
    InvalidTransition,
    JobConflict,
    JobNotFound,
    SpawnStage,
    StoreError,
    ValueTooLarge,
    WorkerSpawnError,
)
from elasticd.eventkinds import EventKind
from elasticd.identity import JobTokens
from elasticd.keys import group_key, job_key
from elasticd.models import (
    Job,
    JobEdit,
    JobMutation,
    Launcher,
    incarnation,
    incarnation_tag,
    tagged_for,
)
from elasticd.node.events import of_job
from elasticd.node.health import NodeHealthChecks
from elasticd.node.jobs.documents import JobsSide, parse_job
from elasticd.node.logfollow import LogGrowth
from elasticd.node.xid import KernelLog
from elasticd.rendezvous import Settings, StoreRendezvous
from elasticd.security import Identity
from elasticd.states import JOB_ACTIVE, JobState, WorkerState
from elasticd.storage import Degraded, StorageHealth
from elasticd.store import Entry
from elasticd.supervise.spawn import DEFAULT_POLICY

log = logging.getLogger("elasticd.node.jobs")

#: Seconds a stopping daemon spends recording why its jobs stopped (the store may not
#: acknowledge writes: a full disk under the embedded store). A restart resumes them anyway.
STOP_RECORD_TIMEOUT = 10.0
#: How long the new image of a re-exec tries to record a carried failure while the store
#: fails, before the job resumes (a lease TTL's worth and more: the store's own failover).
CARRIED_STORE_WAIT = 30.0

DAEMON_STOPPED = (
    "the elasticd daemon stopped while the job was running (e.g. systemctl restart); "
    "the job resumes as a new attempt when the daemon is back, no restart charged"
)
DAEMON_CRASHED = (
    "the elasticd daemon was not running (it crashed or was killed) while the job was running; "
    "the job resumes as a new attempt, no restart charged"
)
READOPT_FAILED = (
    "the elasticd daemon re-executed itself but could not take up the job's workers: "
    "{reason}; the job resumes as a new attempt, no restart charged"
)
#: Agent deaths (internal errors) after which a job is FAILED instead of resumed.
MAX_AGENT_CRASHES = 3
#: Seconds within which MAX_AGENT_CRASHES deaths make this node give a job up.
AGENT_CRASH_WINDOW = 600.0


@dataclass(frozen=True)
class AgentEnded:
    """An agent task of this node ended; ``crash`` is the exception that killed it, if any."""

    job_id: str
    agent: JobAgent | None
    cancelled: bool
    crash: BaseException | None
    #: Which job of its id the agent ran (:func:`incarnation`): the id may have been
    #: deleted, and taken by a new job, while it ran.
    ran: str | None = None

    @property
    def gave_back(self) -> bool:
        """The node's own trouble (:mod:`elasticd.agent.nodefail`) made the agent give up."""
        return self.agent is not None and self.agent.gave_back


class AgentSupervisor:
    """The agents of this node: one task per job, its token file, and what ends it."""

    def __init__(
        self,
        side: JobsSide,
        *,
        ended: Callable[[AgentEnded], None],
        log_growth: LogGrowth,
        attempt_ended: Callable[[str], None] | None = None,
        token_file: str | None = None,
        console: ConsoleSink | None = None,
        base_env: dict[str, str] | None = None,
        job_base_env: dict[str, str] | None = None,
        storage: StorageHealth | None = None,
        busy_slots: Callable[[], int] | None = None,
    ) -> None:
        """``ended``: told, in the task's done callback, whenever an agent task ends;
        ``attempt_ended``: told the job's id whenever one of its attempts here ends;
        ``busy_slots``: how many of the node's slots its agents hold (the agents' context)."""
        self.side = side
        self._busy_slots = busy_slots
        self._attempt_ended = attempt_ended
        self.console = console
        self.log_growth = log_growth
        self.storage = storage
        self._ended = ended
        self._token_file = token_file
        self._base_env = dict(os.environ if base_env is None else base_env)
        #: What a job's processes start from (None: ``base_env``):
        #: :func:`elasticd.supervise.env.job_base_env`.
        self._job_base_env = job_base_env
        #: How workers are spawned (users, registry, containment): the daemon sets it.
        self.spawn_policy = DEFAULT_POLICY
        #: The kernel log the GPU checks read Xid errors from, from this daemon's start on.
        path = side.config.kernel_log
        self.kernel_log = KernelLog(path) if path else None
        #: Notes a failure attributed to this node in its health record (the daemon's
        #: :class:`~elasticd.node.quarantine.NodeHealthService`; None: not counted).
        self.attribute: Attribute | None = None
        #: The tokens of this node's jobs' workers, and the folder of their files (the
        #: daemon's own, 0711): each job's file belongs to its user, 0400.
        self.job_tokens: JobTokens | None = None
        #: This node's torchft Lighthouse (a parent job's id -> its address), handed to the
        #: replica groups' agents; None: their workers get no TORCHFT_LIGHTHOUSE.
        self.lighthouse: Callable[[str], Awaitable[str]] | None = None
        self.token_dir: Path | None = None
        self.agents: dict[str, JobAgent] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self._ran: dict[str, str] = {}  # the incarnation each agent runs (AgentEnded.ran)
        #: How often each job's agent died of an internal error in this daemon's life.
        self._crashes: dict[str, list[float]] = {}  # job -> when its agents died

    def not_ready(self) -> dict[str, str]:
        """The jobs whose agent cannot hand its attempt over now, and why (re-exec)."""
        why = {job_id: not_ready(agent.handover_facts()) for job_id, agent in self.agents.items()}
        return {job_id: reason for job_id, reason in why.items() if reason is not None}

    async def record_failures(self, job_ids: Iterable[str]) -> None:
        """The agents of ``job_ids`` record the failures they saw and have not recorded yet
        (re-exec, past its wait: those jobs are not handed over)."""
        agents = [self.agents[job_id] for job_id in job_ids if job_id in self.agents]
        await asyncio.gather(*(agent.record_failure_now() for agent in agents))

    def parents_running(self) -> set[str]:
        """The jobs of replica groups with a group's agent on this node (their Lighthouses)."""
        return {parent for agent in self.agents.values() if (parent := agent.parent) is not None}

    def agent_of(self, job: Job) -> JobAgent | None:
        """This node's agent of ``job``; None when the agent here runs another job of its id
        (deleted, its id taken again, while that agent still stops its workers)."""
        agent = self.agents.get(job.id)
        if agent is None or self._ran.get(job.id) != incarnation(job):
            return None
        return agent

    def hand_over(self, slots: dict[str, list[int]]) -> tuple[list[AgentHandover], dict[str, str]]:
        """Every agent's running attempt for the daemon's next program image (re-exec), and
        the jobs that cannot be handed over, with why; no await: right before the exec."""
        handed, not_handed = [], {}
        for job_id, agent in self.agents.items():
            handover = agent.hand_over(slots.get(job_id, []))
            if handover is not None:
                handed.append(handover)
                continue
            why = not_ready(agent.handover_facts()) or "its workers could not be handed over"
            not_handed[job_id] = f"{why} at the re-exec"
        return handed, not_handed

    def carried_failures(self, job_ids: Iterable[str]) -> dict[str, CarriedFailure]:
        """The failures the agents of ``job_ids`` (not handed over) saw, or their workers
        met, and have not recorded yet, for the next program image; no await: right
        before the exec."""
        carried = {}
        for job_id in job_ids:
            agent = self.agents.get(job_id)
            failure = agent.carried_failure() if agent is not None else None
            if failure is not None:
                carried[job_id] = failure
        return carried

    async def record_carried(self, failures: Mapping[str, CarriedFailure]) -> None:
        """The new image's start: record the failures the previous image's agents could not
        (:meth:`carried_failures`), before their jobs resume; charged when the next round
        forms, as any. The exit nothing said yet is said now (``worker.exited``)."""
        for job_id, failure in failures.items():
            root = failure.root
            if failure.pid is not None:
                how = (
                    f"was killed by {root.signal_name}"
                    if root.signal is not None
                    else f"exited with code {root.exit_code}"
                )
                self.side.events.emit(
                    job_id,
                    "worker",
                    EventKind.WORKER_EXITED,
                    f"rank {root.rank} on {root.node}: local rank {root.local_rank} (pid "
                    f"{failure.pid}) {how} (seen as the daemon re-executed itself)",
                    state=WorkerState.FAILED.value,
                    attempt=root.attempt,
                    rank=root.rank,
                    local_rank=root.local_rank,
                    pid=failure.pid,
                    exit_code=root.exit_code,
                    signal=root.signal,
                    job_tag=failure.job_tag,
                )
            edit = record_carried_failure(
                failure.round,
                root,
                alone=failure.alone,
                job_tag=failure.job_tag,
                early_count=failure.early_count,
            )
            try:
                await self._update_past_outages(job_id, edit)
            except (StoreError, InvalidTransition, JobNotFound, JobConflict) as exc:
                log.warning("job %s: could not record its failure across the re-exec: %s",
                            job_id, exc)  # fmt: skip
                continue
            log.info("job %s: recorded the failure its agent saw before the re-exec: %s",
                     job_id, root.message)  # fmt: skip

    async def _update_past_outages(self, job_id: str, edit: JobMutation) -> None:
        """``edit`` the job's document, again while the store fails (the new image may come
        up as the store goes away), for up to :data:`CARRIED_STORE_WAIT` s: the job resumes
        only after, so its failure is charged once there, not lost (the last error raises)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CARRIED_STORE_WAIT
        pause = 0.1
        while True:
            try:
                await self.side.documents.update(job_id, mutate=edit)
                return
            except StoreError:
                if loop.time() + pause > deadline:
                    raise
            await asyncio.sleep(pause)
            pause = min(pause * 2, 2.0)

    async def recover(
        self, skip: frozenset[str] = frozenset(), why: Mapping[str, str] | None = None
    ) -> None:
        """After a start: a job this node was running resumes, never failed for the daemon's sake.

        A job with other live members carries on without us; this node will
        rejoin it through the normal scheduling path (as an arriving node).
        A job only this node ran was interrupted by this daemon's own stop or
        crash, not by its workers: it is marked RESTARTING with the reason
        and the scheduling path starts it again as a new attempt. No restart
        is charged (:data:`DAEMON_CRASHED`).
        """
        try:
            jobs = await self.side.documents.all()
        except ValueTooLarge as exc:
            # Never a crash loop at start: serve, and say what is wrong with the store.
            log.error("cannot recover the jobs of this node: %s", exc)
            return
        for job in jobs:
            if job.state not in JOB_ACTIVE or job.launcher != Launcher.ELASTICD or job.id in skip:
                continue
            ours = self._group_of(job, await self.side.store.get(group_key(job.id, self.side.node)))
            if ours is not None:
                await self._mark_stopped(ours)
            members = await self.side.documents.live_members(job.id)
            if members - {self.side.node}:
                continue
            if ours is None and self.side.node not in members and not self._started_here(job):
                continue
            reason = (why or {}).get(job.id)
            message = DAEMON_CRASHED if reason is None else READOPT_FAILED.format(reason=reason)
            self.side.events.emit(
                job.id, "daemon", EventKind.JOB_RESUMED, message, job_tag=incarnation_tag(job)
            )
            if job.state is JobState.RUNNING:
                with contextlib.suppress(InvalidTransition):
                    await self.side.documents.update(
                        job.id, state=JobState.RESTARTING, reason="the daemon was restarted"
                    )

    @staticmethod
    def _group_of(job: Job, entry: Entry | None) -> Entry | None:
        """This node's group view ``entry`` if it is ``job``'s: not a deleted job's of the
        id, published late by its agent (cut off from the store when the id was taken
        again), which says nothing of whether this node ran ``job``."""
        view = None if entry is None else decode_group(entry.value)
        if view is not None and not tagged_for(view.job_tag, incarnation_tag(job)):
            return None
        return entry

    async def _mark_stopped(self, entry: Entry) -> None:
        """Our group view from before the restart: its workers died with the daemon."""
        view = decode_group(entry.value)
        if view is None or view.state.is_terminal or view.state is WorkerState.STOPPED:
            return
        view.state = WorkerState.STOPPED
        view.updated_at = self.side.clock.time()
        for worker in view.workers:
            if not worker.state.is_terminal:
                worker.state = WorkerState.STOPPED
        await self.side.store.compare_and_set(
            entry.key, view.model_dump_json().encode(), entry.version
        )  # a lost race means a newer view was written: fine

    def _started_here(self, job: Job) -> bool:
        """Whether this node's own event log says it started workers of the job (this job
        of its id, not an earlier one)."""
        after = 0
        tag = incarnation_tag(job)
        while batch := self.side.events.read(job.id, after=after, limit=1000):
            after = batch[-1].seq
            batch = [e for e in batch if of_job(e, tag)]
            if any(e.kind == EventKind.WORKERS_STARTED for e in batch):
                return True
        return False

    async def stop_all(self) -> float:
        """Stop every agent: each stops its workers (shielded) and leaves the rendezvous.

        A job no other live node is part of is then RESTARTING, with an event
        that says why: it resumes when a daemon takes it up again. Returns the
        loop time by which what is left of the stop should be done.
        """
        tasks = list(self.tasks.items())
        ran = {job_id: agent.job_tag for job_id, agent in self.agents.items()}
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
                    await self._record_stop(job_id, ran.get(job_id))
            except TimeoutError:
                log.warning("job %s: could not record the daemon stop in time", job_id)
        if self.kernel_log is not None:
            self.kernel_log.close()
        return deadline

    async def _record_stop(self, job_id: str, ran: str | None) -> None:
        """After this daemon stopped its agent (of the job tagged ``ran``): the job resumes
        later, and says why. Not a new job of the id (the agent's was deleted while it
        stopped its workers): that job did not run here."""
        try:
            job = await self.side.documents.read(job_id)
            if (
                job.state.is_terminal
                or not tagged_for(ran, incarnation_tag(job))
                or await self.side.documents.live_members(job_id) - {self.side.node}
            ):
                return
            # Not the job's failure: it resumes when this daemon (or another node) is back.
            self.side.events.emit(
                job_id,
                "daemon",
                EventKind.DAEMON_STOPPED,
                DAEMON_STOPPED,
                job_tag=incarnation_tag(job),
            )
            if job.state is JobState.RUNNING:
                await self.side.documents.update(
                    job_id, state=JobState.RESTARTING, reason="the daemon stopped"
                )
        except (StoreError, InvalidTransition, JobNotFound) as exc:
            log.warning("job %s: could not record the daemon stop: %s", job_id, exc)

    def _updates_of(self, job: Job) -> JobUpdater:
        """The agent's writes of its job's document, to that job only: a new job of its id
        (the old one deleted while its agent still stops its workers) is, to that agent,
        its job gone (``JobNotFound``), never given the old job's state or progress."""
        mine = incarnation(job)
        update = self.side.documents.update

        async def of_mine(
            job_id: str, *, mutate: JobMutation | None = None, **changes: Unpack[JobEdit]
        ) -> Job:
            def edit(current: Job) -> JobEdit:
                if incarnation(current) != mine:  # decided on the version written over
                    raise JobNotFound(f"job {job_id!r} was deleted; a new job has its id")
                return mutate(current) if mutate is not None else {}

            return await update(job_id, mutate=edit, **changes)

        return of_mine

    def rendezvous(self, job: Job) -> StoreRendezvous:
        spec = job.spec
        assert spec.max_nodes is not None
        return StoreRendezvous(
            self.side.store,
            job.id,
            node=self.side.node,
            role=spec.role,
            local_world_size=spec.nproc_per_node,
            advertise_addr=self.side.config.advertise,
            settings=Settings(
                min_nodes=spec.min_nodes,
                max_nodes=spec.max_nodes,
                join_timeout=spec.join_timeout,
                last_call_timeout=spec.last_call_timeout,
            ),
            lease=self.side.cluster.lease,
            master_addr=spec.master_addr,
            master_port=spec.master_port,
            clock=self.side.clock,
            still_active=self._still_active(job),
        )

    def _still_active(self, job: Job) -> Callable[[], Awaitable[bool]]:
        """Whether ``job`` (that job, not another of its id) has not ended, read now."""
        store, mine = self.side.store, incarnation(job)

        async def still_active() -> bool:
            entry = await store.get(job_key(job.id))
            if entry is None:
                return False
            try:
                current = parse_job(job.id, entry.value)
            except JobConflict:  # a document nobody can read: nothing to run
                return False
            return incarnation(current) == mine and not current.state.is_terminal

        return still_active

    def start(
        self, job: Job, cuda_visible_devices: str | None, handover: AgentHandover | None = None
    ) -> None:
        """Start the job's agent on slots the caller holds for it (their GPUs given);
        ``handover``: it takes up the attempt the daemon's previous image ran (re-exec)."""
        ctx = AgentContext(
            node=self.side.node,
            advertise_addr=self.side.config.advertise,
            daemon_url=self.side.config.url,
            logs=self.side.logs,
            store=self.side.store,
            events=self.side.events,
            update_job=self._updates_of(job),
            rendezvous=self.rendezvous(job),
            base_env=self._base_env,
            job_base_env=self._job_base_env,
            token_file=self._token_file,
            cuda_visible_devices=cuda_visible_devices,
            console=self.console,
            clock=self.side.clock,
            fence_after=self.side.config.lease_ttl,
            lease_lapsed=self.side.cluster.lease_lapsed,
            health=NodeHealthChecks(
                base_env=self._base_env,
                job_base_env=self._job_base_env,
                node_command=self.side.config.health_check,
                nvidia_smi=self.side.config.nvidia_smi,
                policy=self.spawn_policy,
                kernel_log=self.kernel_log,
                operator_timeout=self.side.config.health_check_timeout,
            ),
            storage=self.storage,
            policy=self.spawn_policy,
            job_token=self._job_token if self.job_tokens is not None else None,
            log_growth=self.log_growth.grew,
            attempt_ended=self._attempt_ended,
            node_failure=RetrySettings(grace=self.side.config.node_failure_grace),
            attribute=self.attribute,
            busy_slots=self._busy_slots,
            lighthouse=self.lighthouse,
        )
        agent = JobAgent(job, ctx, handover)
        try:
            # The job's log folder is this job's: one left by an earlier job of this id
            # (deleted, the id taken again) is moved aside, never read or appended to.
            self.side.logs.claim(job.id, incarnation(job))
        except OSError as exc:  # its logs are then not served (no folder names it)
            log.warning("job %s: cannot claim its log folder: %s", job.id, exc)
        # A job this node ran before (before a daemon restart) goes on with the next
        # attempt number: its earlier attempts' logs stay where they are.
        if handover is None:
            agent.spawn_seq = self.side.logs.last_attempt(job.id)
        self.agents[job.id] = agent
        self._ran[job.id] = incarnation(job)
        task = asyncio.create_task(agent.run(), name=f"agent-{job.id}")
        self.tasks[job.id] = task
        task.add_done_callback(self._done(job.id))

    def stop(self, job_id: str) -> None:
        """Stop the job's agent here: it leaves the rendezvous first, then stops its workers."""
        task = self.tasks.get(job_id)
        agent = self.agents.get(job_id)
        if agent is not None:
            agent.leave_first = True
        if task is not None:
            log.info("job %s: no longer placed on %s; stopping its agent", job_id, self.side.node)
            task.cancel()  # stops the workers with their grace and leaves the rendezvous

    def forget(self, job_id: str) -> None:
        """The job is gone from the store: its agents' deaths no longer count, and its agent
        here (still stopping its workers) files no more events under its id."""
        self._crashes.pop(job_id, None)
        if (agent := self.agents.get(job_id)) is not None:
            agent.orphaned = True

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

    def _done(self, job_id: str) -> Callable[[asyncio.Task[None]], None]:
        def done(task: asyncio.Task[None]) -> None:
            self._forget_token(job_id)
            agent = self.agents.pop(job_id, None)
            self.tasks.pop(job_id, None)
            crash = None if task.cancelled() else task.exception()
            if crash is not None and agent is not None:
                # The agent's own error path raised: never silent (after_crash).
                log.error(
                    "the agent of job %s died: %s: %s",
                    job_id,
                    type(crash).__name__,
                    crash,
                    exc_info=crash,
                )
            ran = self._ran.pop(job_id, None)
            self._ended(AgentEnded(job_id, agent, task.cancelled(), crash, ran))

        return done

    def storage_back(self, first: Degraded, seconds: float) -> None:
        """The state disk takes writes again: each job run here gets one event saying so.

        Emitted after everything the backlog held (it lands in order behind it).
        """
        for job_id, agent in list(self.agents.items()):
            self.side.events.emit(
                job_id,
                "daemon",
                EventKind.STORAGE_BACK,
                f"{self.side.node} could not write its state for {seconds:.1f} s ({first.source}: "
                f"{first.reason}); what happened meanwhile was kept in memory and is now "
                "recorded, in order",
                duration_s=seconds,
                job_tag=agent.job_tag,
            )

    async def after_crash(self, job_id: str, agent: JobAgent, crash: BaseException) -> bool:
        """An agent task died of an exception its own handler could not deal with.

        Decision: that is this daemon's fault, not the job's workers', so it is
        treated as a crash of the daemon (issue 12, 11): the agent's workers
        are stopped and it leaves the rendezvous, ``agent.crashed`` names the
        error, the job is RESTARTING and resumes as a new attempt under a new
        agent, no restart charged. A bug that kills every agent would loop, so
        after :data:`MAX_AGENT_CRASHES` deaths within :data:`AGENT_CRASH_WINDOW`
        this node gives the job up until the daemon restarts (other nodes carry
        on without it): returns True then. The job is never FAILED for it: only
        its workers or its budget may fail a job. Never left RUNNING unwatched.
        """
        now = self.side.clock.monotonic()
        recent = [t for t in self._crashes.get(job_id, []) if now - t < AGENT_CRASH_WINDOW]
        recent.append(now)
        self._crashes[job_id] = recent
        error = f"{type(crash).__name__}: {crash}"
        give_up = len(recent) >= MAX_AGENT_CRASHES
        try:
            with contextlib.suppress(Exception):
                await agent.abandon()
            if give_up:
                self.side.events.emit(
                    job_id,
                    "daemon",
                    EventKind.AGENT_CRASHED,
                    f"the agent on {self.side.node} died of an internal error {len(recent)} times "
                    "in "
                    f"{AGENT_CRASH_WINDOW:.0f} s (last: {error}); this node gives the job up "
                    "until the daemon restarts: report it as a bug of elasticd",
                    job_tag=agent.job_tag,
                )
            else:
                self.side.events.emit(
                    job_id,
                    "daemon",
                    EventKind.AGENT_CRASHED,
                    f"the agent on {self.side.node} died of an internal error ({error}); the job "
                    "resumes as a new attempt, no restart charged",
                    job_tag=agent.job_tag,
                )
            ran = agent.job_tag

            def restarting(job: Job) -> JobEdit:
                # Decided on the version written over: the job the agent ran, still RUNNING
                # (not a new job of its id, taken while the dead agent's workers stopped).
                if job.state is JobState.RUNNING and tagged_for(ran, incarnation_tag(job)):
                    return {"state": JobState.RESTARTING, "reason": "the agent crashed"}
                return {}

            with contextlib.suppress(InvalidTransition, JobNotFound):
                await self.side.documents.update(job_id, mutate=restarting)
        except Exception as exc:
            log.error("job %s: could not record the agent's death: %s", job_id, exc)
        return give_up
