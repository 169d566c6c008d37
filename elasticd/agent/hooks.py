"""The concerns of each attempt, as small hooks the runner calls at fixed points.

The runner (:class:`elasticd.agent.agent.JobAgent`) carries out the state
machine's effects; what goes with an attempt beyond the spawn and the stop
lives here, one object per concern, each with the methods of the points it
cares about (``prerun`` before the spawn, ``poststart`` once the workers run
as the round's, ``exited`` per worker, ``stopped`` once the group is gone):

* :class:`OutputHook`: the console lines of the workers, and what the
  attempt's output left behind (bytes lost to a refusing disk or past
  ``log_limit_bytes``, stray processes), and containment (``containment.partial``);
* :class:`ProgressHook`: the heartbeat files (:class:`ProgressMonitor`), hangs;
* :class:`RecoveryHook`: the recovery timeline's events and its summary in the job;
* :class:`HealthHook`: the health checks before a (re)start (the node runs
  them: :class:`~elasticd.agent.ports.HealthChecks`);
* :class:`HangHook`: a hang's event and the stacks of every rank of the node, read
  back into where each one's main thread was (:mod:`elasticd.agent.hangs`).

Publishing the group view is :class:`elasticd.agent.publish.GroupPublisher`;
events go through :class:`elasticd.agent.context.Emit`.

Which side of the boundary: the daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal as signals
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elasticd.agent.checkpoints import merge_attempt, observe
from elasticd.agent.context import ConsoleSink, Emit, JobUpdater
from elasticd.agent.edits import merge_first_progress, merge_recovery
from elasticd.agent.hangs import stack_of
from elasticd.agent.ports import HealthChecks
from elasticd.agent.progress import Beat, Hang, ProgressMonitor, ProgressSettings, dump_stacks
from elasticd.agent.recovery import FirstProgress, RecoveryTimeline
from elasticd.clock import Clock
from elasticd.console import ConsoleLine
from elasticd.errors import ElasticdError, InvalidTransition
from elasticd.eventkinds import EventKind, recovery_phase_kind
from elasticd.goodput import Observation
from elasticd.logs import stream_file
from elasticd.models import (
    MAX_RANK_STACKS,
    AttemptProgress,
    GroupView,
    JobSpec,
    RankStack,
    RootCause,
    std_for_rank,
)
from elasticd.rendezvous import RoundInfo
from elasticd.rendezvous.ranks import WorkerRanks
from elasticd.security import Identity
from elasticd.states import WorkerState
from elasticd.supervise.adopt import HandedWorker
from elasticd.supervise.files import read_worker_file
from elasticd.supervise.process import WorkerGroupProcesses
from elasticd.supervise.spawn import SpawnPolicy
from elasticd.worker.flight import FILE as FLIGHT_FILE

__all__ = [
    "Attempt",
    "HangHook",
    "HealthHook",
    "OutputHook",
    "ProgressHook",
    "RecoveryHook",
    "file_size",
    "read_dump",
    "wait_for_growth",
]

log = logging.getLogger("elasticd.agent")


@dataclass
class Attempt:
    """What the hooks of one attempt share: its spawn_seq, round, ranks and group view."""

    spawn_seq: int
    """This node's spawn sequence number of the job (``attempt`` in events and log paths)."""
    round: RoundInfo
    ranks: list[WorkerRanks]
    view: GroupView
    tag: str
    """``ELASTICD_ATTEMPT``: ``<round>.<restart count>``."""
    started_from: int | None = None
    """The job's checkpoint step the workers were given (``ELASTICD_CHECKPOINT_STEP``)."""

    def rank_of(self, local_rank: int) -> int:
        ranks = self.ranks
        return ranks[local_rank].rank if local_rank < len(ranks) else local_rank


