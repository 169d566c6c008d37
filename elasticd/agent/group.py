"""The local worker group of one attempt, as the agent sees it: spawned, running, exited.

:class:`LocalGroup` holds the attempt's processes
(:class:`~elasticd.supervise.process.WorkerGroupProcesses`), its
:class:`~elasticd.agent.hooks.Attempt` (ranks, the group view), and the
workers' exits: each is reported (``worker.exited``, the view) the moment
it happens, except those of workers started early (before the store formed
their round), which are held until the start is confirmed or dropped. The
agent decides when to start, confirm and stop it; the group carries it out
and says so (``workers.started``, ``workers.stopped``), with its hooks
(output, heartbeats).

Which side of the boundary: the daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from elasticd.agent.attempt import AttemptPlan
from elasticd.agent.context import AgentContext, Emit
from elasticd.agent.edits import root_cause_of, root_cause_of_hang
from elasticd.agent.handover import AgentHandover
from elasticd.agent.hooks import Attempt, OutputHook, ProgressHook
from elasticd.agent.progress import Hang
from elasticd.errors import ElasticdError
from elasticd.eventkinds import EventKind
from elasticd.models import JobSpec, RankStack, RootCause, StandbyView
from elasticd.security import Identity
from elasticd.states import WorkerState
from elasticd.supervise.process import GroupHooks, GroupResult, WorkerExit, WorkerGroupProcesses
from elasticd.supervise.standby import StandbyPool, fill_wait
from elasticd.tasks import TaskSet
from elasticd.worker.names import attempt_tag

__all__ = ["LocalGroup"]

#: How often a start waiting for its standbys (fill_wait) looks at the heartbeats.
FILL_POLL_S = 0.25


@dataclass
class LocalGroup:
    """One attempt's workers on this node (see the module)."""

    ctx: AgentContext
    job_id: str
    spec: JobSpec
    emit: Emit
    output: OutputHook
    progress: ProgressHook
    background: TaskSet
    """Owns the reports of a dead rank to its survivors (in-process restart)."""
    changed: Callable[[], None]
    """Told when the view changed (publish it)."""
    attempt: Attempt | None = None
    processes: WorkerGroupProcesses | None = None
    exited: set[int] = field(default_factory=set)
    all_exited: asyncio.Event = field(default_factory=asyncio.Event)
    held: list[WorkerExit] | None = None
    """Exits of early workers, reported (in order) once their start is confirmed."""
    standbys: StandbyPool | None = None
    """A ``prewarm`` job's standby interpreters for the next attempt
    (:mod:`~elasticd.supervise.standby`)."""

    def __post_init__(self) -> None:
        if self.spec.prewarm:
            self.standbys = StandbyPool(
                self.job_id,
                self.spec.prewarm,
                self.ctx.policy,
                on_lost=self._standby_lost,
                on_ready=self.show_standbys,
            )

    def log_dir(self, local_rank: int) -> Path:
        seq = self.attempt.spawn_seq if self.attempt is not None else 0
        return self.ctx.logs.worker_dir(self.job_id, seq, local_rank)

    def live_workers(self) -> dict[int, tuple[int, Path]]:
        """The attempt's workers not seen to exit: local rank -> (pid, its folder).

        A pid whose exit was reaped may be another process's by now: it is left out
        (a worker not reaped yet is at worst a zombie, whose pid nobody else has)."""
        processes = self.processes
        if processes is None:
            return {}
        exited = processes.snapshot().exits
        return {
            rank: (pid, self.log_dir(rank))
            for rank, pid in sorted(processes.pids.items())
            if rank not in exited
        }

    async def start(
        self, attempt: Attempt, plan: AttemptPlan, identity: Identity | None, *, early: bool
    ) -> None:
        """Spawn the attempt's workers (INIT until :meth:`running`).

        ``early``: the store has not formed the round yet; exits are held until
        :meth:`running` (or the stop) reports them, after ``workers.started``.
        """
        self._begin(attempt, held=[] if early else None)
        self.progress.prerun(attempt, plan.heartbeats, identity)
        pool = self.standbys
        had_standbys = pool is not None and pool.filled
        if pool is not None:
            pool.cold.clear()
        self.processes = await WorkerGroupProcesses.start(
            plan.launches, **self._hooks(attempt), standbys=pool
        )
        self.output.poststart(attempt, self.processes)
        if pool is not None:
            self._say_how_started(attempt, pool, had_standbys)
            # With the workers where the node has a CPU to spare for each, else after their
            # imports: the attempt is never delayed by its own standbys (fill_wait).
            # Workers that all took over standbys are past them.
            warm = had_standbys and not pool.cold
            self.background.spawn(
                self._fill_when_due(attempt, pool, plan, identity, warm=warm),
                f"standbys-{self.job_id}",
            )

    def _begin(self, attempt: Attempt, held: list[WorkerExit] | None) -> None:
        self.release_exits()
        self.held = held
        self.attempt = attempt
        self.exited = set()
        self.all_exited = asyncio.Event()

    def _hooks(self, attempt: Attempt) -> GroupHooks:
        """What the attempt's processes tell: output, exits, log growth; and their clock."""
        return {
            "on_output": self.output.forwarder(attempt),
            "on_exit": self.on_exit,
            "clock": self.ctx.clock,
            "storage": self.ctx.storage,
            "policy": self.ctx.policy,
            "on_written": self.ctx.log_growth,
        }

    async def adopt(
        self,
        attempt: Attempt,
        plan: AttemptPlan,
        handover: AgentHandover,
        identity: Identity | None,
    ) -> None:
        """Take up the running workers of the daemon's previous program image (re-exec);
        exits it saw and did not act on are held until :meth:`release_adopted_exits`."""
        self._begin(attempt, held=[])
        self.progress.adopt(attempt, plan.heartbeats, identity, handover.workers)
        self.processes = await WorkerGroupProcesses.adopt(
            plan.launches, handover.workers, handover.cgroup, **self._hooks(attempt)
        )
        self.output.poststart(attempt, self.processes)
        for w in attempt.view.workers:
            w.pid = self.processes.pids.get(w.local_rank)
            w.started_at = self.processes.started_at.get(w.local_rank)
            w.state = WorkerState.HEALTHY
        if (pool := self.standbys) is not None:  # the old image's standbys were killed
            self.background.spawn(self._fill(pool, plan, identity), f"standbys-{self.job_id}")

    def release_adopted_exits(self) -> None:
        """After ``job.readopted``: the exits that came through the re-exec, in order."""
        self.release_exits()

    def _say_how_started(self, attempt: Attempt, pool: StandbyPool, had_standbys: bool) -> None:
        """``workers.warm_start`` for the ranks handed to standbys, ``worker.cold_start``
        (and why) for the others; nothing on a first start (no standby could exist yet)."""
        processes = self.processes
        assert processes is not None
        first = attempt.round.round == 0 and attempt.spawn_seq == 0
        warm = [r for r in sorted(processes.pids) if r not in pool.cold and had_standbys]
        if warm:
            pids = [processes.pids[r] for r in warm]
            self.emit(
                EventKind.WORKERS_WARM_START,
                f"attempt {attempt.spawn_seq} on {self.ctx.node}: local ranks "
                f"{', '.join(map(str, warm))} took over their standbys (pids "
                f"{', '.join(map(str, pids))})",
                attempt=attempt.spawn_seq,
                count=len(warm),
                pids=pids,
            )
        for rank in sorted(processes.pids):
            if rank in warm or (first and not had_standbys):
                continue
            reason = pool.cold.get(rank)
            if reason is None or (not had_standbys and reason == "no standby for it"):
                reason = (
                    "this node has no standbys yet (it joined the job late, or its agent is new)"
                )
            self.emit(
                EventKind.WORKER_COLD_START,
                f"rank {attempt.rank_of(rank)} on {self.ctx.node} started cold: {reason}",
                attempt=attempt.spawn_seq,
                rank=attempt.rank_of(rank),
                local_rank=rank,
                pid=processes.pids[rank],
            )

    async def _fill(self, pool: StandbyPool, plan: AttemptPlan, identity: Identity | None) -> None:
        await pool.fill(plan.launches, identity)
        self.show_standbys()

    async def _fill_when_due(
        self,
        attempt: Attempt,
        pool: StandbyPool,
        plan: AttemptPlan,
        identity: Identity | None,
        *,
        warm: bool,
    ) -> None:
        """The attempt's standbys once :func:`fill_wait` says so (none if it ended first)."""
        clock = self.ctx.clock
        started = clock.monotonic()
        ranks = [launch.local_rank for launch in plan.launches]
        spare = self._spare_cpus(len(ranks))
        while self.attempt is attempt and self.processes is not None:
            wait = fill_wait(
                spare_cpus=spare,
                wanted=len(ranks),
                warm=warm,
                pinged=self._all_pinged(ranks),
                age=clock.monotonic() - started,
                observed=pool.import_times,
            )
            if wait <= 0:
                await self._fill(pool, plan, identity)
                return
            await asyncio.sleep(min(wait, FILL_POLL_S))

    def _spare_cpus(self, workers: int) -> int:
        """The CPUs this daemon may run on less the slots the node's workers hold (``workers``:
        this attempt's, when nothing counts the node's)."""
        busy = self.ctx.busy_slots() if self.ctx.busy_slots is not None else workers
        return len(os.sched_getaffinity(0)) - busy

    def _all_pinged(self, ranks: list[int]) -> bool:
        """Every worker of the attempt has pinged its heartbeat (it is past its imports)."""
        monitor = self.progress.monitor
        if monitor is None:
            return False
        return all(monitor.observation(r).last_progress_at is not None for r in ranks)

    def show_standbys(self) -> None:
        """The standbys (and their memory) in the group view, published."""
        pool, attempt = self.standbys, self.attempt
        if pool is None or attempt is None:
            return
        before = [(s.local_rank, s.pid, s.state) for s in attempt.view.standbys]
        attempt.view.standbys = [
            StandbyView(local_rank=i.local_rank, pid=i.pid, state=i.state, rss_bytes=i.rss_bytes)
            for i in pool.infos()
        ]
        # Published only when a standby came, went or got ready: the memory changes at every
        # read (GET .../workers calls this), and a publish is a store write. This node's own
        # view, which its API serves, has the fresh figures regardless.
        if [(s.local_rank, s.pid, s.state) for s in attempt.view.standbys] != before:
            self.changed()

    def _standby_lost(self, local_rank: int, reason: str) -> None:
        attempt = self.attempt
        self.emit(
            EventKind.STANDBY_LOST,
            f"the standby of local rank {local_rank} on {self.ctx.node} was lost: {reason}",
            attempt=attempt.spawn_seq if attempt is not None else None,
            local_rank=local_rank,
        )
        self.show_standbys()

    async def close_standbys(self) -> None:
        """Kill the standbys (the job is over here, or the agent stops)."""
        if self.standbys is not None:
            await self.standbys.aclose()

    def running(self) -> None:
        """The workers run as the round's: the heartbeats' clocks start, the view HEALTHY."""
        processes, attempt = self.processes, self.attempt
        assert processes is not None
        assert attempt is not None
        self.progress.poststart()
        for w in attempt.view.workers:
            w.pid = processes.pids.get(w.local_rank)
            w.started_at = processes.started_at.get(w.local_rank)
            w.state = WorkerState.HEALTHY

    def say_started(self, *, early: bool) -> None:
        """``workers.started``, then the exits held while the start was unconfirmed."""
        processes, attempt = self.processes, self.attempt
        assert processes is not None
        assert attempt is not None
        ranks = attempt.ranks
        self.emit(
            EventKind.WORKERS_STARTED,
            f"attempt {attempt.spawn_seq} on {self.ctx.node}: {len(ranks)} workers started "
            f"(ranks {ranks[0].rank}-{ranks[-1].rank} of {ranks[0].world_size}), "
            f"pids {', '.join(str(p) for p in processes.pids.values())}",
            state=WorkerState.HEALTHY.value,
            attempt=attempt.spawn_seq,
            early=early or None,
        )
        self.release_exits()

    def release_exits(self) -> None:
        """Report the exits held while the workers' start was unconfirmed, in order."""
        held, self.held = self.held, None
        for exit_ in held or ():
            self.on_exit(exit_)

    def on_exit(self, exit_: WorkerExit) -> None:
        """Called the moment a worker process exits (held while its start is unconfirmed)."""
        if self.held is not None:
            self.held.append(exit_)  # reported once the round is the store's
            return
        attempt = self.attempt
        assert attempt is not None
        ranks = attempt.ranks[exit_.local_rank]
        self.progress.exited(exit_.local_rank)
        self.exited.add(exit_.local_rank)
        if len(self.exited) >= len(attempt.ranks):
            self.all_exited.set()
        if (
            self.spec.inprocess_restart
            and exit_.failed
            and not exit_.stopped
            and not exit_.reported
        ):
            # Tell the surviving ranks at once, so they restart in-process instead of
            # waiting for a collective to time out.
            self.background.spawn(self._report_terminated(exit_, attempt), "report-terminated")
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
        if exit_.reported:  # the daemon's previous program image said it (re-exec)
            self.changed()
            return
        suffix = ", stopped by the agent" if exit_.stopped else ""
        error = None
        if exit_.error is not None:
            log_dir = self.log_dir(exit_.local_rank)
            node, seq, round_no = self.ctx.node, attempt.spawn_seq, attempt.round.round
            error = root_cause_of(exit_, ranks, node, seq, round_no, log_dir)
        self.emit(
            EventKind.WORKER_EXITED,
            f"rank {ranks.rank} on {self.ctx.node}: {exit_.describe()}{suffix}",
            state=state.value,
            attempt=attempt.spawn_seq,
            rank=ranks.rank,
            local_rank=exit_.local_rank,
            pid=exit_.pid,
            exit_code=exit_.exit_code,
            signal=exit_.signal,
            error=error,
            source="worker",
        )
        self.changed()

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

    def root_cause(
        self,
        cause: GroupResult | Hang,
        round_no: int,
        at: float,
        stacks: list[RankStack] | None = None,
    ) -> tuple[RootCause, str]:
        """What the job reports about the attempt's failure (or hang, with where its ranks
        were: ``stacks``), and a line for people."""
        attempt, node = self.attempt, self.ctx.node
        assert attempt is not None
        if isinstance(cause, Hang):
            rank, log_dir = attempt.rank_of(cause.local_rank), self.log_dir(cause.local_rank)
            root = root_cause_of_hang(
                cause, rank, node, attempt.spawn_seq, round_no, log_dir, at, stacks
            )
            return root, f"rank {rank} hung on {node}"
        failure = cause.root_cause
        assert failure is not None, "a failed attempt has a failed worker"
        ranks, log_dir = attempt.ranks[failure.local_rank], self.log_dir(failure.local_rank)
        root = root_cause_of(failure, ranks, node, attempt.spawn_seq, round_no, log_dir)
        return root, f"rank {root.rank} failed on {node}: {root.message}"

    async def outcome(self) -> GroupResult:
        """torchrun's rule: the first failure ends the attempt.

        With in-process restart a failed rank is the wrapper's business: the
        others carry on without it, so the group succeeded if any worker did,
        and failed only when every worker failed.
        """
        processes = self.processes
        assert processes is not None
        if not self.spec.inprocess_restart:
            return await processes.wait()
        await self.all_exited.wait()
        result = processes.snapshot()
        if any(not e.failed for e in result.exits.values()):
            return GroupResult(succeeded=True, exits=result.exits, failures=())
        return result

    async def release(self) -> None:
        """The workers all exited 0: end what is left of the attempt (its strays), quietly."""
        processes, self.processes = self.processes, None
        if processes is not None:
            await processes.stop(self.spec.termination_grace)
            assert self.attempt is not None
            self.output.stopped(self.attempt, processes)

    async def stop(self) -> bool:
        """Stop the workers (``workers.stopped``); False when none ran."""
        processes, self.processes = self.processes, None
        self.release_exits()  # early workers that were never confirmed: their exits first
        if processes is None:
            return False
        attempt = self.attempt
        assert attempt is not None
        started = self.ctx.clock.monotonic()
        await processes.stop(self.spec.termination_grace)
        self.output.stopped(attempt, processes)
        for w in attempt.view.workers:
            if w.state is WorkerState.HEALTHY:
                w.state = WorkerState.STOPPED
        self.emit(
            EventKind.WORKERS_STOPPED,
            f"attempt {attempt.spawn_seq} on {self.ctx.node}: workers stopped",
            attempt=attempt.spawn_seq,
            duration_s=self.ctx.clock.monotonic() - started,
        )
        return True
