"""The per-job agent loop: rendezvous → ranks → spawn → monitor → restart | succeed | fail.

The agent owns the local worker group of one job on this node. It reports
every change as an event and publishes its group view to the store, so any
daemon can answer ``GET /jobs/{id}/workers``. Decisions about the outcome of
an attempt are made by :func:`elasticd.agent.policy.after_attempt`, a pure
function; this module only applies them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal as signals
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from elasticd.agent.policy import Outcome, after_attempt
from elasticd.agent.ranks import WorkerRanks, assign_ranks
from elasticd.clock import SYSTEM_CLOCK, Clock
from elasticd.errors import ElasticdError, InvalidTransition, WorkerSpawnError
from elasticd.events import EventLog
from elasticd.models import GroupView, Job, JobSpec, RootCause, WorkerView, console_streams
from elasticd.rendezvous import Rendezvous, RoundInfo
from elasticd.states import JobState, WorkerState, worker_transition
from elasticd.store import Store
from elasticd.workers.env import AttemptInfo, worker_env
from elasticd.workers.process import (
    GroupResult,
    WorkerExit,
    WorkerGroupProcesses,
    WorkerLaunch,
)

log = logging.getLogger("elasticd.agent")

#: (job_id, rank, stream, line) for output that reaches the console.
ConsoleSink = Callable[[str, int, str, bytes], None]
#: Called with the job id and the fields to change; returns the updated job.
JobUpdater = Callable[..., Job]


def restarts_key(job_id: str) -> str:
    return f"jobs/{job_id}/restarts"


def group_key(job_id: str, node: str) -> str:
    return f"jobs/{job_id}/groups/{node}"


@dataclass
class AgentContext:
    """What an agent needs from its daemon; injected so tests can build one cheaply."""

    node: str
    advertise_addr: str
    daemon_url: str
    log_root: Path
    store: Store
    events: EventLog
    update_job: JobUpdater
    rendezvous: Rendezvous
    base_env: Mapping[str, str]
    token_file: str | None = None
    cuda_visible_devices: str | None = None
    console: ConsoleSink | None = None
    clock: Clock = field(default=SYSTEM_CLOCK)


def root_cause_of(
    failure: WorkerExit, ranks: WorkerRanks, node: str, attempt: int, log_dir: Path
) -> RootCause:
    """What the job reports about one failed worker."""
    sig_name = None
    if failure.signal is not None:
        try:
            sig_name = signals.Signals(failure.signal).name
        except ValueError:
            sig_name = f"signal {failure.signal}"
    if failure.error is not None:
        message = failure.error.message
    elif sig_name is not None:
        message = f"worker was killed by {sig_name}"
    else:
        message = f"worker exited with code {failure.exit_code}"
    return RootCause(
        message=message,
        node=node,
        local_rank=failure.local_rank,
        rank=ranks.rank,
        exit_code=failure.exit_code,
        signal=failure.signal,
        signal_name=sig_name,
        traceback=failure.error.traceback if failure.error else None,
        timestamp=failure.error.timestamp if failure.error else failure.exited_at,
        attempt=attempt,
        log_dir=str(log_dir),
    )


class JobAgent:
    """Runs one job's workers on this node until the job ends."""

    def __init__(self, job: Job, ctx: AgentContext) -> None:
        self.job_id = job.id
        self.spec: JobSpec = job.spec
        self.ctx = ctx
        self.attempt = -1
        self.state = WorkerState.INIT
        self._cancel = asyncio.Event()
        self._cancel_reason = ""
        self._group: WorkerGroupProcesses | None = None
        self._view: GroupView | None = None
        self._ranks: list[WorkerRanks] = []
        self._publish_wanted = asyncio.Event()
        self._published = asyncio.Event()

    # control

    def cancel(self, reason: str = "cancelled by user") -> None:
        """Ask the agent to stop the workers and end the job as CANCELLED."""
        self._cancel_reason = reason
        self._cancel.set()

    @property
    def view(self) -> GroupView | None:
        return self._view

    # the loop

    async def run(self) -> None:
        """The agent's whole life; returns when the job is terminal on this node."""
        publisher = asyncio.create_task(self._publisher(), name=f"publish-{self.job_id}")
        try:
            await self._run()
        except asyncio.CancelledError:
            # The daemon is stopping: stop the workers (shielded), then let it go on.
            await self._stop_workers(WorkerState.STOPPED)
            raise
        except Exception as exc:
            log.exception("agent for job %s failed", self.job_id)
            if not self.state.is_terminal:
                self._set_state(WorkerState.UNKNOWN)  # an action was half-applied
            await self._stop_workers(WorkerState.FAILED)
            reason = f"internal error in the agent: {type(exc).__name__}: {exc}"
            self.ctx.events.emit(self.job_id, "agent", "agent.error", reason, state="FAILED")
            with contextlib.suppress(InvalidTransition):  # the job may already be terminal
                self.ctx.update_job(self.job_id, state=JobState.FAILED, reason=reason)
        finally:
            await self._flush_publisher(publisher)

    async def _run(self) -> None:
        while True:
            if self._cancel.is_set():
                self._finish_cancelled()
                return
            rdzv_started = self.ctx.clock.monotonic()
            round_ = await self.ctx.rendezvous.next_round()
            self.ctx.events.emit(
                self.job_id,
                "rendezvous",
                "rendezvous.complete",
                f"round {round_.round}: group rank {round_.group_rank} of "
                f"{round_.group_world_size}, master {round_.master_addr}:{round_.master_port}",
                duration_s=self.ctx.clock.monotonic() - rdzv_started,
            )
            restart_count = await self._restart_count()
            try:
                group = await self._start_workers(round_, restart_count)
            except WorkerSpawnError as exc:
                self._set_state(WorkerState.FAILED)  # INIT -> FAILED
                reason = f"workers could not be started: {exc}"
                self.ctx.events.emit(
                    self.job_id,
                    "agent",
                    "workers.spawn_failed",
                    reason,
                    state="FAILED",
                    attempt=self.attempt,
                )
                self.ctx.update_job(
                    self.job_id,
                    state=JobState.FAILED,
                    reason=reason,
                    error=RootCause(message=str(exc), node=self.ctx.node, attempt=self.attempt),
                )
                return
            result = await self._monitor(group)
            if result is None:
                await self._stop_workers(WorkerState.STOPPED)  # HEALTHY -> STOPPED
                self._finish_cancelled()
                return
            if not result.succeeded:
                await self._stop_workers(None)  # stop the survivors; state decided below
            outcome = after_attempt(
                succeeded=result.succeeded,
                restart_count=restart_count,
                max_restarts=self.spec.max_restarts,
            )
            if outcome is Outcome.SUCCEEDED:
                self._set_state(WorkerState.SUCCEEDED)  # HEALTHY -> SUCCEEDED
                await self.ctx.rendezvous.close()
                self.ctx.update_job(
                    self.job_id, state=JobState.SUCCEEDED, reason="every worker exited 0"
                )
                return
            root = self._root_cause(result)
            if outcome is Outcome.FAILED:
                self._set_state(WorkerState.FAILED)  # HEALTHY -> FAILED
                await self.ctx.rendezvous.close()
                reason = (
                    f"restart budget spent ({self.spec.max_restarts} restarts); "
                    f"root cause: rank {root.rank} (local {root.local_rank}): {root.message}"
                )
                self.ctx.update_job(self.job_id, state=JobState.FAILED, error=root, reason=reason)
                return
            # Outcome.RESTART: spend one unit of the job-wide budget and go again.
            count = await self.ctx.store.add(restarts_key(self.job_id), 1)
            self._set_state(WorkerState.STOPPED)  # HEALTHY -> STOPPED
            self.ctx.update_job(
                self.job_id,
                state=JobState.RESTARTING,
                restart_count=count,
                error=root,
                reason=f"restarting after rank {root.rank} failed: {root.message}",
            )
            self.ctx.events.emit(
                self.job_id,
                "agent",
                "group.restarting",
                f"restart {count} of {self.spec.max_restarts}: rank {root.rank} failed",
                state=WorkerState.STOPPED.value,
                attempt=self.attempt,
                rank=root.rank,
                local_rank=root.local_rank,
                exit_code=root.exit_code,
                signal=root.signal,
                error=root,
            )
            self._set_state(WorkerState.INIT)  # STOPPED -> INIT

    async def _restart_count(self) -> int:
        entry = await self.ctx.store.get(restarts_key(self.job_id))
        if entry is None:
            return 0
        try:
            return int(entry.value)
        except ValueError:
            return 0

    # workers

    async def _start_workers(self, round_: RoundInfo, restart_count: int) -> WorkerGroupProcesses:
        self.attempt += 1
        ranks = assign_ranks(round_.nodes, round_.group_rank)
        for node in round_.nodes:
            if node.group_rank == round_.group_rank and node.local_world_size != len(ranks):
                raise ElasticdError("rank assignment disagrees with the round")  # pragma: no cover
        self._ranks = ranks
        attempt_dir = self.ctx.log_root / self.job_id / f"attempt_{self.attempt}"
        info = AttemptInfo(
            job_id=self.job_id,
            run_id=self.job_id,
            master_addr=round_.master_addr,
            master_port=round_.master_port,
            restart_count=restart_count,
            max_restarts=self.spec.max_restarts,
            daemon_url=self.ctx.daemon_url,
            token_file=self.ctx.token_file,
            cuda_visible_devices=self.ctx.cuda_visible_devices,
        )
        launches = []
        for r in ranks:
            log_dir = attempt_dir / str(r.local_rank)
            out, err = console_streams(self.spec, r.local_rank)
            env = worker_env(
                self.ctx.base_env,
                self.spec.env,
                r,
                info,
                error_file=str(log_dir / "error.json"),
            )
            launches.append(
                WorkerLaunch(
                    local_rank=r.local_rank,
                    argv=[self.spec.entrypoint, *self.spec.args],
                    env=env,
                    cwd=self.spec.cwd,
                    log_dir=log_dir,
                    console_stdout=out,
                    console_stderr=err,
                )
            )
        now = self.ctx.clock.time()
        self._view = GroupView(
            node=self.ctx.node,
            state=self.state,
            role=self.spec.role,
            group_rank=round_.group_rank,
            group_world_size=round_.group_world_size,
            attempt=self.attempt,
            round=round_.round,
            restart_count=restart_count,
            master_addr=round_.master_addr,
            master_port=round_.master_port,
            log_dir=str(attempt_dir),
            updated_at=now,
            workers=[
                WorkerView(
                    local_rank=r.local_rank,
                    rank=r.rank,
                    role_rank=r.role_rank,
                    world_size=r.world_size,
                    role_world_size=r.role_world_size,
                    local_world_size=r.local_world_size,
                    state=WorkerState.INIT,
                )
                for r in ranks
            ],
        )
        on_output = self._forward_output if self.ctx.console is not None else None
        group = await WorkerGroupProcesses.start(
            launches, on_output=on_output, on_exit=self._on_exit, clock=self.ctx.clock
        )
        self._group = group
        for w in self._view.workers:
            w.pid = group.pids.get(w.local_rank)
            w.started_at = group.started_at.get(w.local_rank)
            w.state = WorkerState.HEALTHY
        self._set_state(WorkerState.HEALTHY)  # INIT -> HEALTHY
        self.ctx.update_job(
            self.job_id, state=JobState.RUNNING, round=round_.round, restart_count=restart_count
        )
        self.ctx.events.emit(
            self.job_id,
            "agent",
            "workers.started",
            f"attempt {self.attempt}: {len(ranks)} workers started "
            f"(ranks {ranks[0].rank}-{ranks[-1].rank} of {ranks[0].world_size}), "
            f"pids {', '.join(str(p) for p in group.pids.values())}",
            state=WorkerState.HEALTHY.value,
            attempt=self.attempt,
        )
        return group

    def _forward_output(self, local_rank: int, stream: str, line: bytes) -> None:
        assert self.ctx.console is not None
        rank = self._ranks[local_rank].rank if local_rank < len(self._ranks) else local_rank
        self.ctx.console(self.job_id, rank, stream, line)

    def _on_exit(self, exit_: WorkerExit) -> None:
        """Called the moment a worker process exits."""
        ranks = self._ranks[exit_.local_rank]
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
        self.ctx.events.emit(
            self.job_id,
            "worker",
            "worker.exited",
            f"rank {ranks.rank}: {exit_.describe()}{suffix}",
            state=state.value,
            attempt=self.attempt,
            rank=ranks.rank,
            local_rank=exit_.local_rank,
            pid=exit_.pid,
            exit_code=exit_.exit_code,
            signal=exit_.signal,
            error=(
                root_cause_of(
                    exit_, ranks, self.ctx.node, self.attempt, self._log_dir(exit_.local_rank)
                )
                if exit_.error is not None
                else None
            ),
        )
        self._request_publish()

    async def _monitor(self, group: WorkerGroupProcesses) -> GroupResult | None:
        """The attempt's result, or None if the job was cancelled first."""
        waiter = asyncio.create_task(group.wait())
        cancelled = asyncio.create_task(self._cancel.wait())
        try:
            done, _ = await asyncio.wait({waiter, cancelled}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            cancelled.cancel()
        if waiter in done:
            return waiter.result()
        waiter.cancel()
        return None

    async def _stop_workers(self, target: WorkerState | None) -> None:
        group, self._group = self._group, None
        if group is not None:
            started = self.ctx.clock.monotonic()
            await group.stop(self.spec.termination_grace)
            if self._view is not None:
                for w in self._view.workers:
                    if w.state is WorkerState.HEALTHY:
                        w.state = WorkerState.STOPPED
            self.ctx.events.emit(
                self.job_id,
                "agent",
                "workers.stopped",
                f"attempt {self.attempt}: workers stopped",
                attempt=self.attempt,
                duration_s=self.ctx.clock.monotonic() - started,
            )
        if target is not None and self.state is not target and not self.state.is_terminal:
            self._set_state(target)

    def _log_dir(self, local_rank: int) -> Path:
        return self.ctx.log_root / self.job_id / f"attempt_{self.attempt}" / str(local_rank)

    def _root_cause(self, result: GroupResult) -> RootCause:
        failure = result.root_cause
        assert failure is not None, "a failed attempt has a failed worker"
        ranks = self._ranks[failure.local_rank]
        return root_cause_of(
            failure, ranks, self.ctx.node, self.attempt, self._log_dir(failure.local_rank)
        )

    def _finish_cancelled(self) -> None:
        if not self.state.is_terminal and self.state is not WorkerState.STOPPED:
            self._set_state(WorkerState.STOPPED)
        self.ctx.update_job(self.job_id, state=JobState.CANCELLED, reason=self._cancel_reason)

    # state and publication

    def _set_state(self, target: WorkerState) -> None:
        previous = self.state
        self.state = worker_transition(previous, target)
        if self._view is not None:
            self._view.state = self.state
            self._view.updated_at = self.ctx.clock.time()
        self.ctx.events.emit(
            self.job_id,
            "agent",
            "group.state",
            f"worker group {previous.value} -> {target.value}",
            state=target.value,
            attempt=self.attempt,
        )
        self._request_publish()

    def _request_publish(self) -> None:
        self._published.clear()
        self._publish_wanted.set()

    async def _publisher(self) -> None:
        """Writes the latest group view to the store whenever it changed (coalescing bursts)."""
        key = group_key(self.job_id, self.ctx.node)
        while True:
            await self._publish_wanted.wait()
            self._publish_wanted.clear()
            if self._view is None:
                self._published.set()
                continue
            try:
                await self.ctx.store.put(key, self._view.model_dump_json().encode())
            except ElasticdError as exc:
                log.warning("job %s: cannot publish group view: %s", self.job_id, exc)
            if not self._publish_wanted.is_set():
                self._published.set()

    async def _flush_publisher(self, publisher: asyncio.Task[None]) -> None:
        if self._publish_wanted.is_set() or not self._published.is_set():
            try:
                async with asyncio.timeout(5):
                    await self._published.wait()
            except TimeoutError:
                log.warning("job %s: last group view not published", self.job_id)
        publisher.cancel()
        try:
            await publisher
        except asyncio.CancelledError:
            pass


def decode_group(raw: bytes) -> GroupView | None:
    """Parse a published group view (JSON only); None if it is not one."""
    try:
        return GroupView.model_validate(json.loads(raw))
    except (ValueError, TypeError):
        return None