@dataclass
class OutputHook:
    """The workers' output: to the console, and what was dropped or left behind."""

    emit: Emit
    node: str
    job_id: str
    spec: JobSpec
    console: ConsoleSink | None
    said_partial: bool = False
    """``containment.partial`` was emitted by this job (the daemon says it once in all)."""
    ended: Callable[[str], None] | None = None
    """Told the job's id once an attempt's output is closed (:attr:`AgentContext.attempt_ended`)."""

    def forwarder(self, attempt: Attempt) -> Callable[[int, str, bytes], None] | None:
        """The group's ``on_output``: its lines to the console (None: no console)."""
        console = self.console
        if console is None:
            return None
        spec, job_id = self.spec, self.job_id

        def forward(local_rank: int, stream: str, line: bytes) -> None:
            teed = std_for_rank(spec.tee, local_rank) in ("all", stream.removeprefix("std"))
            rank = attempt.rank_of(local_rank)
            console(ConsoleLine(job_id, spec.role, rank, local_rank, stream, line, teed))

        return forward

    def poststart(self, attempt: Attempt, group: WorkerGroupProcesses) -> None:
        """Say that the job's processes cannot be put in a cgroup here (once per daemon: the
        group of its first attempt carries the notice)."""
        if group.containment_partial is None or self.said_partial:
            return
        self.said_partial = True
        self.emit(
            EventKind.CONTAINMENT_PARTIAL,
            f"{self.node} cannot put the job's processes in a cgroup "
            f"({group.containment_partial}); a process that leaves a worker's process "
            "group is found only if it is re-parented to the daemon (child subreaper); "
            "said once per daemon, for every job it runs",
            attempt=attempt.spawn_seq,
        )

    def stopped(self, attempt: Attempt, group: WorkerGroupProcesses) -> None:
        """The attempt's group is gone: what its output lost, and the strays killed."""
        # Emitted when the attempt ends; on a disk that still refuses, it waits in the
        # event log's backlog and lands, in order, once the disk takes it.
        self._dropped(
            attempt,
            EventKind.LOGS_LOST,
            group.lost_output(),
            "could not be written to the log files",
        )
        self._dropped(
            attempt,
            EventKind.LOGS_TRUNCATED,
            group.over_budget(),
            f"past log_limit_bytes = {self.spec.log_limit_bytes} per stream were dropped",
        )
        if group.strays:
            self.emit(
                EventKind.WORKERS_STRAYS,
                f"attempt {attempt.spawn_seq} on {self.node}: killed {len(group.strays)} "
                f"process(es) that had left the workers' process groups: pids "
                f"{', '.join(str(p) for p in group.strays)}",
                attempt=attempt.spawn_seq,
                count=len(group.strays),
                pids=list(group.strays),
            )
        if self.ended is not None:
            self.ended(self.job_id)

    def _dropped(
        self, attempt: Attempt, kind: EventKind, by_rank: dict[int, int], what: str
    ) -> None:
        if not by_rank:
            return
        total = sum(by_rank.values())
        per_rank = ", ".join(f"local rank {rank}: {n} bytes" for rank, n in by_rank.items())
        self.emit(
            kind,
            f"attempt {attempt.spawn_seq} on {self.node}: {total} bytes of worker output "
            f"{what} ({per_rank})",
            attempt=attempt.spawn_seq,
            bytes_lost=total,
            lost_by_rank={str(rank): n for rank, n in by_rank.items()},
        )


