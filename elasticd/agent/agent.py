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

Failures are charged to the job-wide budget lazily and exactly once per
round: the failing node records a *pending failure* (the earliest root cause
of the round) in the job document; when the next round completes, the
nodes compare its participants with the failed round's. If every one came
back, it was a real failure and one restart is spent (or the job fails when
none is left). If one is missing, a node was lost and nothing is spent: a
membership change is free, as is a spare taking over
(:mod:`elasticd.agent.edits`).

Every change is an event, and the group view is published to the store so
that any daemon can answer ``GET /jobs/{id}/workers``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import Any

from elasticd.agent import machine as m
from elasticd.agent.attempt import NodeFacts, plan_attempt
from elasticd.agent.context import AgentContext, ConsoleSink, Emit, JobUpdater
from elasticd.agent.edits import charge_now, record_failure, root_cause_of, settle_failure
from elasticd.agent.hooks import (
    Attempt,
    HangHook,
    HealthHook,
    OutputHook,
    ProgressHook,
    RecoveryHook,
    stderr_of,
)
from elasticd.agent.nodefail import cause_of, side_of
from elasticd.agent.progress import Hang
from elasticd.agent.publish import GroupPublisher, decode_group
from elasticd.agent.watch import RoundWatch
from elasticd.errors import (
    ElasticdError,
    InvalidTransition,
    RendezvousClosed,
    RendezvousError,
    SpawnStage,
    StoreError,
    StoreUnavailable,
    WorkerSpawnError,
)
from elasticd.eventkinds import EventKind
from elasticd.keys import group_key, job_key
from elasticd.models import EventSource, GroupView, Job, JobEdit, JobSpec, RootCause
from elasticd.rendezvous import Change, RoundInfo
from elasticd.security import Identity
from elasticd.states import JobState, WorkerState, worker_transition
from elasticd.supervise.process import GroupResult, WorkerExit, WorkerGroupProcesses
from elasticd.tasks import TaskSet, cancel_and_wait, race
from elasticd.worker.names import attempt_tag

__all__ = ["AgentContext", "ConsoleSink", "JobAgent", "JobUpdater", "decode_group"]

log = logging.getLogger("elasticd.agent")

#: Bound on the rendezvous steps of a stopping agent.
LEAVE_TIMEOUT = 5.0
#: Bound on the wait, after the workers are stopped, for the "leaving" write (best effort).
LEAVING_TIMEOUT = 2.0
#: Seconds a passed health check stays good for a start that a failed round delayed.
HEALTH_FRESH_FOR = 60.0


