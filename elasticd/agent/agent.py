"""The per-job agent loop: rendezvous → ranks → spawn → monitor → restart | succeed | fail.

The agent owns the local worker group of one job on this node. While the
workers run it races three things, none of them polled: a worker's exit
(awaited), a change of the shared rendezvous (watched: a node waiting to
join, a participant's lease gone, a new round, the rendezvous closed), and
the end of the job.

Failures are charged to the job-wide budget lazily and exactly once per
round: the failing node records a *pending failure* (the earliest root cause
of the round) in the job document; when the next round completes, the
nodes compare its participants with the failed round's. If every one came
back, it was a real failure and one restart is spent (or the job fails when
none is left). If one is missing, a node was lost (its survivors' workers
fail too, from the lost peer) and nothing is spent: a membership change is
free, as is a spare taking over.

Every change is an event, and the group view is published to the store so
that any daemon can answer ``GET /jobs/{id}/workers``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal as signals
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from typing_extensions import Unpack

from elasticd.agent.attempt import NodeFacts, plan_attempt
from elasticd.agent.edits import (
    charge_now,
    merge_recovery,
    record_failure,
    root_cause_of,
    settle_failure,
)
from elasticd.agent.machine import (
    AgentState,
    BarrierDone,
    BeginRecovery,
    CancelEarly,
    Cancelled,
    CloseRendezvous,
    Crashed,
    DropEarly,
    Effect,
    Event,
    FailJob,
    FailureRecorded,
    FinishClosed,
    GiveBackJob,
    HangSeen,
    HealthFailed,
    JoinEnded,
    LeaveRendezvous,
    Phase,
    PlanEarlyRestart,
    RecordFailure,
    RecoveryStopped,
    Reform,
    ReleaseGroup,
    ReportHang,
    RetryDue,
    RetryStart,
    RoundChanged,
    RoundFormed,
    Running,
    SayLeaving,
    SayLeft,
    SetState,
    StartFailed,
    StartWorkers,
    StopForOutage,
    StopWorkers,
    StoreLost,
    Succeed,
    UserRefused,
    WaitAtBarrier,
    WaitForStore,
    WorkersEnded,
    WorkersStarted,
    step,
)
from elasticd.agent.nodefail import (
    RetrySettings,
    cause_of,
    side_of,
)
from elasticd.agent.ports import EventSink, HealthChecks, LogGrown
from elasticd.agent.progress import Beat, Hang, ProgressMonitor, ProgressSettings, dump_stacks
from elasticd.agent.publish import GroupPublisher
from elasticd.agent.recovery import RecoveryTimeline
from elasticd.clock import SYSTEM_CLOCK, Clock
from elasticd.console import ConsoleLine
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
from elasticd.eventkinds import EventKind, recovery_phase_kind
from elasticd.keys import barrier_prefix, group_key, job_key
from elasticd.logs import LogLayout, stream_file
from elasticd.models import (
    EventSource,
    GroupView,
    Job,
    JobEdit,
    JobMutation,
    JobSpec,
    RootCause,
    std_for_rank,
)
from elasticd.rendezvous import Change, Rendezvous, RoundInfo
from elasticd.rendezvous.ranks import WorkerRanks
from elasticd.security import Identity
from elasticd.states import JobState, WorkerState, worker_transition
from elasticd.storage import StorageHealth
from elasticd.store import Store
from elasticd.supervise.process import (
    GroupResult,
    WorkerExit,
    WorkerGroupProcesses,
)
from elasticd.supervise.spawn import DEFAULT_POLICY, SpawnPolicy
from elasticd.tasks import TaskSet, cancel_and_wait, race
from elasticd.worker.names import attempt_tag

log = logging.getLogger("elasticd.agent")

#: Receives the worker output that reaches the launcher's console (see elasticd.console).
ConsoleSink = Callable[[ConsoleLine], None]


class JobUpdater(Protocol):
    """``JobService.update_job``: a compare-and-set update of the job document."""

    async def __call__(
        self, job_id: str, *, mutate: JobMutation | None = None, **changes: Unpack[JobEdit]
    ) -> Job: ...


#: Bound on the rendezvous steps of a stopping agent.
LEAVE_TIMEOUT = 5.0
#: Bound on the wait, after the workers are stopped, for the "leaving" write (best effort).
LEAVING_TIMEOUT = 2.0


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
    #: What the job's own processes (workers, its health check) start from, before its
    #: ``env``: the daemon's allowlisted environment (:func:`~elasticd.supervise.env.job_base_env`);
    #: None: ``base_env`` whole.
    job_base_env: Mapping[str, str] | None = None
    #: How a start the node cannot make is retried before the job is given back.
    node_failure: RetrySettings = field(default_factory=RetrySettings)

    @property
    def job_env_base(self) -> Mapping[str, str]:
        return self.base_env if self.job_base_env is None else self.job_base_env


#: Seconds a passed health check stays good for a start that a failed round delayed.
HEALTH_FRESH_FOR = 60.0


@dataclass
class StoreLoss:
    """How long the store has been out of reach *without a break*: the fencing decision.

    A node fences (stops its workers) only after ``fence_after`` seconds of
    continuous loss: every successful store request (:meth:`reached`) starts
    the count again, so two short hiccups far apart never add up.
    """

    fence_after: float
    since: float | None = None
    """Monotonic time of the first failure since the store was last reached."""
    backoff: float = 0.1
    """Seconds to wait before the next try."""

    def reached(self) -> None:
        """A store request succeeded."""
        self.since = None
        self.backoff = 0.1

    def failed(self, now: float) -> bool:
        """A store request failed at ``now``; True when the node must fence."""
        if self.since is None:
            self.since = now
            self.backoff = 0.1
        else:
            self.backoff = min(self.backoff * 2, 1.0)
        return now - self.since >= self.fence_after

    def lost_for(self, now: float) -> float:
        return 0.0 if self.since is None else now - self.since


class JobAgent:
    """Runs one job's workers on this node until the job ends."""

    def __init__(self, job: Job, ctx: AgentContext) -> None:
        self.job_id = job.id
        self.spec: JobSpec = job.spec
        #: The Unix user its submitter proved to be: its jobs may run as that user.
        self._owner_user = job.owner.unix_user if job.owner is not None else None
        #: The workers' ELASTICD_TOKEN_FILE: the job's own token (decided with the user).
        self._token_file = ctx.token_file
        self.ctx = ctx
        self.attempt = -1
        self.state = WorkerState.INIT
        self._group: WorkerGroupProcesses | None = None
        self._leaving: asyncio.Task[None] | None = None  # see _say_leaving
        #: Work started where nobody awaits it (telling survivors a rank died): owned here.
        self._background = TaskSet(f"agent {job.id}")
        self._view: GroupView | None = None
        self._ranks: list[WorkerRanks] = []
        self._round: RoundInfo | None = None
        #: Set before the agent is cancelled for the fleet's plan: leave before stopping.
        self.leave_first = False
        self._publisher = GroupPublisher(ctx.store, group_key(job.id, ctx.node), lambda: self._view)
        #: The recovery in progress: (cause, detected_at, stopped_at, rendezvous_started).
        self._recovery = RecoveryTimeline()
        self._progress: ProgressMonitor | None = None
        self._exited: set[int] = set()
        self._all_exited = asyncio.Event()
        #: Wall time the workers of a recovery were spawned, until their first ping.
        self._awaiting_first_progress: float | None = None
        self._attempt_tag = ""
        #: When the health checks last passed, until workers are started after them.
        self._checked_at: float | None = None
        #: The user the job runs as (None: the daemon's), decided before anything of it runs.
        self._identity: Identity | None = None
        #: ``containment.partial`` was emitted (once per job per node).
        self._said_partial = False
        #: Where the agent is, what its decisions depend on (:mod:`elasticd.agent.machine`).
        self._machine = AgentState(
            inprocess_restart=self.spec.inprocess_restart,
            multi_node=(self.spec.max_nodes or 1) > 1,
            retry=ctx.node_failure,
        )
        #: The event an effect produced (the round's next), for the runner to step on.
        self._next: Event | None = None
        #: The current round's facts: when it formed (wall time), its restart count, and
        #: when its workers were started early (None: after it formed).
        self._formed_at = 0.0
        self._restart_count = 0
        self._early_spawned: float | None = None
        #: The store work of an early restart while it runs (cancelled with the agent).
        self._store_task: asyncio.Task[tuple[RoundInfo, Job, float]] | None = None
        #: Exits of early workers, reported (in order) once their start is confirmed.
        self._held_exits: list[WorkerExit] | None = None
        #: This node could not start the job's workers for ``node_failure.grace`` and gave
        #: the job back (:mod:`elasticd.agent.nodefail`): the job service declines it a while.
        self.gave_back = False

    @property
    def view(self) -> GroupView | None:
        return self._view

    def refresh_progress(self) -> None:
        """Read the heartbeat files now (64 bytes each) so last_progress_at is current."""
        if self._view is None or self._progress is None:
            return
        for w in self._view.workers:
            if w.state is WorkerState.HEALTHY or w.state is WorkerState.UNHEALTHY:
                w.last_progress_at = self._progress.last_progress_at(w.local_rank)

    # the loop

    async def run(self) -> None:
        """The agent's whole life; returns when the job is over for this node."""
        self._publisher.start(f"publish-{self.job_id}")
        try:
            await self._run()
        except asyncio.CancelledError:
            # The daemon is stopping, or the fleet's plan took this node from the job.
            await self._on(Cancelled(leave_first=self.leave_first))
            raise
        except Exception as exc:
            log.exception("agent for job %s failed", self.job_id)
            reason = f"internal error in the agent on {self.ctx.node}: {type(exc).__name__}: {exc}"
            await self._on(Crashed(reason))
        finally:
            await self._cancel_store_task()
            await self._background.aclose(grace=LEAVING_TIMEOUT)
            await self._publisher.flush()
            # A process of the job still alive keeps its uid taken (read from /proc).
            self.ctx.policy.release_job(self.job_id)
        await self._leave()

    async def _cancel_store_task(self) -> None:
        task, self._store_task = self._store_task, None
        if task is not None and not task.done():  # a done one was awaited where it ended
            await cancel_and_wait(task)

    async def abandon(self) -> None:
        """Stop the workers this agent still has and leave the rendezvous (its task died).

        The other nodes re-form at once; a new agent for the job joins as an arrival.
        """
        await self._stop_workers(None)
        if self._progress is not None:
            self._progress.close()
        with contextlib.suppress(ElasticdError, TimeoutError):
            async with asyncio.timeout(LEAVE_TIMEOUT):
                await self.ctx.rendezvous.leave()

    async def _run(self) -> None:
        await self._check_user()
        while self._machine.phase is not Phase.DONE:
            try:
                await self._round_once()
            except StoreError as exc:
                log.warning("job %s on %s: store unavailable: %s", self.job_id, self.ctx.node, exc)
                await self._on(StoreLost(isinstance(exc, StoreUnavailable), str(exc)))

    async def _on(self, event: Event) -> None:
        """One transition: :func:`~elasticd.agent.machine.step` decides, the effects run."""
        self._machine, effects = step(self._machine, event, self.ctx.clock.time())
        for effect in effects:
            await self._do(effect)

    def _store_reached(self) -> None:
        """The store served a whole rendezvous: an outage in progress is over (one event)."""
        self.ctx.events.store_back(self.job_id)

    async def _until_store_answers(self) -> None:
        """Probe the store with backoff (0.1 s to 2 s) until a read succeeds."""
        backoff = 0.1
        key = group_key(self.job_id, self.ctx.node)
        while True:
            await asyncio.sleep(backoff)
            try:
                await self.ctx.store.get(key)
                return
            except StoreError:
                backoff = min(backoff * 2, 2.0)

    async def _round_once(self) -> None:
        """One round: health checks, the rendezvous, then the round's events until it ends."""
        now = self.ctx.clock.monotonic()
        if self._checked_at is None or now - self._checked_at > HEALTH_FRESH_FOR:
            if not await self._health_checks():
                return
            # Passed: not run again (nor evented) while rounds fail on a lost store,
            # until workers start or the result is stale.
            self._checked_at = now
        early = self._machine.early
        count = self._machine.early_restart_count
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
            await self._on(JoinEnded(closed=True))
            return
        except RendezvousError as exc:  # the join timed out
            await self._on(JoinEnded(False, f"rendezvous failed on {self.ctx.node}: {exc}"))
            return
        self._round = round_
        self._restart_count = job.restart_count
        confirmed = round_ == early and job.restart_count == count
        if group is not None and not confirmed:
            log.info("job %s on %s: the early start did not match the round", *self._who)
            self._early_spawned = None
        await self._on(RoundFormed(job.state.is_terminal, group is not None, confirmed))
        while True:  # the round's events, until it ends for this node
            event, self._next = self._next, None
            if event is None and self._machine.phase is Phase.RUNNING:
                assert self._group is not None
                event = await self._monitor(self._group, round_)
            if event is None:
                return
            await self._on(event)

    async def _store_answers_in_time(self, store: asyncio.Task[Any]) -> bool:
        """Unconfirmed workers run without a round watch: bounded, like a node that loses
        the store (``fence_after``), they stop when it is slow to form the round."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.ctx.fence_after):
                await asyncio.shield(store)
        return store.done()

    async def _launch_guarded(self, round_: RoundInfo, restart_count: int) -> WorkerGroupProcesses:
        """:meth:`_launch`, an ``OSError`` of the daemon's own work turned into a spawn error."""
        try:
            return await self._launch(round_, restart_count)
        except OSError as exc:
            raise WorkerSpawnError(
                f"the daemon could not prepare the start: {exc}", stage=SpawnStage.DAEMON
            ) from exc

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
            attempt=self.attempt,
            cause=cause,
            duration_s=waited,
        )

        def note(job: Job) -> JobEdit:
            if job.state in (JobState.PENDING, JobState.RESTARTING):
                return {"reason": reason}
            return {}

        with contextlib.suppress(InvalidTransition):
            await self.ctx.update_job(self.job_id, mutate=note)

    @property
    def _who(self) -> tuple[str, str]:
        return self.job_id, self.ctx.node

    async def _form_round(self, *, port: int | None = None) -> tuple[RoundInfo, Job, float]:
        """Rendezvous, then charge the last round's failure: (round, job, when it formed).

        Raises what :meth:`Rendezvous.next_round` raises (closed, timed out, the store).
        """
        started = self.ctx.clock.monotonic()
        round_ = await self.ctx.rendezvous.next_round(port=port)
        self._store_reached()
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
                round_ = await self._named(round_)
        job = await self.ctx.update_job(self.job_id, mutate=settle_failure(round_))
        return round_, job, rendezvous_done

    async def _launch_early(
        self,
        round_: RoundInfo,
        restart_count: int,
        store: asyncio.Task[tuple[RoundInfo, Job, float]],
    ) -> WorkerGroupProcesses | None:
        """Start the workers of a restart whose round is known before the store says so.

        None when they could not be started: the round's own start (after the
        store) tries again and reports the error as any start does.
        """
        try:
            return await self._launch(round_, restart_count, early=True)
        except WorkerSpawnError as exc:
            log.info("job %s: early start failed (%s); starting after the round", self.job_id, exc)
            return None
        except BaseException:
            await cancel_and_wait(store)
            raise

    async def _do(self, effect: Effect) -> None:
        """Carry out one effect of :func:`~elasticd.agent.machine.step`."""
        round_ = self._round
        match effect:
            case BeginRecovery(cause=cause, detected_at=at):
                self._begin_recovery(cause, at)
            case SayLeaving():
                assert round_ is not None
                self._say_leaving(round_)
            case StopWorkers(target=target):
                await self._stop_workers(target)
            case DropEarly():
                await self._stop_group(None)
            case StopForOutage():
                if self._group is not None or self.state.is_running:
                    await self._stop_workers(WorkerState.STOPPED)
                if self.state is WorkerState.STOPPED:
                    self._set_state(WorkerState.INIT)  # STOPPED -> INIT
            case SetState(target=target, unless_ended=unless_ended):
                if not (unless_ended and self.state.is_terminal):
                    self._set_state(target)
            case ReportHang(hang=hang, kill=True):
                await self._kill_hung_rank(hang)
            case ReportHang(hang=hang):
                await self._report_hang(hang, state=WorkerState.UNHEALTHY.value)
            case RecordFailure(cause=cause, at=at):
                assert round_ is not None
                await self._record_failure(round_, cause, at)
            case PlanEarlyRestart():
                pass  # the machine keeps it: the next round's start reads it
            case StartWorkers():
                assert round_ is not None
                self._next = await self._start(round_)
            case Running(early=early):
                assert round_ is not None
                assert self._group is not None
                self._started(self._group, early=early)
                with contextlib.suppress(InvalidTransition):
                    await self.ctx.update_job(
                        self.job_id, state=JobState.RUNNING, round=round_.round
                    )
                await self._finish_recovery(
                    round_, rendezvous_done=self._formed_at, spawned=self._early_spawned
                )
            case ReleaseGroup():
                await self._release_group()  # every worker exited: nothing of it stays
            case WaitAtBarrier():
                assert round_ is not None
                self._next = BarrierDone(await self._exit_barrier(round_))
            case RecoveryStopped():
                self._recovery_stopped()
            case Reform(change=change):
                await self._membership_change(change)
            case Succeed():
                assert round_ is not None
                await self._finish_succeeded(round_)
            case CloseRendezvous(quiet=quiet):
                with contextlib.suppress(*((ElasticdError,) if quiet else ())):
                    await self.ctx.rendezvous.close()
            case FinishClosed():
                await self._finish_closed()
            case FailJob(kind=kind, reason=reason, source=source, error=error):
                attempt = self.attempt if effect.in_attempt else None
                root = None
                if error is not None:
                    root = RootCause(message=error, node=self.ctx.node, attempt=attempt)
                await self._fail_job(kind, reason, source=source, error=root, attempt=attempt)
            case RetryStart():
                assert round_ is not None
                self._next = await self._retry_later(round_, effect)
            case GiveBackJob(waited=waited, error=error, cause=cause):
                await self._give_back(error, cause, waited)
            case LeaveRendezvous():
                await self._leave()
            case SayLeft():
                self._emit(
                    EventKind.AGENT_FINISHED,
                    f"{self.ctx.node} left the job: it failed its health check",
                )
            case CancelEarly():
                await self._cancel_store_task()
            case WaitForStore(outage=False):
                # The store answered (a lease that expired while it was away, a compacted
                # watch): not an outage; go again after a short pause.
                await asyncio.sleep(0.2)
            case WaitForStore(message=message):
                # One event for the whole outage; the node says store.back for it, also
                # when this agent is gone by then (the plan dropped this node).
                self.ctx.events.store_lost(
                    self.job_id,
                    "agent",
                    f"{self.ctx.node} cannot reach the store ({message}); "
                    "its workers are stopped until the store is back",
                )
                await self._until_store_answers()

    async def _start(self, round_: RoundInfo) -> Event:
        """Start the round's workers: WorkersStarted, or StartFailed (whose side it is)."""
        try:
            await self._launch_guarded(round_, self._restart_count)
        except WorkerSpawnError as exc:
            return StartFailed(
                side_of(exc),
                f"workers could not be started on {self.ctx.node}: {exc}",
                error=str(exc),
                cause=cause_of(exc),
                at=self.ctx.clock.monotonic(),
            )
        return WorkersStarted()

    async def _retry_later(self, round_: RoundInfo, retry: RetryStart) -> Event:
        """Say a start is retried, then wait, but not past the round: the job may end,
        or the others re-form. RetryDue, or the change."""
        self._emit(
            EventKind.WORKERS_SPAWN_RETRY,
            f"{self.ctx.node} could not start the workers of attempt {self.attempt} "
            f"({retry.cause}: {retry.error}); this is the node's trouble, not the job's: "
            f"trying again in {retry.delay:.2f} s (try {retry.tries}, no restart spent)",
            attempt=self.attempt,
            cause=retry.cause,
            count=retry.tries,
        )
        which, change = await race(asyncio.sleep(retry.delay), self._watch_round(round_.round))
        if which == 1:
            assert isinstance(change, Change)
            return RoundChanged(change)
        return RetryDue()

    async def _leave(self) -> None:
        """Leave the rendezvous, bounded. Past the bound the leave goes on alone (a store
        that cannot write may fail it later), owned by this agent's task set."""
        leave = self._background.spawn(self.ctx.rendezvous.leave(), name="leave")
        if leave is None:  # the agent is over: leave in its own time, bounded
            with contextlib.suppress(ElasticdError, TimeoutError):
                async with asyncio.timeout(LEAVE_TIMEOUT):
                    await self.ctx.rendezvous.leave()
            return
        with contextlib.suppress(ElasticdError, TimeoutError):
            async with asyncio.timeout(LEAVE_TIMEOUT):
                await asyncio.shield(leave)

    def _emit(
        self, kind: EventKind, message: str, source: EventSource = "agent", **fields: Any
    ) -> None:
        """One event of this job from this node's agent."""
        self.ctx.events.emit(self.job_id, source, kind, message, **fields)

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

    async def _membership_change(self, change: Change) -> None:
        self._emit(
            EventKind.RENDEZVOUS_CHANGE,
            f"re-forming the group: {change.value} (no restart spent)",
            attempt=self.attempt,
            source="rendezvous",
        )
        with contextlib.suppress(InvalidTransition):
            await self.ctx.update_job(
                self.job_id,
                mutate=lambda job: (
                    {"state": JobState.RESTARTING, "reason": change.value}
                    if job.state is JobState.RUNNING
                    else {}
                ),
            )
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
        with contextlib.suppress(InvalidTransition):
            await self.ctx.update_job(
                self.job_id,
                mutate=lambda job: (
                    {"state": JobState.SUCCEEDED, "reason": "every worker exited 0"}
                    if job.round == round_.round and not job.state.is_terminal
                    else {}
                ),
            )
        await self.ctx.rendezvous.close()

    async def _job(self) -> Job:
        entry = await self.ctx.store.get(job_key(self.job_id))
        if entry is None:
            raise ElasticdError(f"job {self.job_id} vanished from the store")
        return Job.model_validate_json(entry.value)

    async def _named(self, round_: RoundInfo) -> RoundInfo:
        """``round_`` with every participant named, read only when needed (large rounds)."""
        if round_.roster_known:
            return round_
        try:
            return await self.ctx.rendezvous.roster(round_)
        except RendezvousError as exc:  # the roster is gone: callers fall back to counts
            log.info("%s: %s", self.job_id, exc)
            return round_

    async def _exit_barrier(self, round_: RoundInfo) -> Change | None:
        """Wait for every participant of the round to finish too (up to exit_barrier_timeout)."""
        started = self.ctx.clock.monotonic()
        prefix = barrier_prefix(self.job_id, round_.round)
        await self.ctx.store.put(prefix + self.ctx.node, b"done")
        round_ = await self._named(round_)
        wanted = set(round_.participants)
        change_task = asyncio.create_task(self.ctx.rendezvous.wait_for_change(round_.round))
        watching: Awaitable[Change | list[Any]]
        try:
            async with asyncio.timeout(self.spec.exit_barrier_timeout):
                while True:
                    listing = await self.ctx.store.list(prefix)
                    done = {e.key[len(prefix) :] for e in listing.entries}
                    if wanted <= done and len(done) >= round_.group_world_size:
                        break
                    if change_task.done():
                        return change_task.result()
                    watching = self.ctx.store.watch(prefix, listing.revision, 30.0, prefix=True)
                    changing: Awaitable[Change | list[Any]] = asyncio.shield(change_task)
                    which, result = await race(changing, watching)
                    if which == 0:
                        assert isinstance(result, Change)
                        return result
        except TimeoutError:
            self._emit(
                EventKind.EXIT_BARRIER_TIMEOUT,
                f"not every node finished within {self.spec.exit_barrier_timeout}s; "
                "finishing anyway",
            )
        finally:
            await cancel_and_wait(change_task)
        self._emit(
            EventKind.EXIT_BARRIER_DONE,
            "every node of the round finished",
            duration_s=self.ctx.clock.monotonic() - started,
        )
        return None

    # workers

    async def _launch(
        self, round_: RoundInfo, restart_count: int, *, early: bool = False
    ) -> WorkerGroupProcesses:
        """Spawn the attempt's workers (the group stays INIT until :meth:`_started`).

        ``early``: the store has not formed the round yet; exits are held until
        :meth:`_started` (or the stop) reports them, after ``workers.started``.
        """
        self._release_exits()
        self._held_exits = [] if early else None
        self._checked_at = None  # the next (re)start runs the health checks again
        self.attempt += 1
        self._round = round_
        plan = plan_attempt(
            self.job_id,
            self.spec,
            round_,
            restart_count=restart_count,
            attempt=self.attempt,
            node=NodeFacts(
                node=self.ctx.node,
                logs=self.ctx.logs,
                base_env=self.ctx.job_env_base,
                daemon_url=self.ctx.daemon_url,
                token_file=self._token_file,
                cuda_visible_devices=self.ctx.cuda_visible_devices,
                owner_user=self._owner_user,
            ),
            state=self.state,
            now=self.ctx.clock.time(),
        )
        self._ranks = plan.ranks
        launches = plan.launches
        if self._progress is not None:
            self._progress.close()  # the previous attempt's descriptors
        self._progress = ProgressMonitor(
            plan.heartbeats,
            ProgressSettings(self.spec.progress_timeout, self.spec.startup_timeout),
            user=self.spec.user,  # the worker's own user must write its file
            owner_user=self._owner_user,
            owner=None if self._identity is None else (self._identity.uid, self._identity.gid),
            on_check=self._on_progress,
            on_replaced=self._on_heartbeat_replaced,
            policy=self.ctx.policy,
        )
        self._progress.prepare()  # before the spawn: workers open the file at their first ping
        self._attempt_tag = plan.tag
        self._exited = set()
        self._all_exited = asyncio.Event()
        self._view = plan.view
        on_output = self._forward_output if self.ctx.console is not None else None
        group = await WorkerGroupProcesses.start(
            launches,
            on_output=on_output,
            on_exit=self._on_exit,
            clock=self.ctx.clock,
            storage=self.ctx.storage,
            policy=self.ctx.policy,
            on_written=self.ctx.log_growth,
        )
        self._group = group
        if group.containment_partial is not None and not self._said_partial:
            self._said_partial = True
            self._emit(
                EventKind.CONTAINMENT_PARTIAL,
                f"{self.ctx.node} cannot put the job's processes in a cgroup "
                f"({group.containment_partial}); a process that leaves a worker's process "
                "group is found only if it is re-parented to the daemon (child subreaper)",
                attempt=self.attempt,
            )
        return group

    def _started(self, group: WorkerGroupProcesses, *, early: bool = False) -> None:
        """The attempt's workers run as the round's: HEALTHY, ``workers.started``."""
        assert self._progress is not None
        assert self._view is not None
        ranks = self._ranks
        self._progress.started()
        for w in self._view.workers:
            w.pid = group.pids.get(w.local_rank)
            w.started_at = group.started_at.get(w.local_rank)
            w.state = WorkerState.HEALTHY
        self._set_state(WorkerState.HEALTHY)  # INIT -> HEALTHY
        self._emit(
            EventKind.WORKERS_STARTED,
            f"attempt {self.attempt} on {self.ctx.node}: {len(ranks)} workers started "
            f"(ranks {ranks[0].rank}-{ranks[-1].rank} of {ranks[0].world_size}), "
            f"pids {', '.join(str(p) for p in group.pids.values())}",
            state=WorkerState.HEALTHY.value,
            attempt=self.attempt,
            early=early or None,
        )
        self._release_exits()

    def _release_exits(self) -> None:
        """Report the exits held while the workers' start was unconfirmed, in order."""
        held, self._held_exits = self._held_exits, None
        for exit_ in held or ():
            self._on_exit(exit_)

    def _on_heartbeat_replaced(self, local_rank: int, what: str) -> None:
        """A worker put something else at its heartbeat path: say so once (no progress follows)."""
        rank = self._ranks[local_rank].rank if local_rank < len(self._ranks) else local_rank
        self._emit(
            EventKind.WORKER_HEARTBEAT_REPLACED,
            f"rank {rank} on {self.ctx.node}: its heartbeat file was replaced by {what}; "
            "the daemon reads only the file it created, and pings that miss it are no progress",
            attempt=self.attempt,
            rank=rank,
            local_rank=local_rank,
        )

    def _forward_output(self, local_rank: int, stream: str, line: bytes) -> None:
        assert self.ctx.console is not None
        rank = self._ranks[local_rank].rank if local_rank < len(self._ranks) else local_rank
        teed = std_for_rank(self.spec.tee, local_rank) in ("all", stream.removeprefix("std"))
        self.ctx.console(
            ConsoleLine(self.job_id, self.spec.role, rank, local_rank, stream, line, teed)
        )

    def _on_exit(self, exit_: WorkerExit) -> None:
        """Called the moment a worker process exits (held while its start is unconfirmed)."""
        if self._held_exits is not None:
            self._held_exits.append(exit_)  # reported once the round is the store's
            return
        ranks = self._ranks[exit_.local_rank]
        if self._progress is not None:
            self._progress.finished(exit_.local_rank)
        self._exited.add(exit_.local_rank)
        if len(self._exited) >= len(self._ranks):
            self._all_exited.set()
        if self.spec.inprocess_restart and exit_.failed and not exit_.stopped:
            # Tell the surviving ranks at once, so they restart in-process instead of
            # waiting for a collective to time out.
            self._background.spawn(self._report_terminated(exit_, ranks), name="report-terminated")
        if exit_.stopped:
            state = WorkerState.STOPPED  # we stopped it; not a failure of its own
        elif exit_.failed:
            state = WorkerState.FAILED
        else:
            state = WorkerState.SUCCEEDED
        if self._view is not None:
            for w in self._view.workers:
                if w.local_rank == exit_.local_rank:
                    w.exit_code = exit_.exit_code
                    w.signal = exit_.signal
                    w.exited_at = exit_.exited_at
                    w.state = state
        suffix = ", stopped by the agent" if exit_.stopped else ""
        round_no = self._round.round if self._round else 0
        self._emit(
            EventKind.WORKER_EXITED,
            f"rank {ranks.rank} on {self.ctx.node}: {exit_.describe()}{suffix}",
            state=state.value,
            attempt=self.attempt,
            rank=ranks.rank,
            local_rank=exit_.local_rank,
            pid=exit_.pid,
            exit_code=exit_.exit_code,
            signal=exit_.signal,
            error=(
                root_cause_of(
                    exit_,
                    ranks,
                    self.ctx.node,
                    self.attempt,
                    round_no,
                    self._log_dir(exit_.local_rank),
                )
                if exit_.error is not None
                else None
            ),
            source="worker",
        )
        self._request_publish()

    async def _monitor(self, group: WorkerGroupProcesses, round_: RoundInfo) -> Event:
        """The attempt's result, a hang, or the rendezvous change that interrupts it."""
        # In order of precedence when several are ready at once: the group's own
        # result, then a hang, then a rendezvous change.
        contenders: list[Awaitable[Event]] = [self._outcome(group)]
        if self._progress is not None and self._progress.settings.enabled:
            contenders.append(self._hang())
        contenders.append(self._round_changed(round_.round))
        _, event = await race(*contenders)
        return event

    async def _hang(self) -> HangSeen:
        assert self._progress is not None
        return HangSeen(await self._progress.wait_for_hang())

    async def _round_changed(self, my_round: int) -> RoundChanged:
        return RoundChanged(await self._watch_round(my_round))

    async def _outcome(self, group: WorkerGroupProcesses) -> WorkersEnded:
        """torchrun's rule: the first failure ends the attempt.

        With in-process restart a failed rank is the wrapper's business: the
        others carry on without it, so the group succeeded if any worker did,
        and failed only when every worker failed.
        """
        if not self.spec.inprocess_restart:
            return WorkersEnded(await group.wait())
        await self._all_exited.wait()
        result = group.snapshot()
        if any(not e.failed for e in result.exits.values()):
            return WorkersEnded(GroupResult(succeeded=True, exits=result.exits, failures=()))
        return WorkersEnded(result)

    async def _watch_round(self, my_round: int) -> Change:
        """The rendezvous change that ends this round.

        A store that stays unreachable for longer than the node's lease means
        the other nodes have declared this one dead and re-formed without it:
        the node fences itself (stops its workers) instead of letting them
        hang in a collective with peers that are gone.
        """
        if self.ctx.lease_lapsed is None:
            return await self._watch_round_only(my_round)
        # The node's lease is the truth the other nodes act on: once it may have
        # expired they re-form without this node, whatever the round watch says.
        # A watch can hang silently (a member cut off from quorum, a black hole),
        # so the lapse is awaited on its own timer, not inferred from watch errors.
        watch: Awaitable[Change | float] = self._watch_round_only(my_round)
        lapse: Awaitable[Change | float] = self.ctx.lease_lapsed()
        which, result = await race(watch, lapse)
        if which == 0:
            assert isinstance(result, Change)
            return result
        self._emit(
            EventKind.AGENT_FENCED,
            f"{self.ctx.node} lost the store for {result:.1f}s (no lease renewal got "
            "through for the lease TTL; the other nodes count it as gone); stopping its workers",
        )
        return Change.FENCED

    async def _watch_round_only(self, my_round: int) -> Change:
        """The round watch, fencing after ``fence_after`` seconds of failed watches."""
        loss = StoreLoss(self.ctx.fence_after)
        while True:
            try:
                return await self.ctx.rendezvous.wait_for_change(my_round, on_contact=loss.reached)
            except StoreError as exc:
                now = self.ctx.clock.monotonic()
                if loss.failed(now):
                    self._emit(
                        EventKind.AGENT_FENCED,
                        f"{self.ctx.node} lost the store for {loss.lost_for(now):.1f}s "
                        f"({exc}); stopping its workers",
                    )
                    return Change.FENCED
                log.warning("job %s: rendezvous watch failed: %s", self.job_id, exc)
                await asyncio.sleep(loss.backoff)  # back off while the store is unreachable

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
            self._report_lost_output(group)
            self._report_truncated_output(group)
            self._report_strays(group)

    def _report_strays(self, group: WorkerGroupProcesses) -> None:
        if not group.strays:
            return
        self._emit(
            EventKind.WORKERS_STRAYS,
            f"attempt {self.attempt} on {self.ctx.node}: killed {len(group.strays)} process(es) "
            f"that had left the workers' process groups: pids "
            f"{', '.join(str(p) for p in group.strays)}",
            attempt=self.attempt,
            count=len(group.strays),
            pids=list(group.strays),
        )

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
            started = self.ctx.clock.monotonic()
            await group.stop(self.spec.termination_grace)
            self._report_lost_output(group)
            self._report_truncated_output(group)
            self._report_strays(group)
            if self._view is not None:
                for w in self._view.workers:
                    if w.state is WorkerState.HEALTHY:
                        w.state = WorkerState.STOPPED
            self._emit(
                EventKind.WORKERS_STOPPED,
                f"attempt {self.attempt} on {self.ctx.node}: workers stopped",
                attempt=self.attempt,
                duration_s=self.ctx.clock.monotonic() - started,
            )
            self._recovery_stopped()
        if target is not None and self.state is not target and not self.state.is_terminal:
            with contextlib.suppress(InvalidTransition):
                self._set_state(target)

    def _report_lost_output(self, group: WorkerGroupProcesses) -> None:
        """One event for an attempt whose log files refused output (a full disk): bytes per rank.

        Emitted when the attempt ends; on a disk that still refuses, it waits
        in the event log's backlog and lands, in order, once the disk takes it.
        """
        self._report_dropped(
            EventKind.LOGS_LOST, group.lost_output(), "could not be written to the log files"
        )

    def _report_truncated_output(self, group: WorkerGroupProcesses) -> None:
        """One event for an attempt whose workers wrote past ``log_limit_bytes``: bytes per rank."""
        self._report_dropped(
            EventKind.LOGS_TRUNCATED,
            group.over_budget(),
            f"past log_limit_bytes = {self.spec.log_limit_bytes} per stream were dropped",
        )

    def _report_dropped(self, kind: EventKind, by_rank: dict[int, int], what: str) -> None:
        if not by_rank:
            return
        total = sum(by_rank.values())
        per_rank = ", ".join(f"local rank {rank}: {n} bytes" for rank, n in by_rank.items())
        self._emit(
            kind,
            f"attempt {self.attempt} on {self.ctx.node}: {total} bytes of worker output "
            f"{what} ({per_rank})",
            attempt=self.attempt,
            bytes_lost=total,
            lost_by_rank={str(rank): n for rank, n in by_rank.items()},
        )

    # hangs, health checks, progress

    async def _kill_hung_rank(self, hang: Hang) -> None:
        """SIGKILL one stuck worker's process group (in-process restart jobs only)."""
        if self._progress is not None:
            self._progress.finished(hang.local_rank)  # judged; its exit will follow
        pid = await self._report_hang(hang, suffix="; killing this rank only")
        if pid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signals.SIGKILL)  # each worker leads its own process group

    async def _report_hang(
        self, hang: Hang, *, state: str | None = None, suffix: str = ""
    ) -> int | None:
        """The ``worker.hang`` event, then the stuck worker's stacks; returns its pid."""
        ranks = self._ranks[hang.local_rank]
        pid = self._group.pids.get(hang.local_rank) if self._group is not None else None
        self._emit(
            EventKind.WORKER_HANG,
            f"rank {ranks.rank} on {self.ctx.node}: {hang.describe()}{suffix}",
            state=state,
            attempt=self.attempt,
            rank=ranks.rank,
            local_rank=hang.local_rank,
            pid=pid,
            duration_s=hang.silent_for,
        )
        if pid is None:
            return None
        stderr_log = self._log_dir(hang.local_rank) / stream_file("stderr")
        size = file_size(stderr_log)
        stacks = await dump_stacks(pid)
        if stacks.to_stderr:
            # faulthandler writes from the worker's signal handler into its stderr
            # pipe; give it a moment to land before the worker is stopped.
            await wait_for_growth(stderr_log, size, timeout=2.0)
        self._emit(
            EventKind.WORKER_STACKS,
            f"stacks of rank {ranks.rank} (pid {pid}):\n{stacks.text}",
            attempt=self.attempt,
            rank=ranks.rank,
            local_rank=hang.local_rank,
            pid=pid,
            source="worker",
        )
        return pid

    async def _record_failure(
        self, round_: RoundInfo, cause: GroupResult | Hang, at: float
    ) -> None:
        """Record the round's failure (charged when the next round forms); FailureRecorded next."""
        if isinstance(cause, Hang):
            ranks = self._ranks[cause.local_rank]
            root = RootCause(
                message=f"rank {ranks.rank} hung: {cause.describe()}",
                node=self.ctx.node,
                local_rank=cause.local_rank,
                rank=ranks.rank,
                timestamp=at,
                exited_at=at,
                attempt=self.attempt,
                round=round_.round,
                log_dir=str(self._log_dir(cause.local_rank)),
            )
            what = f"rank {ranks.rank} hung on {self.ctx.node}"
        else:
            root = self._root_cause(cause)
            what = f"rank {root.rank} failed on {self.ctx.node}: {root.message}"
        job = await self._record_restart(round_, root, what)
        pending = job.pending_failure
        self._next = FailureRecorded(
            job_ended=job.state.is_terminal,
            restart_count=job.restart_count,
            max_restarts=job.max_restarts,
            recorded_here=pending is not None and pending.round == round_.round,
            solo=self.ctx.rendezvous.solo_round(round_),
        )

    async def _record_restart(self, round_: RoundInfo, root: RootCause, what: str) -> Job:
        round_ = await self._named(round_)  # the failure names the round's participants
        job = await self.ctx.update_job(self.job_id, mutate=record_failure(round_, root))
        self._emit(
            EventKind.GROUP_RESTARTING,
            f"{what}; re-forming the group",
            state=WorkerState.STOPPED.value,
            attempt=self.attempt,
            rank=root.rank,
            local_rank=root.local_rank,
            exit_code=root.exit_code,
            signal=root.signal,
            error=root,
        )
        return job

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
            await self._on(UserRefused(side_of(exc), message, str(exc), cause_of(exc)))

    async def _health_checks(self) -> bool:
        """Run the health checks before a (re)start; True: healthy, go on.

        A failure spends one restart at once (HealthFailed): a single-node job
        then tries again (or fails once the budget is spent); in a multi-node
        job this node leaves the rendezvous so that a spare or the others carry on.
        """
        if self.ctx.health is None:
            return True
        results = await self.ctx.health.run(
            self.job_id,
            self.spec,
            identity=self._identity,
            cuda_visible_devices=self.ctx.cuda_visible_devices,
        )
        failed = [r for r in results if not r.ok and not r.skipped]
        for r in results:
            kind = (
                EventKind.HEALTH_SKIPPED
                if r.skipped
                else EventKind.HEALTH_PASSED
                if r.ok
                else EventKind.HEALTH_FAILED
            )
            self._emit(
                kind,
                f"{r.name} on {self.ctx.node}: {r.message}",
                duration_s=r.duration_s,
            )
        if not failed:
            return True
        reason = "; ".join(f"{r.name}: {r.message}" for r in failed)
        self._emit(
            EventKind.WORKER_HEALTH_CHECK_FAILED,
            f"node {self.ctx.node} is unhealthy for this job: {reason}",
            state="UNHEALTHY",
        )
        root = RootCause(
            message=f"health check failed on {self.ctx.node}: {reason}",
            node=self.ctx.node,
            timestamp=self.ctx.clock.time(),
        )
        job = await self.ctx.update_job(self.job_id, mutate=charge_now(root))
        await self._on(HealthFailed(job_ended=job.state.is_terminal))
        return False

    def _on_progress(self, beats: list[Beat]) -> None:
        """The heartbeat files were read: refresh last_progress_at; time the first ping."""
        if self._view is None or self._progress is None:
            return
        for w in self._view.workers:
            w.last_progress_at = self._progress.last_progress_at(w.local_rank)
        pinged = [w.last_progress_at for w in self._view.workers if w.last_progress_at]
        if self._awaiting_first_progress is not None and pinged:
            spawned, self._awaiting_first_progress = self._awaiting_first_progress, None
            first = min(pinged)
            self._emit(
                EventKind.RECOVERY_FIRST_PROGRESS,
                f"first progress ping on {self.ctx.node} after the recovery",
                attempt=self.attempt,
                duration_s=max(0.0, first - spawned),
            )
        self._request_publish()

    async def _report_terminated(self, exit_: WorkerExit, ranks: WorkerRanks) -> None:
        from elasticd.inprocess.keys import report_terminated  # worker-side key layout

        with contextlib.suppress(ElasticdError):
            await report_terminated(
                self.ctx.store,
                self.job_id,
                attempt_tag({"ELASTICD_ATTEMPT": self._attempt_tag}),
                ranks.rank,
                exit_.describe(),
                exit_code=exit_.exit_code,
                signal=exit_.signal,
            )

    # recovery timeline

    def _begin_recovery(self, cause: str, detected_at: float) -> None:
        if not self._recovery.begin(cause, detected_at):
            return  # already recovering (e.g. a failure while re-forming)
        self._emit(
            EventKind.RECOVERY_DETECTED,
            f"recovery started on {self.ctx.node}: {cause}",
            attempt=self.attempt,
            time=detected_at,
        )

    def _recovery_stopped(self) -> None:
        seconds = self._recovery.stopped(self.ctx.clock.time())
        if seconds is not None:
            self._emit(
                EventKind.RECOVERY_STOP_WORKERS,
                f"workers stopped on {self.ctx.node}",
                attempt=self.attempt,
                duration_s=seconds,
            )

    async def _finish_recovery(
        self, round_: RoundInfo, *, rendezvous_done: float, spawned: float | None = None
    ) -> None:
        """The recovery's end: the workers' spawn (``spawned``: an early one, before the
        round formed; its spawn phase is then 0, the rendezvous phase spans the overlap)."""
        early = spawned is not None
        spawned = spawned if spawned is not None else self.ctx.clock.time()
        mine = self._recovery.finish(round_.round, rendezvous_done=rendezvous_done, spawned=spawned)
        if mine is None:
            return
        self._awaiting_first_progress = spawned
        for phase, seconds in (("rendezvous", mine.rendezvous_s), ("spawn", mine.spawn_s)):
            self._emit(
                recovery_phase_kind(phase),
                f"recovery phase {phase} on {self.ctx.node}",
                attempt=self.attempt,
                duration_s=seconds,
            )
        self._emit(
            EventKind.RECOVERY_TOTAL,
            f"recovered on {self.ctx.node} in {mine.total_s:.3f}s ({mine.cause}): "
            f"stop {mine.stop_s:.3f}s, rendezvous {mine.rendezvous_s:.3f}s, "
            f"spawn {mine.spawn_s:.3f}s"
            + (" (the workers were started early, during the rendezvous)" if early else ""),
            attempt=self.attempt,
            duration_s=mine.total_s,
        )
        with contextlib.suppress(InvalidTransition):
            await self.ctx.update_job(self.job_id, mutate=merge_recovery(mine))

    def _log_dir(self, local_rank: int) -> Path:
        return self.ctx.logs.worker_dir(self.job_id, self.attempt, local_rank)

    def _root_cause(self, result: GroupResult) -> RootCause:
        failure = result.root_cause
        assert failure is not None, "a failed attempt has a failed worker"
        ranks = self._ranks[failure.local_rank]
        round_no = self._round.round if self._round else 0
        return root_cause_of(
            failure,
            ranks,
            self.ctx.node,
            self.attempt,
            round_no,
            self._log_dir(failure.local_rank),
        )

    # state and publication

    def _set_state(self, target: WorkerState) -> None:
        previous = self.state
        self.state = worker_transition(previous, target)
        if self._view is not None:
            self._view.state = self.state
            self._view.updated_at = self.ctx.clock.time()
        self._emit(
            EventKind.GROUP_STATE,
            f"worker group on {self.ctx.node}: {previous.value} -> {target.value}",
            state=target.value,
            attempt=self.attempt,
        )
        self._request_publish()

    def _request_publish(self) -> None:
        self._publisher.request()


def file_size(path: Path) -> int:
    """Size of a local log file (a stat; never blocks for long), 0 when absent.

    ``lstat``: the file lies in the worker's folder, and a link put there is not followed.
    """
    try:
        return os.lstat(path).st_size
    except OSError:
        return 0


async def wait_for_growth(path: Path, size: int, timeout: float) -> bool:
    """Until ``path`` is larger than ``size`` (bounded; the pipe reader announces nothing)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        if file_size(path) > size:
            await asyncio.sleep(0.05)  # let the rest of the dump arrive
            return True
        await asyncio.sleep(0.02)
    return False


def decode_group(raw: bytes) -> GroupView | None:
    """Parse a published group view (JSON only); None if it is not one."""
    try:
        return GroupView.model_validate(json.loads(raw))
    except (ValueError, TypeError):
        return None