@dataclass
class RecoveryHook:
    """The recovery timeline of this node: its ``recovery.*`` events and the job's summary."""

    emit: Emit
    node: str
    job_id: str
    clock: Clock
    update_job: JobUpdater
    spawn: Callable[[Coroutine[Any, Any, None], str], object]
    """Runs work nobody awaits (the agent's background: the job's first-progress figure)."""
    timeline: RecoveryTimeline = field(default_factory=RecoveryTimeline)
    awaiting: FirstProgress | None = None
    """A recovery's workers run and have not pinged yet (handed over across a re-exec)."""

    def begin(self, cause: str, detected_at: float, attempt: int) -> None:
        if not self.timeline.begin(cause, detected_at):
            return  # already recovering (e.g. a failure while re-forming)
        self.emit(
            EventKind.RECOVERY_DETECTED,
            f"recovery started on {self.node}: {cause}",
            attempt=attempt,
            time=detected_at,
        )

    def stopped(self, attempt: int) -> None:
        seconds = self.timeline.stopped(self.clock.time())
        if seconds is not None:
            self.emit(
                EventKind.RECOVERY_STOP_WORKERS,
                f"workers stopped on {self.node}",
                attempt=attempt,
                duration_s=seconds,
            )

    async def poststart(
        self, round_: RoundInfo, attempt: int, *, rendezvous_done: float, spawned: float | None
    ) -> None:
        """The recovery's end: the workers' spawn (``spawned``: an early one, before the
        round formed; its spawn phase is then 0, the rendezvous phase spans the overlap)."""
        early = spawned is not None
        spawned = spawned if spawned is not None else self.clock.time()
        mine = self.timeline.finish(round_.round, rendezvous_done=rendezvous_done, spawned=spawned)
        if mine is None:
            return
        self.awaiting = FirstProgress(round_.round, spawned)
        for phase, seconds in (("rendezvous", mine.rendezvous_s), ("spawn", mine.spawn_s)):
            self.emit(
                recovery_phase_kind(phase),
                f"recovery phase {phase} on {self.node}",
                attempt=attempt,
                duration_s=seconds,
            )
        self.emit(
            EventKind.RECOVERY_TOTAL,
            f"recovered on {self.node} in {mine.total_s:.3f}s ({mine.cause}): "
            + mine.phases_text()
            + (" (the workers were started early, during the rendezvous)" if early else ""),
            attempt=attempt,
            duration_s=mine.total_s,
        )
        with contextlib.suppress(InvalidTransition):
            await self.update_job(self.job_id, mutate=merge_recovery(mine))

    def progressed(self, view: GroupView, attempt: int) -> None:
        """The heartbeat files were read: time the first ping after a recovery."""
        pinged = [w.last_progress_at for w in view.workers if w.last_progress_at]
        if self.awaiting is None or not pinged:
            return
        awaited, self.awaiting = self.awaiting, None
        seconds = awaited.seconds(min(pinged))
        self.emit(
            EventKind.RECOVERY_FIRST_PROGRESS,
            f"first progress ping on {self.node} after the recovery",
            attempt=attempt,
            duration_s=seconds,
        )
        self.spawn(self._record(awaited.round, seconds), f"first-progress-{self.job_id}")

    async def _record(self, round_: int, seconds: float) -> None:
        with contextlib.suppress(ElasticdError):  # a figure: the store may be away
            await self.update_job(self.job_id, mutate=merge_first_progress(round_, seconds))


#: Seconds between two reads of the heartbeat files for steps and checkpoints
#: (:meth:`ProgressHook.watch`; 1 KiB ``pread`` per worker, no store write unless a
#: checkpoint landed).
PROGRESS_POLL_S = 1.0
#: The longest a stop waits to write its attempt's progress (the store may be out).
PROGRESS_WRITE_TIMEOUT_S = 3.0