class JobAgent:
    """Runs one job's workers on this node until the job ends."""

    def __init__(self, job: Job, ctx: AgentContext) -> None:
        self.job_id = job.id
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
        #: The round, and its facts: when it formed (wall time), its restart count, and
        #: when its workers were started early (None: after it formed).
        self._round: RoundInfo | None = None
        self._formed_at = 0.0
        self._restart_count = 0
        self._early_spawned: float | None = None
        #: The store work of an early restart while it runs (cancelled with the agent).
        self._store_task: asyncio.Task[tuple[RoundInfo, Job, float]] | None = None
        self._attempt: Attempt | None = None
        self._group: WorkerGroupProcesses | None = None
        self._exited: set[int] = set()
        self._all_exited = asyncio.Event()
        #: Exits of early workers, reported (in order) once their start is confirmed.
        self._held_exits: list[WorkerExit] | None = None
        #: When the health checks last passed, until workers are started after them.
        self._checked_at: float | None = None
        #: Work started where nobody awaits it (the "leaving" write, telling survivors a
        #: rank died, a leave past its bound): owned here, closed when the agent ends.
        self._background = TaskSet(f"agent {job.id}")
        self._leaving: asyncio.Task[None] | None = None  # see _say_leaving
        self._publisher = GroupPublisher(ctx.store, group_key(job.id, ctx.node), lambda: self.view)
        emit = self._emit = Emit(ctx.events, job.id)
        node = ctx.node
        self._watch = RoundWatch(
            node, job.id, ctx.store, ctx.rendezvous, ctx.clock, emit, ctx.fence_after,
            ctx.lease_lapsed,
        )  # fmt: skip
        self._output = OutputHook(emit, node, job.id, self.spec, ctx.console)
        self._recovery = RecoveryHook(emit, node, job.id, ctx.clock, ctx.update_job)
        self._progress = ProgressHook(
            emit, node, self.spec, ctx.policy, self._owner_user, self._on_progress
        )
        self._health = HealthHook(
            emit, node, job.id, self.spec, ctx.health, ctx.clock, ctx.cuda_visible_devices
        )
        self._hangs = HangHook(emit, node)

    @property
    def view(self) -> GroupView | None:
        return self._attempt.view if self._attempt is not None else None

    def refresh_progress(self) -> None:
        """Read the heartbeat files now (64 bytes each) so last_progress_at is current."""
        self._progress.refresh(running_only=True)

    # the loop

    async def run(self) -> None:
        """The agent's whole life; returns when the job is over for this node."""
        self._publisher.start(f"publish-{self.job_id}")
        try:
            await self._run()
        except asyncio.CancelledError:
            # The daemon is stopping, or the fleet's plan took this node from the job.
            await self._on(m.Cancelled(leave_first=self.leave_first))
            raise
        except Exception as exc:
            log.exception("agent for job %s failed", self.job_id)
            reason = f"internal error in the agent on {self.ctx.node}: {type(exc).__name__}: {exc}"
            with contextlib.suppress(ElasticdError):
                await self._on(m.Crashed(reason))
        finally:
            await self._cancel_store_task()
            await self._background.aclose(grace=LEAVING_TIMEOUT)
            await self._publisher.flush()
            # A process of the job still alive keeps its uid taken (read from /proc).
            self.ctx.policy.release_job(self.job_id)
        await self._leave()

    async def abandon(self) -> None:
        """Stop the workers this agent still has and leave the rendezvous (its task died).

        The other nodes re-form at once; a new agent for the job joins as an arrival.
        """
        await self._stop_workers(None)
        self._progress.close()
        with contextlib.suppress(ElasticdError, TimeoutError):
            async with asyncio.timeout(LEAVE_TIMEOUT):
                await self.ctx.rendezvous.leave()

    async def _run(self) -> None:
        await self._check_user()
        while self._machine.phase is not m.Phase.DONE:
            try:
                await self._round_once()
            except StoreError as exc:
                log.warning("job %s on %s: store unavailable: %s", self.job_id, self.ctx.node, exc)
                await self._on(m.StoreLost(isinstance(exc, StoreUnavailable), str(exc)))

    async def _on(self, event: m.Event) -> None:
        """One transition: :func:`~elasticd.agent.machine.step` decides, the effects run."""
        self._machine, effects = m.step(self._machine, event, self.ctx.clock.time())
        for effect in effects:
            await self._do(effect)

    async def _round_once(self) -> None:
        """One round: health checks, the rendezvous, then the round's events until it ends."""
        now = self.ctx.clock.monotonic()
        if self._checked_at is None or now - self._checked_at > HEALTH_FRESH_FOR:
            if not await self._health_checks():
                return
            # Passed: not run again (nor evented) while rounds fail on a lost store,
            # until workers start or the result is stale.
            self._checked_at = now
        early, count = self._machine.early, self._machine.early_restart_count
        group: WorkerGroupProcesses | None = None
        self._early_spawned = None
        try:
            if early is None:
                round_, job, self._formed_at = await self._form_round()
            else:
                store = self._store_task = asyncio.create_task(
                    self._form_round(port=early.master_port)
                )
                group = await self._launch_early(early, count, store)
                self._early_spawned = self.ctx.clock.time() if group is not None else None
                if group is not None and not await self._store_answers_in_time(store):
                    log.warning(
                        "job %s on %s: the store is slow; stopping the early "
                        "workers until it forms the round",
                        *self._who,
                    )
                    await self._stop_group(None)
                    group = self._early_spawned = None
                round_, job, self._formed_at = await store
                self._store_task = None
        except RendezvousClosed:
            await self._on(m.JoinEnded(closed=True))
            return
        except RendezvousError as exc:  # the join timed out
            await self._on(m.JoinEnded(False, f"rendezvous failed on {self.ctx.node}: {exc}"))
            return
        self._round, self._restart_count = round_, job.restart_count
        confirmed = round_ == early and job.restart_count == count
        if group is not None and not confirmed:
            log.info("job %s on %s: the early start did not match the round", *self._who)
            self._early_spawned = None
        await self._on(m.RoundFormed(job.state.is_terminal, group is not None, confirmed))
        while True:  # the round's events, until it ends for this node
            event, self._next = self._next, None
            if event is None and self._machine.phase is m.Phase.RUNNING:
                assert self._group is not None
                event = await self._monitor(self._group, round_)
            if event is None:
                return
            await self._on(event)

    async def _do(self, effect: m.Effect) -> None:  # noqa: C901 - one case per effect
        """Carry out one effect of :func:`~elasticd.agent.machine.step`."""
        round_ = self._round
        match effect:
            case m.BeginRecovery(cause=cause, detected_at=at):
                self._recovery.begin(cause, at, self.spawn_seq)
            case m.SayLeaving():
                assert round_ is not None
                self._say_leaving(round_)
            case m.StopWorkers(target=target):
                await self._stop_workers(target)
            case m.DropEarly():
                await self._stop_group(None)
            case m.StopForOutage():
                if self._group is not None or self.state.is_running:
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
                self._next = await self._start(round_)
            case m.Running(early=early):
                assert round_ is not None
                await self._running(round_, early=early)
            case m.ReleaseGroup():
                await self._release_group()  # every worker exited: nothing of it stays
            case m.WaitAtBarrier():
                assert round_ is not None
                change = await self._watch.exit_barrier(round_, self.spec.exit_barrier_timeout)
                self._next = m.BarrierDone(change)
            case m.RecoveryStopped():
                self._recovery.stopped(self.spawn_seq)
            case m.Reform(change=change):
                await self._membership_change(change)
            case m.Succeed():
                assert round_ is not None
                await self._finish_succeeded(round_)
            case m.CloseRendezvous(quiet=quiet):
                with contextlib.suppress(*((ElasticdError,) if quiet else ())):
                    await self.ctx.rendezvous.close()
            case m.FinishClosed():
                await self._finish_closed()
            case m.FailJob(kind=kind, reason=reason, source=source, error=error):
                seq = self.spawn_seq if effect.in_attempt else None
                root = (
                    None
                    if error is None
                    else RootCause(message=error, node=self.ctx.node, attempt=seq)
                )
                await self._fail_job(kind, reason, source=source, error=root, attempt=seq)
            case m.RetryStart():
                assert round_ is not None
                self._next = await self._retry_later(round_, effect)
            case m.GiveBackJob(waited=waited, error=error, cause=cause):
                await self._give_back(error, cause, waited)
            case m.LeaveRendezvous():
                await self._leave()
            case m.SayLeft():
                self._emit(
                    EventKind.AGENT_FINISHED,
                    f"{self.ctx.node} left the job: it failed its health check",
                )
            case m.CancelEarly():
                await self._cancel_store_task()
            case m.WaitForStore(outage=False):
                # The store answered (a lease that expired while it was away, a compacted
                # watch): not an outage; go again after a short pause.
                await asyncio.sleep(0.2)
            case m.WaitForStore(message=message):
                # One event for the whole outage; the node says store.back for it, also
                # when this agent is gone by then (the plan dropped this node).
                self.ctx.events.store_lost(
                    self.job_id,
                    "agent",
                    f"{self.ctx.node} cannot reach the store ({message}); "
                    "its workers are stopped until the store is back",
                )
                await self._watch.until_store_answers(group_key(self.job_id, self.ctx.node))

    # what is awaited: the user, health checks, the round, the start, the workers

    async def _check_user(self) -> None:
        """Decide the job's user before anything of it runs; refused: UserRefused."""
        try:
            # With run_as = dynamic this claims the job's own uid on this node, kept for
            # every attempt and released when this agent ends (run's finally).
            self._identity = self.ctx.policy.identity_for(
                self.spec.user, owner_user=self._owner_user, job_id=self.job_id
            )
            if self.ctx.job_token is not None:
                self._token_file = self.ctx.job_token(self.job_id, self._identity)
        except WorkerSpawnError as exc:  # its token file: the node's trouble
            message = f"the job cannot run on {self.ctx.node}: {exc}"
            await self._on(m.UserRefused(side_of(exc), message, str(exc), cause_of(exc)))

    async def _health_checks(self) -> bool:
        """Run the health checks before a (re)start; True: healthy, go on.

        A failure spends one restart at once (HealthFailed): a single-node job
        then tries again (or fails once the budget is spent); in a multi-node
        job this node leaves the rendezvous so that a spare or the others carry on.
        """
        root = await self._health.prerun(self._identity)
        if root is None:
            return True
        job = await self.ctx.update_job(self.job_id, mutate=charge_now(root))
        await self._on(m.HealthFailed(job_ended=job.state.is_terminal))
        return False

    async def _form_round(self, *, port: int | None = None) -> tuple[RoundInfo, Job, float]:
        """Rendezvous, then charge the last round's failure: (round, job, when it formed).

        Raises what :meth:`Rendezvous.next_round` raises (closed, timed out, the store).
        """
        started = self.ctx.clock.monotonic()
        round_ = await self.ctx.rendezvous.next_round(port=port)
        # The store served a whole rendezvous: an outage in progress is over (one event).
        self.ctx.events.store_back(self.job_id)
        names = sorted(round_.participants)
        who = ", ".join(names) if round_.roster_known else "nodes named in the round's roster"
        self._emit(
            EventKind.RENDEZVOUS_COMPLETE,
            f"round {round_.round}: {self.ctx.node} is group rank {round_.group_rank} of "
            f"{round_.group_world_size} ({who}), "
            f"master {round_.master_addr}:{round_.master_port}",
            duration_s=self.ctx.clock.monotonic() - started,
            source="rendezvous",
        )
        rendezvous_done = self.ctx.clock.time()
        if not round_.roster_known:
            # A large round's seat names no peers (O(1) bytes per node); settling a
            # failure of the last round compares its participants with this one's.
            pending = (await self._job()).pending_failure
            if pending is not None and pending.round < round_.round:
                round_ = await self._watch.named(round_)
        job = await self.ctx.update_job(self.job_id, mutate=settle_failure(round_))
        return round_, job, rendezvous_done

    async def _store_answers_in_time(self, store: asyncio.Task[Any]) -> bool:
        """Unconfirmed workers run without a round watch: bounded, like a node that loses
        the store (``fence_after``), they stop when it is slow to form the round."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.ctx.fence_after):
                await asyncio.shield(store)
        return store.done()

    async def _launch_early(
        self, round_: RoundInfo, count: int, store: asyncio.Task[tuple[RoundInfo, Job, float]]
    ) -> WorkerGroupProcesses | None:
        """Start the workers of a restart whose round is known before the store says so.

        None when they could not be started: the round's own start (after the
        store) tries again and reports the error as any start does.
        """
        try:
            return await self._launch(round_, count, early=True)
        except WorkerSpawnError as exc:
            log.info("job %s: early start failed (%s); starting after the round", self.job_id, exc)
            return None
        except BaseException:
            await cancel_and_wait(store)
            raise

    async def _start(self, round_: RoundInfo) -> m.Event:
        """Start the round's workers: WorkersStarted, or StartFailed (whose side it is)."""
        try:
            try:
                await self._launch(round_, self._restart_count)
            except OSError as exc:  # the daemon's own work
                raise WorkerSpawnError(
                    f"the daemon could not prepare the start: {exc}", stage=SpawnStage.DAEMON
                ) from exc
        except WorkerSpawnError as exc:
            return m.StartFailed(
                side_of(exc),
                f"workers could not be started on {self.ctx.node}: {exc}",
                error=str(exc),
                cause=cause_of(exc),
                at=self.ctx.clock.monotonic(),
            )
        return m.WorkersStarted()

    async def _retry_later(self, round_: RoundInfo, retry: m.RetryStart) -> m.Event:
        """Say a start is retried, then wait, but not past the round: the job may end,
        or the others re-form. RetryDue, or the change."""
        self._emit(
            EventKind.WORKERS_SPAWN_RETRY,
            f"{self.ctx.node} could not start the workers of attempt {self.spawn_seq} "
            f"({retry.cause}: {retry.error}); this is the node's trouble, not the job's: "
            f"trying again in {retry.delay:.2f} s (try {retry.tries}, no restart spent)",
            attempt=self.spawn_seq,
            cause=retry.cause,
            count=retry.tries,
        )
        which, change = await race(asyncio.sleep(retry.delay), self._watch.change(round_.round))
        if which == 1:
            assert isinstance(change, Change)
            return m.RoundChanged(change)
        return m.RetryDue()

    async def _monitor(self, group: WorkerGroupProcesses, round_: RoundInfo) -> m.Event:
        """The attempt's result, a hang, or the rendezvous change that interrupts it."""
        # In order of precedence when several are ready at once: the group's own
        # result, then a hang, then a rendezvous change.
        contenders = [self._outcome(group)]
        if self._progress.watches_hangs:
            contenders.append(self._hang())
        contenders.append(self._round_changed(round_.round))
        _, event = await race(*contenders)
        return event

    async def _hang(self) -> m.Event:
        return m.HangSeen(await self._progress.hang())

    async def _round_changed(self, my_round: int) -> m.Event:
        return m.RoundChanged(await self._watch.change(my_round))

    async def _outcome(self, group: WorkerGroupProcesses) -> m.Event:
        """torchrun's rule: the first failure ends the attempt.

        With in-process restart a failed rank is the wrapper's business: the
        others carry on without it, so the group succeeded if any worker did,
        and failed only when every worker failed.
        """
        if not self.spec.inprocess_restart:
            return m.WorkersEnded(await group.wait())
        await self._all_exited.wait()
        result = group.snapshot()
        if any(not e.failed for e in result.exits.values()):
            return m.WorkersEnded(GroupResult(succeeded=True, exits=result.exits, failures=()))
        return m.WorkersEnded(result)

    # workers

    async def _launch(
        self, round_: RoundInfo, restart_count: int, *, early: bool = False
    ) -> WorkerGroupProcesses:
        """Spawn the attempt's workers (the group stays INIT until :meth:`_running`).

        ``early``: the store has not formed the round yet; exits are held until
        :meth:`_running` (or the stop) reports them, after ``workers.started``.
        """
        self._release_exits()
        self._held_exits = [] if early else None
        self._checked_at = None  # the next (re)start runs the health checks again
        self.spawn_seq += 1
        self._round = round_
        ctx = self.ctx
        plan = plan_attempt(
            self.job_id,
            self.spec,
            round_,
            restart_count=restart_count,
            attempt=self.spawn_seq,
            node=NodeFacts(
                node=ctx.node,
                logs=ctx.logs,
                base_env=ctx.job_env_base,
                daemon_url=ctx.daemon_url,
                token_file=self._token_file,
                cuda_visible_devices=ctx.cuda_visible_devices,
                owner_user=self._owner_user,
            ),
            state=self.state,
            now=ctx.clock.time(),
        )
        attempt = self._attempt = Attempt(self.spawn_seq, round_, plan.ranks, plan.view, plan.tag)
        self._progress.prerun(attempt, plan.heartbeats, self._identity)
        self._exited = set()
        self._all_exited = asyncio.Event()
        group = self._group = await WorkerGroupProcesses.start(
            plan.launches,
            on_output=self._output.forwarder(attempt),
            on_exit=self._on_exit,
            clock=ctx.clock,
            storage=ctx.storage,
            policy=ctx.policy,
            on_written=ctx.log_growth,
        )
        self._output.poststart(attempt, group)
        return group

    async def _running(self, round_: RoundInfo, *, early: bool) -> None:
        """The attempt's workers run as the round's: HEALTHY, ``workers.started``, the job
        RUNNING, the recovery's end."""
        group, attempt = self._group, self._attempt
        assert group is not None
        assert attempt is not None
        ranks = attempt.ranks
        self._progress.poststart()
        for w in attempt.view.workers:
            w.pid = group.pids.get(w.local_rank)
            w.started_at = group.started_at.get(w.local_rank)
            w.state = WorkerState.HEALTHY
        self._set_state(WorkerState.HEALTHY)  # INIT -> HEALTHY
        self._emit(
            EventKind.WORKERS_STARTED,
            f"attempt {attempt.number} on {self.ctx.node}: {len(ranks)} workers started "
            f"(ranks {ranks[0].rank}-{ranks[-1].rank} of {ranks[0].world_size}), "
            f"pids {', '.join(str(p) for p in group.pids.values())}",
            state=WorkerState.HEALTHY.value,
            attempt=attempt.number,
            early=early or None,
        )
        self._release_exits()
        with contextlib.suppress(InvalidTransition):
            await self.ctx.update_job(self.job_id, state=JobState.RUNNING, round=round_.round)
        await self._recovery.poststart(
            round_, attempt.number, rendezvous_done=self._formed_at, spawned=self._early_spawned
        )

    def _release_exits(self) -> None:
        """Report the exits held while the workers' start was unconfirmed, in order."""
        held, self._held_exits = self._held_exits, None
        for exit_ in held or ():
            self._on_exit(exit_)

    def _on_exit(self, exit_: WorkerExit) -> None:
        """Called the moment a worker process exits (held while its start is unconfirmed)."""
        if self._held_exits is not None:
            self._held_exits.append(exit_)  # reported once the round is the store's
            return
        attempt = self._attempt
        assert attempt is not None
        ranks = attempt.ranks[exit_.local_rank]
        self._progress.exited(exit_.local_rank)
        self._exited.add(exit_.local_rank)
        if len(self._exited) >= len(attempt.ranks):
            self._all_exited.set()
        if self.spec.inprocess_restart and exit_.failed and not exit_.stopped:
            # Tell the surviving ranks at once, so they restart in-process instead of
            # waiting for a collective to time out.
            self._background.spawn(self._report_terminated(exit_, attempt), "report-terminated")
        if exit_.stopped:
            state = WorkerState.STOPPED  # we stopped it; not a failure of its own
        elif exit_.failed:
            state = WorkerState.FAILED
        else:
            state = WorkerState.SUCCEEDED
        for w in attempt.view.workers:
            if w.local_rank == exit_.local_rank:
                w.exit_code = exit_.exit_code
                w.signal = exit_.signal
                w.exited_at = exit_.exited_at
                w.state = state
        suffix = ", stopped by the agent" if exit_.stopped else ""
        error = None
        if exit_.error is not None:
            error = root_cause_of(
                exit_,
                ranks,
                self.ctx.node,
                attempt.number,
                attempt.round.round,
                self._log_dir(exit_.local_rank),
            )
        self._emit(
            EventKind.WORKER_EXITED,
            f"rank {ranks.rank} on {self.ctx.node}: {exit_.describe()}{suffix}",
            state=state.value,
            attempt=attempt.number,
            rank=ranks.rank,
            local_rank=exit_.local_rank,
            pid=exit_.pid,
            exit_code=exit_.exit_code,
            signal=exit_.signal,
            error=error,
            source="worker",
        )
        self._publisher.request()

    async def _report_terminated(self, exit_: WorkerExit, attempt: Attempt) -> None:
        from elasticd.inprocess.keys import report_terminated  # worker-side key layout

        with contextlib.suppress(ElasticdError):
            await report_terminated(
                self.ctx.store,
                self.job_id,
                attempt_tag({"ELASTICD_ATTEMPT": attempt.tag}),
                attempt.rank_of(exit_.local_rank),
                exit_.describe(),
                exit_code=exit_.exit_code,
                signal=exit_.signal,
            )

    def _on_progress(self) -> None:
        """The heartbeat files were read: time the first ping after a recovery, publish."""
        if self._attempt is not None:
            self._recovery.progressed(self._attempt.view, self._attempt.number)
        self._publisher.request()

    async def _report_hang(self, hang: Hang, *, kill: bool) -> None:
        """The hang's event and stacks; ``kill``: SIGKILL only that rank (in-process restart)."""
        assert self._attempt is not None
        if kill:
            self._progress.exited(hang.local_rank)  # judged; its exit will follow
        pid = self._group.pids.get(hang.local_rank) if self._group is not None else None
        stderr = stderr_of(self._log_dir(hang.local_rank))
        state = None if kill else WorkerState.UNHEALTHY.value
        await self._hangs.report(hang, self._attempt, pid, stderr, state=state, kill=kill)

    def _say_leaving(self, round_: RoundInfo) -> None:
        """Tell the other nodes, in the background, that this node heads for the next round.

        Said before the workers are stopped (which may take ``termination_grace``),
        so that a re-rendezvous waits for this node instead of presuming it dead
        (see :mod:`elasticd.rendezvous.protocol`). Best effort: without it the
        round waits out its last call, as before. :meth:`_stop_workers` awaits it.
        """
        if self._leaving is None:
            self._leaving = self._background.spawn(self._tell_leaving(round_.round), "leaving")

    async def _tell_leaving(self, my_round: int) -> None:
        try:
            await self.ctx.rendezvous.leaving(my_round)
        except (StoreError, RendezvousError) as exc:
            log.debug("job %s: could not say this node is leaving: %s", self.job_id, exc)

    async def _release_group(self) -> None:
        """The workers all exited 0: end what is left of the attempt (its strays), quietly."""
        group, self._group = self._group, None
        if group is not None:
            await group.stop(self.spec.termination_grace)
            assert self._attempt is not None
            self._output.stopped(self._attempt, group)

    async def _stop_workers(self, target: WorkerState | None) -> None:
        leaving, self._leaving = self._leaving, None
        try:
            await self._stop_group(target)
        except BaseException:
            if leaving is not None:
                await cancel_and_wait(leaving)
            raise
        if leaving is not None:
            # Best effort, and bounded: a store that does not answer (a full disk under
            # the embedded store) must not hold up what comes after the stop.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(LEAVING_TIMEOUT):
                    await asyncio.shield(leaving)
            await cancel_and_wait(leaving)

    async def _stop_group(self, target: WorkerState | None) -> None:
        group, self._group = self._group, None
        self._release_exits()  # early workers that were never confirmed: their exits first
        if group is not None:
            assert self._attempt is not None
            started = self.ctx.clock.monotonic()
            await group.stop(self.spec.termination_grace)
            self._output.stopped(self._attempt, group)
            for w in self._attempt.view.workers:
                if w.state is WorkerState.HEALTHY:
                    w.state = WorkerState.STOPPED
            self._emit(
                EventKind.WORKERS_STOPPED,
                f"attempt {self.spawn_seq} on {self.ctx.node}: workers stopped",
                attempt=self.spawn_seq,
                duration_s=self.ctx.clock.monotonic() - started,
            )
            self._recovery.stopped(self.spawn_seq)
        if target is not None and self.state is not target and not self.state.is_terminal:
            with contextlib.suppress(InvalidTransition):
                self._set_state(target)

    async def _cancel_store_task(self) -> None:
        task, self._store_task = self._store_task, None
        if task is not None and not task.done():  # a done one was awaited where it ended
            await cancel_and_wait(task)

    async def _leave(self) -> None:
        """Leave the rendezvous, bounded. Past the bound the leave goes on alone (a store
        that cannot write may fail it later), owned by this agent's task set."""
        leave = self._background.spawn(self.ctx.rendezvous.leave(), "leave")
        with contextlib.suppress(ElasticdError, TimeoutError):
            async with asyncio.timeout(LEAVE_TIMEOUT):
                await (self.ctx.rendezvous.leave() if leave is None else asyncio.shield(leave))

    # the job document

    async def _record_failure(
        self, round_: RoundInfo, cause: GroupResult | Hang, at: float
    ) -> m.Event:
        """Record the round's failure (charged when the next round forms): FailureRecorded."""
        assert self._attempt is not None
        if isinstance(cause, Hang):
            rank = self._attempt.rank_of(cause.local_rank)
            root = RootCause(
                message=f"rank {rank} hung: {cause.describe()}",
                node=self.ctx.node,
                local_rank=cause.local_rank,
                rank=rank,
                timestamp=at,
                exited_at=at,
                attempt=self.spawn_seq,
                round=round_.round,
                log_dir=str(self._log_dir(cause.local_rank)),
            )
            what = f"rank {rank} hung on {self.ctx.node}"
        else:
            failure = cause.root_cause
            assert failure is not None, "a failed attempt has a failed worker"
            root = root_cause_of(
                failure,
                self._attempt.ranks[failure.local_rank],
                self.ctx.node,
                self.spawn_seq,
                round_.round,
                self._log_dir(failure.local_rank),
            )
            what = f"rank {root.rank} failed on {self.ctx.node}: {root.message}"
        named = await self._watch.named(round_)  # the failure names the round's participants
        job = await self.ctx.update_job(self.job_id, mutate=record_failure(named, root))
        self._emit(
            EventKind.GROUP_RESTARTING,
            f"{what}; re-forming the group",
            state=WorkerState.STOPPED.value,
            attempt=self.spawn_seq,
            rank=root.rank,
            local_rank=root.local_rank,
            exit_code=root.exit_code,
            signal=root.signal,
            error=root,
        )
        pending = job.pending_failure
        return m.FailureRecorded(
            job_ended=job.state.is_terminal,
            restart_count=job.restart_count,
            max_restarts=job.max_restarts,
            recorded_here=pending is not None and pending.round == round_.round,
            solo=self.ctx.rendezvous.solo_round(round_),
        )

    async def _fail_job(
        self,
        kind: EventKind,
        reason: str,
        *,
        source: EventSource = "agent",
        error: RootCause | None = None,
        attempt: int | None = None,
    ) -> None:
        """The job cannot go on (a join timeout, a spawn that failed, an internal error):
        the event, the job FAILED with the reason, the rendezvous closed for every node."""
        self._emit(kind, reason, source, state="FAILED", attempt=attempt)
        with contextlib.suppress(InvalidTransition):
            if error is None:
                await self.ctx.update_job(self.job_id, state=JobState.FAILED, reason=reason)
            else:
                await self.ctx.update_job(
                    self.job_id, state=JobState.FAILED, reason=reason, error=error
                )
        await self.ctx.rendezvous.close()

    async def _give_back(self, error: str, cause: str, waited: float) -> None:
        """Stop trying: say so, and leave the job to the scheduler (no restart spent).

        The job keeps its state (PENDING or RESTARTING, or RUNNING where other
        nodes run it) with the reason; :attr:`gave_back` tells the job service to
        decline the job here for a while, and :meth:`run` leaves the rendezvous
        on the way out, so the others re-form without this node.
        """
        self.gave_back = True
        if self.state is WorkerState.INIT:
            self._set_state(WorkerState.STOPPED)  # INIT -> STOPPED: nothing of it runs
        reason = (
            f"{self.ctx.node} could not start the job's workers for {waited:.0f} s "
            f"({cause}: {error}); it gave the job back to the scheduler"
        )
        self._emit(
            EventKind.AGENT_GAVE_BACK,
            reason + "; no restart spent",
            attempt=self.spawn_seq,
            cause=cause,
            duration_s=waited,
        )

        def note(job: Job) -> JobEdit:
            if job.state in (JobState.PENDING, JobState.RESTARTING):
                return {"reason": reason}
            return {}

        with contextlib.suppress(InvalidTransition):
            await self.ctx.update_job(self.job_id, mutate=note)

    async def _membership_change(self, change: Change) -> None:
        self._emit(
            EventKind.RENDEZVOUS_CHANGE,
            f"re-forming the group: {change.value} (no restart spent)",
            attempt=self.spawn_seq,
            source="rendezvous",
        )

        def restarting(job: Job) -> JobEdit:
            if job.state is JobState.RUNNING:
                return {"state": JobState.RESTARTING, "reason": change.value}
            return {}

        with contextlib.suppress(InvalidTransition):
            await self.ctx.update_job(self.job_id, mutate=restarting)
        self._set_state(WorkerState.INIT)  # STOPPED -> INIT

    async def _finish_closed(self) -> None:
        """The rendezvous is closed: the job ended (cancelled, failed or succeeded elsewhere)."""
        with contextlib.suppress(ElasticdError):
            job = await self._job()
            if job.state is JobState.SUCCEEDED and self.state in (
                WorkerState.HEALTHY,
                WorkerState.UNHEALTHY,
            ):
                self._set_state(WorkerState.SUCCEEDED)
            elif job.state is JobState.FAILED and not self.state.is_terminal:
                if self.state is WorkerState.INIT:
                    self._set_state(WorkerState.STOPPED)
                self._set_state(WorkerState.FAILED)
            elif not self.state.is_terminal and self.state is not WorkerState.STOPPED:
                self._set_state(WorkerState.STOPPED)
            self._emit(
                EventKind.AGENT_FINISHED,
                f"the job is {job.state.value}; agent on {self.ctx.node} done",
                state=self.state.value,
            )

    async def _finish_succeeded(self, round_: RoundInfo) -> None:
        self._set_state(WorkerState.SUCCEEDED)  # HEALTHY -> SUCCEEDED

        def succeeded(job: Job) -> JobEdit:
            if job.round == round_.round and not job.state.is_terminal:
                return {"state": JobState.SUCCEEDED, "reason": "every worker exited 0"}
            return {}

        with contextlib.suppress(InvalidTransition):
            await self.ctx.update_job(self.job_id, mutate=succeeded)
        await self.ctx.rendezvous.close()

    async def _job(self) -> Job:
        entry = await self.ctx.store.get(job_key(self.job_id))
        if entry is None:
            raise ElasticdError(f"job {self.job_id} vanished from the store")
        return Job.model_validate_json(entry.value)

    # state and publication

    @property
    def _who(self) -> tuple[str, str]:
        return self.job_id, self.ctx.node

    def _log_dir(self, local_rank: int) -> Path:
        return self.ctx.logs.worker_dir(self.job_id, self.spawn_seq, local_rank)

    def _set_state(self, target: WorkerState) -> None:
        previous = self.state
        self.state = worker_transition(previous, target)
        if self._attempt is not None:
            self._attempt.view.state = self.state
            self._attempt.view.updated_at = self.ctx.clock.time()
        self._emit(
            EventKind.GROUP_STATE,
            f"worker group on {self.ctx.node}: {previous.value} -> {target.value}",
            state=target.value,
            attempt=self.spawn_seq,
        )
        self._publisher.request()
