"""The per-job agent's runner: it awaits what happens next and carries out the decisions.

The agent owns the local worker group of one job on this node. Every decision
is :func:`elasticd.agent.machine.step`'s, a pure function of the agent's state
and an event; this module only turns what it awaits into events and carries
out the effects that come back, in order (:meth:`JobAgent._do`). While the
workers run it races three things, none of them polled: a worker's exit
(awaited), a hang (a heartbeat overdue) and a change of the shared rendezvous
(watched: a node waiting to join, a participant's lease gone, a new round, the
rendezvous closed, or this node fenced). What goes with each attempt (the
console, the heartbeat files, the recovery timeline, health checks, hangs'
stacks) is in the hooks of :mod:`elasticd.agent.hooks`; what the agent needs
of the node is handed in (:mod:`elasticd.agent.ports`, :class:`AgentContext`).

Failures are charged to the job-wide budget lazily, once per round, and only
when every participant of the failed round came back (:mod:`elasticd.agent.edits`).
Every change is an event, and the group view is published to the store so
that any daemon can answer ``GET /jobs/{id}/workers``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal

from elasticd.agent import machine as m
from elasticd.agent.attempt import AttemptPlan, plan_attempt
from elasticd.agent.awaits import health_failed, monitor, retry_later, started
from elasticd.agent.context import AgentContext, ConsoleSink, Emit, JobUpdater
from elasticd.agent.early import Formation
from elasticd.agent.goodput import GoodputHook, end_of
from elasticd.agent.group import LocalGroup
from elasticd.agent.handover import (
    AgentHandover,
    CarriedFailure,
    HandoverFacts,
    Readoption,
    not_ready,
    started_from,
    unrecorded,
    unrecorded_at_exec,
)
from elasticd.agent.hooks import (
    Attempt,
    HangHook,
    HealthHook,
    OutputHook,
    ProgressHook,
    RecoveryHook,
)
from elasticd.agent.jobdoc import JobRecord, states_on_close
from elasticd.agent.nodefail import cause_of, side_of
from elasticd.agent.progress import Hang
from elasticd.agent.publish import GroupPublisher, decode_group
from elasticd.agent.watch import LEAVING_TIMEOUT, Departure, RoundWatch
from elasticd.errors import (
    ElasticdError,
    InvalidTransition,
    RendezvousClosed,
    RendezvousError,
    StoreError,
    StoreUnavailable,
    WorkerSpawnError,
)
from elasticd.eventkinds import EventKind
from elasticd.goodput import End, NodeGoodput
from elasticd.keys import group_key
from elasticd.models import GroupView, Job, JobSpec, RankStack, RootCause, incarnation_tag
from elasticd.rendezvous import RoundInfo
from elasticd.security import Identity
from elasticd.states import JobState, WorkerState, worker_transition
from elasticd.supervise.adopt import end_handed
from elasticd.supervise.env import ReplicaGroup
from elasticd.supervise.process import GroupResult
from elasticd.tasks import TaskSet

__all__ = ["AgentContext", "ConsoleSink", "JobAgent", "JobUpdater", "decode_group"]

#: Signals that say the machine failed, not the program (SIGBUS: a bad page or bus).
HARDWARE_SIGNALS = frozenset({int(signal.SIGBUS)})

log = logging.getLogger("elasticd.agent")

#: Seconds a passed health check stays good for a start that a failed round delayed.
HEALTH_FRESH_FOR = 60.0
#: Seconds a replica group's start waits for its Lighthouse's address.
LIGHTHOUSE_TIMEOUT = 5.0


def replica_of(job: Job) -> ReplicaGroup | None:
    """A replica group's place among its parent's (pure); None for an ordinary job."""
    if job.replica_group is None or job.num_replica_groups is None:
        return None
    return ReplicaGroup(job.replica_group, job.num_replica_groups)


class JobAgent:
    """Runs one job's workers on this node until the job ends."""

    def __init__(self, job: Job, ctx: AgentContext, handover: AgentHandover | None = None) -> None:
        """``handover``: the attempt the daemon's previous program image ran (re-exec):
        taken up as it runs instead of forming a round and starting workers."""
        self.job_id = job.id
        self._handover = handover
        #: Taking up a handed-over attempt: ``/readyz`` is not ready until it is done.
        self.adopting = handover is not None
        #: Parked in :func:`~elasticd.agent.awaits.monitor` with the workers running: a re-exec
        #: may hand it over.
        self._monitoring = False
        self.spec: JobSpec = job.spec
        self.ctx = ctx
        #: The Unix user its submitter proved to be: its jobs may run as that user.
        self._owner_user = job.owner.unix_user if job.owner is not None else None
        #: The workers' ELASTICD_TOKEN_FILE: the job's own token (decided with the user).
        self._token_file = ctx.token_file
        #: The user the job runs as (None: the daemon's), decided before anything of it runs.
        self._identity: Identity | None = None
        #: The per-node spawn sequence number of the last attempt (its log folder's number).
        self.spawn_seq = -1
        self.state = WorkerState.INIT
        #: Set before the agent is cancelled for the fleet's plan: leave before stopping.
        self.leave_first = False
        #: This node could not start the job's workers for ``node_failure.grace`` and gave
        #: the job back (:mod:`elasticd.agent.nodefail`): the job service declines it a while.
        self.gave_back = False
        #: Where the agent is, what its decisions depend on (:mod:`elasticd.agent.machine`).
        self._machine = m.AgentState(
            inprocess_restart=self.spec.inprocess_restart,
            multi_node=(self.spec.max_nodes or 1) > 1,
            retry=ctx.node_failure,
        )
        #: The event an effect produced (the round's next), for the runner to step on.
        self._next: m.Event | None = None
        #: The effects of the current transition not done yet (the one under way first).
        self._queued: list[m.Effect] = []
        #: The round, and its facts: when it formed (wall time), its restart count, and
        #: when its workers were started early (None: after it formed).
        self._round: RoundInfo | None = None
        self._formed_at = 0.0
        self._formed_seen: float | None = None  # monotonic; None: not seen by this image
        self._restart_count = 0
        self._early_spawned: float | None = None
        #: When the health checks last passed, until workers are started after them.
        self._checked_at: float | None = None
        #: Work started where nobody awaits it (the "leaving" write, telling survivors a
        #: rank died, a leave past its bound): owned here, closed when the agent ends.
        self._background = TaskSet(f"agent {job.id}")
        self._departure = Departure(job.id, ctx.rendezvous, self._background)
        self._publisher = GroupPublisher(ctx.store, group_key(job.id, ctx.node), lambda: self.view)
        self.orphaned = False  #: its job deleted under it (AgentSupervisor.forget): mute
        self.job_tag = incarnation_tag(job)  #: which job of its id it runs (Event.job_tag)
        emit = self._emit = Emit(ctx.events, job.id, lambda: not self.orphaned, self.job_tag)
        node = ctx.node
        self._job = JobRecord.of(job, ctx, emit)
        self._watch = RoundWatch(
            node, job.id, ctx.store, ctx.rendezvous, ctx.clock, emit, ctx.events, self._job,
            ctx.fence_after, ctx.lease_lapsed,
        )  # fmt: skip
        self._output = OutputHook(
            emit, node, job.id, self.spec, ctx.console, ended=ctx.attempt_ended
        )
        self._recovery = RecoveryHook(
            emit, node, job.id, ctx.clock, ctx.update_job, self._background.spawn
        )
        self._progress = ProgressHook(
            emit, node, self.spec, ctx.policy, self._owner_user, self._on_progress,
            job.id, ctx.clock, ctx.update_job,
        )  # fmt: skip
        #: The job's last checkpoint as last read (a restarted attempt starts from it).
        self._job_progress = job.progress
        #: A replica group's place among its parent's (torchft), its Lighthouse looked up
        #: before each start (:meth:`_look_up_lighthouse`); None: an ordinary job.
        self._replica = replica_of(job)
        self._parent = job.group_of
        self._health = HealthHook(
            emit, node, job.id, self.spec, ctx.health, ctx.clock, ctx.cuda_visible_devices
        )
        self._hangs = HangHook(emit, node)
        #: The stacks of the last hang's ranks, and the attempt (spawn_seq) they are of.
        self._hang_stacks: tuple[int, list[RankStack]] = (-1, [])
        observed = self._progress.observations
        self._goodput = GoodputHook(ctx.store, job.id, node, ctx.clock, observed, self.job_tag)
        #: When the last attempt's workers were spawned (wall time), for its start-up.
        self._spawned_at = 0.0
        #: The attempt's workers (their processes, ranks, view and exits).
        self._group = LocalGroup(
            ctx, job.id, self.spec, emit, self._output, self._progress, self._background,
            self._publisher.request,
        )  # fmt: skip
        #: Its side of the daemon's re-exec: hand the attempt over, or take one up.
        self.readoption = Readoption(node, self._group, self._recovery, emit)
        self._formation = Formation(
            job.id, node, ctx.clock, ctx.fence_after, self._watch.form,
            lambda round_, count: self._launch(round_, count, early=True),
            lambda: self._stop_group(None),
        )  # fmt: skip

    @property
    def view(self) -> GroupView | None:
        attempt = self._group.attempt
        return attempt.view if attempt is not None else None

    @property
    def prewarm(self) -> bool:
        """The job keeps standby interpreters (its spec's ``prewarm``)."""
        return self._group.standbys is not None

    def standby_memory(self) -> tuple[int, int]:
        """(how many standbys, their resident bytes) on this node."""
        pool = self._group.standbys
        infos = pool.infos() if pool is not None else []
        return len(infos), sum(i.rss_bytes or 0 for i in infos)

    def refresh_progress(self) -> None:
        """Read the heartbeat files now (64 bytes each) so last_progress_at is current."""
        self._progress.refresh(running_only=True)
        self._group.show_standbys()
        self._goodput.refresh()

    @property
    def goodput(self) -> NodeGoodput:
        """This node's goodput record of the job, as of the last read of the heartbeats."""
        return self._goodput.record

    def goodput_time(self) -> float:
        """Now, on the clock of that record (steady: a step of the wall clock moves nothing)."""
        return self._goodput.time()

    # the loop

    async def run(self) -> None:
        """The agent's whole life; returns when the job is over for this node."""
        self._publisher.start(f"publish-{self.job_id}")
        cancelled = False
        try:
            await self._goodput.start()
            await self._run()
        except asyncio.CancelledError:
            cancelled = True
            # The daemon is stopping, or the fleet's plan took this node from the job.
            stopped = self.ctx.clock.time()
            await self._on(m.Cancelled(leave_first=self.leave_first))
            await self._goodput.ended(End.STOPPED, stopped)  # after the workers' stop
            raise
        except Exception as exc:
            log.exception("agent for job %s failed", self.job_id)
            stopped = self.ctx.clock.time()
            reason = f"internal error in the agent on {self.ctx.node}: {type(exc).__name__}: {exc}"
            with contextlib.suppress(ElasticdError):
                await self._on(m.Crashed(reason))
            await self._goodput.ended(End.STOPPED, stopped)
        finally:
            self.adopting = False
            await self._formation.cancel()
            await self._background.aclose(grace=LEAVING_TIMEOUT)
            await self._group.close_standbys()  # after the fills (background) ended
            # Side by side: with the store stuck (a full disk) each waits out its own bound.
            await asyncio.gather(self._publisher.flush(), self._goodput.close())
            # A process of the job still alive keeps its uid taken (read from /proc).
            self.ctx.policy.release_job(self.job_id)
            if cancelled and self.leave_first:  # the plan dropped it (a delete): no leave
                await self._job.sweep_quietly(LEAVING_TIMEOUT)  # below; swept now
        await self._departure.leave()
        await self._job.sweep_quietly()  # its last writes, after a delete: swept

    async def abandon(self) -> None:
        """Stop the workers this agent still has and leave the rendezvous (its task died).

        The other nodes re-form at once; a new agent for the job joins as an arrival.
        """
        await self._stop_workers(None)
        await self._group.close_standbys()
        self._progress.close()
        await self._departure.leave()

    async def _run(self) -> None:
        await self._check_user()
        handover, self._handover = self._handover, None
        if handover is not None and self._machine.phase is m.Phase.DONE:
            await end_handed(handover.workers)  # refused here: nothing of it may run on
        while self._machine.phase is not m.Phase.DONE:
            try:
                if handover is not None:  # the first round is the one handed over
                    taken, handover = handover, None
                    await self._resume(taken)
                else:
                    await self._round_once()
            except StoreError as exc:
                log.warning("job %s on %s: store unavailable: %s", self.job_id, self.ctx.node, exc)
                self._next = None  # the round's next event, if any, is moot now
                await self._on(m.StoreLost(isinstance(exc, StoreUnavailable), str(exc)))

    async def _on(self, event: m.Event) -> None:
        """One transition: :func:`~elasticd.agent.machine.step` decides, the effects run."""
        self._machine, effects = m.step(self._machine, event, self.ctx.clock.time())
        self._queued = list(effects)
        while self._queued:
            await self._do(self._queued[0])
            self._queued.pop(0)

    async def _round_once(self) -> None:
        """One round: health checks, the rendezvous, then the round's events until it ends."""
        ctx = self.ctx
        now = ctx.clock.monotonic()
        if self._checked_at is None or now - self._checked_at > HEALTH_FRESH_FOR:
            failed = await health_failed(
                self._health, self._identity, ctx.update_job, self.job_id, ctx.attribute
            )
            if failed is not None:
                await self._on(failed)
                return
            # Passed: not run again (nor evented) while rounds fail on a lost store,
            # until workers start or the result is stale.
            self._checked_at = now
        try:
            formed = await self._formation.next(
                self._machine.early, self._machine.early_restart_count
            )
        except RendezvousClosed:
            await self._on(m.JoinEnded(closed=True))
            return
        except RendezvousError as exc:  # the join timed out
            await self._on(m.JoinEnded(False, f"rendezvous failed on {self.ctx.node}: {exc}"))
            return
        round_, job = formed.round, formed.job
        self._round, self._restart_count = round_, job.restart_count
        self._formed_at, self._early_spawned = formed.formed_at, formed.spawned_at
        self._formed_seen = ctx.clock.monotonic()  # what this node's failures count from
        self._job_progress = job.progress
        await self._on(m.RoundFormed(job.state.is_terminal, formed.started, formed.confirmed))
        await self._events(round_)

    async def _events(self, round_: RoundInfo) -> None:
        """The round's events, until it ends for this node."""
        while True:
            event, self._next = self._next, None
            if event is None and self._machine.phase is m.Phase.RUNNING:
                self._monitoring = True
                try:
                    event = await monitor(self._group, self._progress, self._watch, round_.round)
                finally:
                    self._monitoring = False
            if event is None:
                return
            await self._on(event)

    # across the daemon's re-exec (elasticd.node.reexec, elasticd.agent.handover)

    def handover_facts(self) -> HandoverFacts:
        """What :func:`~elasticd.agent.handover.not_ready` decides the hand-over on."""
        group = self._group
        return HandoverFacts(
            phase=self._machine.phase,
            state=self.state,
            monitoring=self._monitoring,
            holding_exits=group.held is not None,
            has_round=self._round is not None,
            has_workers=group.attempt is not None and group.processes is not None,
        )

    async def record_failure_now(self) -> None:
        """For the re-exec past its wait: record the failure still queued (:func:`unrecorded`)."""
        failure = unrecorded(self._queued)
        if failure is not None and self._round is not None and self._group.attempt is not None:
            await self._record_failure(self._round, failure.cause, failure.at)

    def carried_failure(self) -> CarriedFailure | None:
        """For the re-exec, when this agent is not handed over: the failure it saw, or its
        workers met, and has not recorded yet (:func:`unrecorded_at_exec`), for the next
        image to record. Called on the loop's thread right before the exec (no await)."""
        round_, group = self._round, self._group
        if round_ is None or group.attempt is None:
            return None
        processes = group.processes
        result, unsaid = processes.snapshot_at_exec() if processes is not None else (None, None)
        failure = unrecorded_at_exec(
            self._queued,
            self.handover_facts(),
            result,
            inprocess_restart=self.spec.inprocess_restart,
            now=self.ctx.clock.time(),
        )
        if failure is None:
            return None
        root, _ = self._root_of(round_, failure.cause, failure.at)
        cause = failure.cause
        first = cause.root_cause if isinstance(cause, GroupResult) else None
        held = {e.local_rank for e in group.held or ()}  # said once confirmed: not yet
        unsaid = (unsaid or frozenset()) | held
        pid = first.pid if first is not None and first.local_rank in unsaid else None
        early = self._machine.early_restart_count if group.held is not None else None
        alone = self._alone(round_, root)
        return CarriedFailure(round_, root, alone, self.job_tag, pid, early)

    def hand_over(self, slots: list[int]) -> AgentHandover | None:
        """The running attempt for the daemon's next program image, or None when the agent
        is anywhere but watching its running workers (the job then resumes there as a new
        attempt, uncharged). Called on the loop's thread right before the exec."""
        if self._round is None or not_ready(self.handover_facts()) is not None:
            return None
        return self.readoption.hand_over(
            AgentHandover(
                job_id=self.job_id, spawn_seq=self.spawn_seq, round=self._round,
                restart_count=self._restart_count, formed_at=self._formed_at,
                token_file=self._token_file, cgroup=None, workers=[], slots=slots,
            )
        )  # fmt: skip

    async def _resume(self, handover: AgentHandover) -> None:
        """Take up the attempt the previous program image ran: its round, its workers (same
        pids, pipes, heartbeats), its state; then watch it as any running attempt."""
        round_ = handover.round
        self._round, self._restart_count = round_, handover.restart_count
        self._formed_at, self.spawn_seq = handover.formed_at, handover.spawn_seq
        begun = started_from(self._job_progress, round_.round)
        await self._look_up_lighthouse()
        plan, attempt = self._plan(round_, handover.restart_count, begun)
        await self.readoption.take_up(handover, attempt, plan, self._identity)
        self._machine = dataclasses.replace(self._machine, phase=m.Phase.RUNNING)
        self._set_state(WorkerState.HEALTHY)  # INIT -> HEALTHY: it never stopped running
        await self.ctx.rendezvous.resume(round_)  # a store error now: as in any running round
        self._spawned_at = self.ctx.clock.time()  # only if the record lacks the attempt
        await self._goodput.resumed(round_.round, self._spawned_at)
        self.adopting = False
        self.readoption.readopted(handover)
        await self._events(round_)

    async def _do(self, effect: m.Effect) -> None:  # noqa: C901 - one case per effect
        """Carry out one effect of :func:`~elasticd.agent.machine.step`."""
        round_ = self._round
        match effect:
            case m.BeginRecovery(cause=cause, detected_at=at):
                self._recovery.begin(cause, at, self.spawn_seq)
                await self._goodput.ended(end_of(cause), at)
            case m.SayLeaving():
                assert round_ is not None
                self._departure.say_leaving(round_.round)
            case m.StopWorkers(target=target):
                await self._stop_workers(target)
            case m.DropEarly():
                await self._stop_group(None)
            case m.StopForOutage():
                if self._group.processes is not None or self.state.is_running:
                    await self._stop_workers(WorkerState.STOPPED)
                if self.state is WorkerState.STOPPED:
                    self._set_state(WorkerState.INIT)  # STOPPED -> INIT
            case m.SetState(target=target, unless_ended=unless_ended):
                if not (unless_ended and self.state.is_terminal):
                    self._set_state(target)
            case m.ReportHang(hang=hang, kill=kill):
                await self._report_hang(hang, kill=kill)
            case m.RecordFailure(cause=cause, at=at):
                assert round_ is not None
                self._next = await self._record_failure(round_, cause, at)
            case m.PlanEarlyRestart():
                pass  # the machine keeps it: the next round's start reads it
            case m.StartWorkers():
                assert round_ is not None
                self._next = await started(
                    lambda: self._launch(round_, self._restart_count, early=False),
                    self.ctx.node,
                    self.ctx.clock,
                )
            case m.Running(early=early):
                assert round_ is not None
                await self._running(round_, early=early)
            case m.ReleaseGroup():
                await self._group.release()  # every worker exited: nothing of it stays
                await self._progress.report()  # the attempt's last steps and checkpoint
            case m.WaitAtBarrier():
                assert round_ is not None
                change = await self._watch.exit_barrier(round_, self.spec.exit_barrier_timeout)
                self._next = m.BarrierDone(change)
            case m.RecoveryStopped():
                self._recovery.stopped(self.spawn_seq)
            case m.Reform(change=change):
                await self._job.reforming(change, self.spawn_seq)
                self._set_state(WorkerState.INIT)  # STOPPED -> INIT
            case m.Succeed():
                assert round_ is not None
                self._set_state(WorkerState.SUCCEEDED)  # HEALTHY -> SUCCEEDED
                await self._goodput.ended(End.FINISHED, self.ctx.clock.time())
                await self._job.succeeded(round_)
            case m.CloseRendezvous(quiet=quiet):
                with contextlib.suppress(*((ElasticdError,) if quiet else ())):
                    await self._job.close_rendezvous()
            case m.FinishClosed():
                await self._finish_closed()
            case m.FailJob(kind=kind, reason=reason, source=source, error=error):
                seq = self.spawn_seq if effect.in_attempt else None
                await self._job.fail(kind, reason, source=source, error=error, attempt=seq)
            case m.RetryStart():
                assert round_ is not None
                self._next = await retry_later(
                    self._emit, self.ctx.node, self._watch, round_.round, effect, self.spawn_seq
                )
            case m.GiveBackJob(waited=waited, error=error, cause=cause):
                # The job service declines the job here a while; run() leaves the round.
                self.gave_back = True
                if self.state is WorkerState.INIT:
                    self._set_state(WorkerState.STOPPED)  # INIT -> STOPPED: nothing of it ran
                await self._job.gave_back(error, cause, waited, self.spawn_seq)
            case m.LeaveRendezvous():
                await self._departure.leave()
            case m.SayLeft():
                self._emit(
                    EventKind.AGENT_FINISHED,
                    f"{self.ctx.node} left the job: it failed its health check",
                )
            case m.CancelEarly():
                await self._formation.cancel()
            case m.WaitForStore(outage=False):
                # The store answered (a lease that expired while it was away, a compacted
                # watch): not an outage; go again after a short pause.
                await asyncio.sleep(0.2)
            case m.WaitForStore(message=message):
                await self._watch.outage(message, group_key(self.job_id, self.ctx.node))

    # what is awaited: the user, health checks, the round, the start, the workers

    async def _check_user(self) -> None:
        """Decide the job's user before anything of it runs; refused: UserRefused."""
        try:
            # With run_as = dynamic this claims the job's own uid on this node, kept for
            # every attempt and released when this agent ends (run's finally).
            self._identity = self.ctx.policy.identity_for(
                self.spec.user, owner_user=self._owner_user, job_id=self.job_id
            )
            if self._handover is not None:  # its workers hold this file's token already
                self._token_file = self._handover.token_file
            elif self.ctx.job_token is not None:
                self._token_file = self.ctx.job_token(self.job_id, self._identity)
        except WorkerSpawnError as exc:  # its token file: the node's trouble
            message = f"the job cannot run on {self.ctx.node}: {exc}"
            await self._on(m.UserRefused(side_of(exc), message, str(exc), cause_of(exc)))

    # workers

    async def _launch(self, round_: RoundInfo, restart_count: int, *, early: bool) -> None:
        """Spawn the attempt's workers (the group stays INIT until :meth:`_running`)."""
        self._checked_at = None  # the next (re)start runs the health checks again
        self.spawn_seq += 1
        self._round = round_
        await self._look_up_lighthouse()
        plan, attempt = self._plan(round_, restart_count, self._job_progress.checkpoint_step)
        self._spawned_at = self.ctx.clock.time()
        await self._group.start(attempt, plan, self._identity, early=early)

    def _plan(
        self, round_: RoundInfo, restart_count: int, started_from: int | None
    ) -> tuple[AttemptPlan, Attempt]:
        """Attempt ``spawn_seq`` in ``round_``: spawned, or taken up after a re-exec."""
        plan = plan_attempt(
            self.job_id,
            self.spec,
            round_,
            restart_count=restart_count,
            spawn_seq=self.spawn_seq,
            node=self.ctx.facts(self._token_file, self._owner_user),
            state=self.state,
            now=self.ctx.clock.time(),
            progress=self._job_progress,
            job_tag=self.job_tag,
            replica=self._replica,
        )
        return plan, Attempt(self.spawn_seq, round_, plan.ranks, plan.view, plan.tag, started_from)

    @property
    def parent(self) -> str | None:
        """The job of replica groups this agent's job is a group of (None: an ordinary job)."""
        return self._parent

    async def _look_up_lighthouse(self) -> None:
        """A replica group's Lighthouse on this node, asked before each start: it may have
        moved since the last (the daemon restarted). Bounded; not found, the workers start
        without TORCHFT_LIGHTHOUSE and the event says why."""
        replica, look_up = self._replica, self.ctx.lighthouse
        if replica is None or look_up is None or self._parent is None:
            return
        try:
            async with asyncio.timeout(LIGHTHOUSE_TIMEOUT):
                address = await look_up(self._parent)
        except Exception as exc:  # the port is the daemon's: any failure is said, not raised
            self._emit(
                EventKind.LIGHTHOUSE_MISSING,
                f"no Lighthouse on {self.ctx.node} for job {self._parent}: "
                f"{str(exc) or type(exc).__name__}; the group starts without TORCHFT_LIGHTHOUSE",
            )
            address = None
        self._replica = dataclasses.replace(replica, lighthouse=address)

    async def _running(self, round_: RoundInfo, *, early: bool) -> None:
        """The attempt's workers run as the round's: HEALTHY, ``workers.started``, the job
        RUNNING, the recovery's end."""
        self._group.running()
        self._set_state(WorkerState.HEALTHY)  # INIT -> HEALTHY
        self._group.say_started(early=early)
        await self._goodput.began(round_.round, self._spawned_at)
        with contextlib.suppress(InvalidTransition):
            await self.ctx.update_job(self.job_id, state=JobState.RUNNING, round=round_.round)
        await self._recovery.poststart(
            round_, self.spawn_seq, rendezvous_done=self._formed_at, spawned=self._early_spawned
        )

    def _on_progress(self) -> None:
        """The heartbeat files were read: time the first ping after a recovery, publish."""
        if (attempt := self._group.attempt) is not None:
            self._recovery.progressed(attempt.view, attempt.spawn_seq)
        self._publisher.request()

    async def _report_hang(self, hang: Hang, *, kill: bool) -> None:
        """The hang's event and every rank's stacks (kept for its record, :meth:`_record_failure`);
        ``kill``: SIGKILL only that rank (in-process restart)."""
        group = self._group
        assert group.attempt is not None
        if kill:
            self._progress.exited(hang.local_rank)  # judged; its exit will follow
        state = None if kill else WorkerState.UNHEALTHY.value
        stacks = await self._hangs.report(
            hang, group.attempt, group.live_workers(), state=state, kill=kill
        )
        self._hang_stacks = (group.attempt.spawn_seq, stacks)

    async def _stop_workers(self, target: WorkerState | None) -> None:
        try:
            await self._stop_group(target)
        except BaseException:
            await self._departure.settle(wait=False)
            raise
        await self._departure.settle(wait=True)

    async def _stop_group(self, target: WorkerState | None) -> None:
        if await self._group.stop():
            self._recovery.stopped(self.spawn_seq)
        await self._progress.report()  # the attempt's last steps and checkpoint, in the job
        if target is not None and self.state is not target and not self.state.is_terminal:
            with contextlib.suppress(InvalidTransition):
                self._set_state(target)

    # the job document

    async def _record_failure(
        self, round_: RoundInfo, cause: GroupResult | Hang, at: float
    ) -> m.Event:
        """Record the round's failure (charged when the next round forms): FailureRecorded."""
        root, what = self._root_of(round_, cause, at)
        named = await self._watch.named(round_)  # the failure names the round's participants
        alone = self._alone(round_, root)
        job = await self._job.record_failure(named, root, what, self.spawn_seq, alone=alone)
        self._job_progress = job.progress
        await self._attribute(root, job, round_.group_world_size)
        return m.FailureRecorded.of(job, round_.round, self.ctx.rendezvous.solo_round(round_))

    def _root_of(
        self, round_: RoundInfo, cause: GroupResult | Hang, at: float
    ) -> tuple[RootCause, str]:
        """What the job records of the round's failure, and a line for people (no await)."""
        stacks = None
        if isinstance(cause, Hang) and self._group.attempt is not None:
            seq, taken = self._hang_stacks
            stacks = taken if seq == self._group.attempt.spawn_seq else None
        root, what = self._group.root_cause(cause, round_.round, at, stacks)
        if isinstance(cause, Hang):
            seen: float | None = self.ctx.clock.monotonic()
        else:
            seen = cause.root_cause.seen_at if cause.root_cause is not None else None
        if seen is not None and self._formed_seen is not None:
            root = root.model_copy(update={"since_round_s": seen - self._formed_seen})
        return root, what

    def _alone(self, round_: RoundInfo, root: RootCause) -> bool:
        """The failure is charged at once (the budget spent) only where nothing can yet find
        the node at fault and free it: no other node can be lost, no hardware-like signal
        (attributed), no GPU whose check before the next round may quarantine the node."""
        return (
            self.ctx.rendezvous.solo_round(round_) is not None
            and root.signal not in HARDWARE_SIGNALS
            and not self.ctx.cuda_visible_devices
        )

    async def _attribute(self, root: RootCause, job: Job, nodes: int) -> None:
        """This node's share of the failure in its health record, across jobs: a worker
        killed by a hardware-like signal, or the first failure in time of a round of
        ``nodes`` > 1 (in a round of one node the first failure is there by necessity:
        no evidence against the node, and a job crash-looping on its own bug would
        quarantine it for everyone)."""
        attribute = self.ctx.attribute
        if attribute is None:
            return
        where = f"rank {root.rank} of {self.job_id}: {root.message}"
        if root.signal in HARDWARE_SIGNALS:
            await attribute("hardware", self.job_id, root.round, where)
        elif (
            nodes > 1
            and job.error is not None
            and (job.error.node, job.error.round)
            == (
                self.ctx.node,
                root.round,
            )
        ):
            await attribute("first_failure", self.job_id, root.round, where)

    async def _finish_closed(self) -> None:
        """The rendezvous is closed: the job ended (cancelled, failed or succeeded elsewhere)."""
        with contextlib.suppress(ElasticdError):
            job = await self._job.read()
            for target in states_on_close(job.state, self.state):
                self._set_state(target)
            self._emit(
                EventKind.AGENT_FINISHED,
                f"the job is {job.state.value}; agent on {self.ctx.node} done",
                state=self.state.value,
            )

    # state and publication

    @property
    def _who(self) -> tuple[str, str]:
        return self.job_id, self.ctx.node

    def _set_state(self, target: WorkerState) -> None:
        previous = self.state
        self.state = worker_transition(previous, target)
        if (attempt := self._group.attempt) is not None:
            attempt.view.state = self.state
            attempt.view.updated_at = self.ctx.clock.time()
        self._emit(
            EventKind.GROUP_STATE,
            f"worker group on {self.ctx.node}: {previous.value} -> {target.value}",
            state=target.value,
            attempt=self.spawn_seq,
        )
        self._publisher.request()