@dataclass
class ProgressHook:
    """The heartbeat files of the attempt's workers: progress in the view, hangs, and the
    attempt's steps and checkpoints (:mod:`elasticd.agent.checkpoints`) in the job."""

    emit: Emit
    node: str
    spec: JobSpec
    policy: SpawnPolicy
    owner_user: str | None
    on_progress: Callable[[], None]
    """Told after each read of the files (the view's ``last_progress_at`` is fresh)."""
    job_id: str
    clock: Clock
    update_job: JobUpdater
    monitor: ProgressMonitor | None = None
    attempt: Attempt | None = None
    progress: AttemptProgress | None = None
    """This node's record of the attempt's steps and checkpoints (rebuilt from the files)."""
    reported: AttemptProgress | None = None
    """What of it the job document has (from this node)."""

    def prerun(
        self, attempt: Attempt, heartbeats: dict[int, Path], identity: Identity | None
    ) -> None:
        """Before the spawn: the files are made (workers open them at their first ping)."""
        self.close()  # the previous attempt's descriptors
        self._begin(attempt)
        self.monitor = self._monitor_of(heartbeats, identity)
        self.monitor.prepare()

    def _begin(self, attempt: Attempt) -> None:
        """A fresh record of the attempt's progress (rebuilt from the heartbeat files)."""
        self.attempt = attempt
        self.progress = AttemptProgress(
            round=attempt.round.round, started_from=attempt.started_from
        )
        self.reported = None

    def _monitor_of(
        self, heartbeats: dict[int, Path], identity: Identity | None
    ) -> ProgressMonitor:
        return ProgressMonitor(
            heartbeats,
            ProgressSettings.of(
                self.spec.progress_timeout, self.spec.startup_timeout, self.spec.checkpoint_timeout
            ),
            user=self.spec.user,  # the worker's own user must write its file
            owner_user=self.owner_user,
            owner=None if identity is None else (identity.uid, identity.gid),
            on_check=self._checked,
            on_replaced=self._replaced,
            policy=self.policy,
        )

    def adopt(
        self,
        attempt: Attempt,
        heartbeats: dict[int, Path],
        identity: Identity | None,
        workers: list[HandedWorker],
    ) -> None:
        """After the daemon's re-exec: the heartbeat files its previous image created (their
        descriptors), each worker's deadline clock where it was."""
        self.close()
        self._begin(attempt)
        self.monitor = self._monitor_of(heartbeats, identity)
        for w in workers:
            if w.heartbeat_fd is not None and w.local_rank in heartbeats:
                self.monitor.adopt(w.local_rank, w.heartbeat_fd, w.beat_started)

    def hand_over(self) -> dict[int, tuple[int, float | None]]:
        """The heartbeats for the daemon's next program image (re-exec)."""
        return self.monitor.hand_over() if self.monitor is not None else {}

    def poststart(self) -> None:
        assert self.monitor is not None
        self.monitor.started()

    def exited(self, local_rank: int) -> None:
        """A worker exited (or was judged hung): no deadline for it any more."""
        if self.monitor is not None:
            self.monitor.finished(local_rank)

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.close()

    @property
    def watches_hangs(self) -> bool:
        return self.monitor is not None and self.monitor.settings.enabled

    async def hang(self) -> Hang:
        assert self.monitor is not None
        return await self.monitor.wait_for_hang()

    def refresh(self, *, running_only: bool = False) -> None:
        """The view's ``last_progress_at`` and steps from the files (1 KiB each)."""
        if self.attempt is None or self.monitor is None:
            return
        for w in self.attempt.view.workers:
            if not running_only or w.state in (WorkerState.HEALTHY, WorkerState.UNHEALTHY):
                w.last_progress_at = self.monitor.last_progress_at(w.local_rank)
                beat = self.monitor.beat(w.local_rank)
                if beat is not None:
                    w.step, w.checkpoint_step = beat.step, beat.checkpoint_step

    def observe(self) -> AttemptProgress | None:
        """Read every worker's file (those that exited too) into :attr:`progress`."""
        if self.monitor is None or self.progress is None:
            return self.progress
        offset = self.clock.time() - self.clock.monotonic()
        self.progress = observe(self.progress, self.monitor.beats(finished=True), offset)
        return self.progress

    async def watch(self) -> None:
        """While the workers run: read the files every :data:`PROGRESS_POLL_S`; write the
        attempt's progress into the job when a checkpoint landed. Never returns."""
        while True:
            mine = self.observe()
            if mine is not None and _new_checkpoint(mine, self.reported):
                await self._write(mine)
            await asyncio.sleep(PROGRESS_POLL_S)

    async def report(self) -> None:
        """The workers stopped: write the attempt's last progress into the job (bounded)."""
        mine = self.observe()
        if mine is None or mine == self.reported:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(PROGRESS_WRITE_TIMEOUT_S):
                await self._write(mine)

    async def _write(self, mine: AttemptProgress) -> None:
        try:
            await self.update_job(self.job_id, mutate=merge_attempt(mine, self.clock.time()))
        except ElasticdError as exc:  # the store, or the job ended: the next read retries
            log.info("job %s on %s: progress not written (%s)", self.job_id, self.node, exc)
            return
        except Exception:  # a report is never a reason for the job to fail
            log.exception("job %s on %s: progress not written", self.job_id, self.node)
            return
        self.reported = mine

    def observations(self, clock: Clock) -> list[Observation]:
        """Every worker's heartbeat as read now (also those that exited), for goodput, in
        ``clock``'s wall time."""
        monitor = self.monitor
        if monitor is None:
            return []
        return [monitor.observation(rank, clock) for rank in sorted(monitor.files)]

    def _checked(self, beats: list[Beat]) -> None:
        if self.attempt is None or self.monitor is None:
            return
        self.refresh()
        self.on_progress()

    def _replaced(self, local_rank: int, what: str) -> None:
        """A worker put something else at its heartbeat path: say so once (no progress follows)."""
        assert self.attempt is not None
        rank = self.attempt.rank_of(local_rank)
        self.emit(
            EventKind.WORKER_HEARTBEAT_REPLACED,
            f"rank {rank} on {self.node}: its heartbeat file was replaced by {what}; "
            "the daemon reads only the file it created, and pings that miss it are no progress",
            attempt=self.attempt.spawn_seq,
            rank=rank,
            local_rank=local_rank,
        )


def _new_checkpoint(mine: AttemptProgress, reported: AttemptProgress | None) -> bool:
    """Whether ``mine`` has a checkpoint (or a first step) the job was not told of."""
    if reported is None:  # the attempt's first report: its start (first ping) and origin
        return mine.first_step_at is not None
    return mine.checkpoint_step is not None and (
        reported.checkpoint_step is None or mine.checkpoint_step > reported.checkpoint_step
    )


#: The name of a job's own check among its health checks (``JobSpec.health_check``).
JOB_CHECK = "health_check"


@dataclass(frozen=True)
class HealthHook:
    """The health checks before each (re)start: their events, and what a failure says."""

    emit: Emit
    node: str
    job_id: str
    spec: JobSpec
    checks: HealthChecks | None
    clock: Clock
    cuda_visible_devices: str | None = None

    async def prerun(self, identity: Identity | None) -> RootCause | None:
        """Run them: None when healthy, else the root cause that spends a restart."""
        failed = await self.failed_checks(identity)
        return None if failed is None else failed[0]

    async def failed_checks(self, identity: Identity | None) -> tuple[RootCause, bool] | None:
        """Run them: None when healthy, else the root cause and whether an operator's check
        (the node's own, the GPU check) failed: only those say anything of the node. The
        job's own ``health_check`` is the job's: a job whose check fails quarantines no node
        (any user could otherwise take nodes out of the fleet)."""
        if self.checks is None:
            return None
        results = await self.checks.run(
            self.job_id,
            self.spec,
            identity=identity,
            cuda_visible_devices=self.cuda_visible_devices,
        )
        for r in results:
            kind = (
                EventKind.HEALTH_SKIPPED
                if r.skipped
                else EventKind.HEALTH_PASSED
                if r.ok
                else EventKind.HEALTH_FAILED
            )
            self.emit(kind, f"{r.name} on {self.node}: {r.message}", duration_s=r.duration_s)
        failed = [r for r in results if not r.ok and not r.skipped]
        if not failed:
            return None
        reason = "; ".join(f"{r.name}: {r.message}" for r in failed)
        self.emit(
            EventKind.WORKER_HEALTH_CHECK_FAILED,
            f"node {self.node} is unhealthy for this job: {reason}",
            state="UNHEALTHY",
        )
        root = RootCause(
            message=f"health check failed on {self.node}: {reason}",
            node=self.node,
            timestamp=self.clock.time(),
        )
        return root, any(r.name != JOB_CHECK for r in failed)


@dataclass(frozen=True)
class HangHook:
    """A hang: the ``worker.hang`` event, then the stacks of every rank of the node (and the
    stuck one's kill, with in-process restart)."""

    emit: Emit
    node: str

    async def report(
        self,
        hang: Hang,
        attempt: Attempt,
        workers: Mapping[int, tuple[int, Path]],
        *,
        state: str | None = None,
        kill: bool = False,
    ) -> list[RankStack]:
        """Say the hang, dump the stacks of ``workers`` (local rank -> pid and folder: the
        attempt's running workers) at once, one ``worker.stacks`` each; return where each
        one's main thread was, as read from its dump (:mod:`elasticd.agent.hangs`).

        In a collective hang every rank goes silent, the cause and the ranks waiting for
        it alike: only their stacks tell them apart, so all are dumped. With ``kill``
        (in-process restart) only the stuck rank is, and killed: the others carry on.
        """
        rank = attempt.rank_of(hang.local_rank)
        stuck = workers.get(hang.local_rank)
        pid = stuck[0] if stuck is not None else None
        self.emit(
            EventKind.WORKER_HANG,
            f"rank {rank} on {self.node}: {hang.describe()}"
            + ("; killing this rank only" if kill else ""),
            state=state,
            attempt=attempt.spawn_seq,
            rank=rank,
            local_rank=hang.local_rank,
            pid=pid,
            duration_s=hang.silent_for,
        )
        only = {} if stuck is None else {hang.local_rank: stuck}
        dumped = only if kill else dict(workers)
        found = await asyncio.gather(
            *(
                self._dump(attempt, lr, pid_, folder)
                for lr, (pid_, folder) in sorted(dumped.items())
            )
        )
        if kill and pid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signals.SIGKILL)  # each worker leads its own process group
        return [s for s in found if s is not None][:MAX_RANK_STACKS]

    async def _dump(
        self, attempt: Attempt, local_rank: int, pid: int, folder: Path
    ) -> RankStack | None:
        """One worker's stacks: the ``worker.stacks`` event, and its main thread's signature."""
        rank = attempt.rank_of(local_rank)
        stderr_log = stderr_of(folder)
        size = file_size(stderr_log)
        stacks = await dump_stacks(pid)
        text = stacks.text
        if stacks.to_stderr:
            # faulthandler writes from the worker's signal handler into its stderr
            # pipe; give it a moment to land before the worker is stopped.
            await wait_for_growth(stderr_log, size, timeout=2.0)
            text = await asyncio.to_thread(read_dump, folder, size)
        stack = stack_of(text)
        self.emit(
            EventKind.WORKER_STACKS,
            f"stacks of rank {rank} (pid {pid})"
            + (f": its main thread is in {stack}" if stack else "")
            + f":\n{stacks.text}",
            attempt=attempt.spawn_seq,
            rank=rank,
            local_rank=local_rank,
            pid=pid,
            source="worker",
        )
        if stack is None:
            return None
        collectives = await asyncio.to_thread(read_flight, folder)
        return RankStack(rank=rank, local_rank=local_rank, stack=stack, collectives=collectives)


#: The most of a worker's flight recorder summary read back (a few process groups).
MAX_FLIGHT_BYTES = 64 * 1024


def read_flight(folder: Path) -> int | None:
    """The highest collective sequence number in the worker's flight recorder summary
    (:mod:`elasticd.worker.flight`): the default process group's, else the highest of
    any; None when there is none, or it cannot be read safely (the worker's file: opened
    as :func:`read_dump` opens its stderr). Blocking: run it in a thread."""
    try:
        raw = read_worker_file(folder, FLIGHT_FILE, MAX_FLIGHT_BYTES)
        doc = json.loads(raw)
    except (OSError, ValueError):
        return None
    groups = doc.get("collectives") if isinstance(doc, dict) else None
    if not isinstance(groups, dict):
        return None
    seqs = {k: v for k, v in groups.items() if isinstance(v, int) and 0 <= v < 1 << 62}
    if "default_pg" in seqs:
        return seqs["default_pg"]
    return max(seqs.values(), default=None)


#: The most of a worker's ``stderr.log`` read back for its stack dump: faulthandler's
#: text of a few dozen threads (the main thread is listed last, so the end is kept).
MAX_DUMP_BYTES = 64 * 1024


def read_dump(folder: Path, since: int) -> str:
    """What the worker's ``stderr.log`` gained past ``since`` bytes (its stack dump), at most
    :data:`MAX_DUMP_BYTES` of its end; "" when it cannot be read safely.

    The file is the worker's to replace: it is opened through
    :func:`~elasticd.supervise.files.open_worker_file` (never a link, never blocking on
    a FIFO, one link only). Blocking: run it in a thread.
    """
    grown = file_size(stderr_of(folder)) - since
    if grown <= 0:
        return ""
    try:
        data = read_worker_file(
            folder, stream_file("stderr"), min(grown, MAX_DUMP_BYTES), tail=True
        )
    except (OSError, ValueError):
        return ""
    return data.decode("utf-8", "replace")


def stderr_of(log_dir: Path) -> Path:
    return log_dir / stream_file("stderr")


def file_size(path: Path) -> int:
    """Size of a local log file (a stat; never blocks for long), 0 when absent.

    ``lstat``: the file lies in the worker's folder, and a link put there is not followed.
    """
    try:
        return os.lstat(path).st_size
    except OSError:
        return 0


async def wait_for_growth(path: Path, size: int, timeout: float) -> bool:
    """Until ``path`` is larger than ``size`` and stopped growing for a moment (the rest of
    the dump arrived), bounded by ``timeout``; the pipe reader announces nothing."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    last = size
    while loop.time() < deadline:
        now = file_size(path)
        if now > size and now == last:
            return True
        last = now
        await asyncio.sleep(0.05 if now > size else 0.02)
    return file_size(path) > size
