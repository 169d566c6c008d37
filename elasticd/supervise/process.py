"""The processes of one job attempt on one node: spawn, watch, stop.

:class:`WorkerGroupProcesses` starts every worker in its own session (and so
its own process group), learns of each exit the moment it happens, and ends
them all through one routine, :meth:`WorkerGroupProcesses.stop`. What the
workers *mean* (ranks, states, restarts) is the agent's business; this
module only knows processes, their output and their error files.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import logging
import os
import signal
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Protocol, TypedDict

from elasticd.clock import SYSTEM_CLOCK, Clock
from elasticd.errors import SpawnStage, WorkerSpawnError
from elasticd.logs import attempt_of, stream_file
from elasticd.security import Identity, prepare_worker_dir
from elasticd.storage import StorageHealth
from elasticd.supervise.adopt import (
    AdoptedProcess,
    HandedPipe,
    HandedWorker,
    unreported_exit,
    zombie_status,
)
from elasticd.supervise.cgroup import AttemptContainment, Cgroup
from elasticd.supervise.errorfile import WorkerError, read_error_file
from elasticd.supervise.output import OutputPipe, OutputSink, Stream
from elasticd.supervise.outputlimits import SpaceGuard
from elasticd.supervise.records import WorkerRecord
from elasticd.supervise.spawn import DEFAULT_POLICY, SpawnPolicy, WorkerRegistry, start_process
from elasticd.supervise.sweep import boot_id, group_has_live_members, process_start_time
from elasticd.supervise.tracebacks import traceback_from_log

if TYPE_CHECKING:
    from elasticd.supervise.standby import StandbyPool

__all__ = [
    "DEFAULT_STOP_GRACE",
    "GroupResult",
    "OutputSink",
    "Stream",
    "WorkerError",
    "WorkerExit",
    "WorkerGroupProcesses",
    "WorkerLaunch",
]

log = logging.getLogger(__name__)

#: Grace used by ``async with`` when the group is still running at exit (torch's default too).
DEFAULT_STOP_GRACE = 30.0

#: Once every worker is gone, how long the output of processes that left the
#: worker's process group (and so escaped the kill) is still awaited.
DRAIN_TIMEOUT = 2.0

#: How long a failed worker's stderr is awaited before its exit is reported, so that
#: the traceback it printed last is in ``stderr.log`` (:mod:`.tracebacks`). The pipe
#: ends with the worker unless a child of it still holds it; then the cause may miss.
LOG_SETTLE_TIMEOUT = 0.5

#: describe() quotes at most this much of the worker's message (its first line).
_DESCRIBE_MESSAGE_CHARS = 300

#: After SIGKILL, how often to complain about a worker that is still there
#: (uninterruptible sleep in a driver); the wait itself never gives up.
_KILL_WARN_INTERVAL = 10.0


@dataclass(frozen=True)
class WorkerLaunch:
    """How to start one worker."""

    local_rank: int
    argv: Sequence[str]
    """``[entrypoint, *args]``; an entrypoint without a slash is looked up on ``env["PATH"]``,
    by the worker's own process, as its user (:func:`~elasticd.supervise.spawn.start_process`)."""
    env: Mapping[str, str]
    """The complete environment of the worker; nothing is inherited from the daemon, and
    :data:`~elasticd.supervise.env.WITHHELD` never passes."""
    cwd: str | None
    log_dir: Path
    """Gets ``stdout.log`` and ``stderr.log`` (appended); created if missing."""
    console_stdout: bool = False
    """Also pass this worker's stdout lines to the group's output sink (torchrun's tee)."""
    console_stderr: bool = False
    user: str | None = None
    """The user the job asks to run as; the daemon's policy decides
    (:mod:`elasticd.security`)."""
    owner_user: str | None = None
    """The Unix user the job's submitter proved to be (``JobOwner.unix_user``)."""
    job_id: str | None = None
    """For the daemon's record of spawned workers; default: ``env["ELASTICD_JOB_ID"]``."""
    attempt: int | None = None
    """For the same record; default: from a ``log_dir`` of the form ``.../attempt_<n>/<rank>``."""
    log_limit_bytes: int | None = None
    """The most bytes each of ``stdout.log`` and ``stderr.log`` takes in this attempt; the
    rest is counted and dropped (:attr:`WorkerGroupProcesses.over_budget`). None: no budget."""
    umask: int | None = None
    """The worker's umask (the job's ``umask_bits``); None: the daemon's own."""

    @property
    def error_file(self) -> Path | None:
        """Where the worker writes its error file: ``$TORCHELASTIC_ERROR_FILE``, if set."""
        path = self.env.get("TORCHELASTIC_ERROR_FILE")
        return Path(path) if path else None


@dataclass(frozen=True)
class WorkerExit:
    """How one worker ended."""

    local_rank: int
    pid: int
    exit_code: int | None
    """None when the worker was killed by a signal."""
    signal: int | None
    """The signal that killed the worker, if one did."""
    exited_at: float
    """Wall-clock time the daemon saw the exit."""
    error: WorkerError | None
    """The worker's error file, read when the exit is a failure and the file exists."""
    stopped: bool = False
    """The worker was still running when :meth:`WorkerGroupProcesses.stop` signalled it."""
    reported: bool = False
    """The daemon's previous program image reported this exit already (re-exec): told
    again only so that the group counts it, never to be reported twice."""
    seen_at: float | None = None
    """When the daemon reaped the exit, on its monotonic clock (None: the previous image
    saw it, or an adopted worker's), moved back to when it wrote its error: what orders
    failures across nodes (:func:`elasticd.agent.edits.in_time_order`)."""

    @property
    def failed(self) -> bool:
        """True unless the worker exited with code 0."""
        return self.exit_code != 0 or self.signal is not None

    @property
    def failed_at(self) -> float:
        """When the failure happened, for ordering: the error file's time, else the exit's."""
        return self.error.timestamp if self.error is not None else self.exited_at

    def describe(self) -> str:
        """One line for people: who exited, how, and the worker's own message if it left one."""
        who = f"local rank {self.local_rank} (pid {self.pid})"
        if self.signal is not None:
            how = f"was killed by {_signal_name(self.signal)}"
        else:
            how = f"exited with code {self.exit_code}"
        if self.error is None:
            return f"{who} {how}"
        message = self.error.message.strip().splitlines()[0] if self.error.message.strip() else ""
        if len(message) > _DESCRIBE_MESSAGE_CHARS:
            message = message[:_DESCRIBE_MESSAGE_CHARS] + "..."
        return f"{who} {how}: {message}"


def _seen_at(worker: _Worker, error: WorkerError | None) -> float | None:
    """When the worker failed on the monotonic clock: its reaping, moved back to when its
    error was written (error file or stderr) as this node's wall clock measured the gap."""
    if worker.reaped_at is None or worker.reaped_wall is None:
        return None
    if error is None:
        return worker.reaped_at
    return worker.reaped_at - min(max(0.0, worker.reaped_wall - error.timestamp), 3600.0)


class GroupHooks(TypedDict):
    """What a group's owner hands :meth:`WorkerGroupProcesses.start` and ``adopt``."""

    on_output: OutputSink | None
    on_exit: Callable[[WorkerExit], None] | None
    clock: Clock
    storage: StorageHealth | None
    policy: SpawnPolicy
    on_written: Callable[[Path], None] | None


@dataclass(frozen=True)
class GroupResult:
    """The outcome of a worker group so far."""

    succeeded: bool
    """Every worker of the group exited with code 0."""
    exits: Mapping[int, WorkerExit]
    """The exits seen so far, by local rank."""
    failures: Sequence[WorkerExit]
    """The failed exits, in local-rank order, including those caused by ``stop()``."""

    @property
    def root_cause(self) -> WorkerExit | None:
        """The first failure (torch's ordering: error-file timestamp, else exit time).

        Exits caused by ``stop()`` are consequences, not causes, and are not
        considered; None when there is no other failure.
        """
        causes = [exit_ for exit_ in self.failures if not exit_.stopped]
        if not causes:
            return None
        return min(causes, key=lambda exit_: (exit_.failed_at, exit_.exited_at, exit_.local_rank))


class _Phase(enum.Enum):
    """The lifecycle of a group; it only moves forward."""

    STARTING = "starting"
    """start() is spawning the workers."""
    RUNNING = "running"
    """Every worker was spawned; exits are being watched."""
    STOPPING = "stopping"
    """The termination routine runs."""
    CLOSED = "closed"
    """Every worker has exited and the pipes and log files are closed."""


class _Child(Protocol):
    """What a worker's process is to the group: spawned here, or adopted after a re-exec."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int: ...


class _Worker:
    """One spawned worker: its process, its pipes, its exit."""

    def __init__(
        self,
        launch: WorkerLaunch,
        process: _Child,
        pipes: tuple[OutputPipe, OutputPipe],
    ) -> None:
        self.launch = launch
        self.process = process
        self.pid = process.pid
        self.pipes = pipes
        self.exit: WorkerExit | None = None
        self.exited = asyncio.Event()
        self.signalled = False
        #: When its exit was reaped, on the monotonic clock (before the wait for its log).
        self.reaped_at: float | None = None
        self.reaped_wall: float | None = None
        self.watch: asyncio.Task[None] | None = None
        #: When the previous program image reported its exit (re-exec; None: it did not).
        self.reported_at: float | None = None


class WorkerGroupProcesses:
    """The worker processes of one job attempt on this node.

    Create with :meth:`start`; use as ``async with`` so the workers are
    stopped however the block is left. :meth:`wait` returns as soon as the
    outcome is known; :meth:`stop` is the only way workers are ended.
    """

    def __init__(
        self,
        *,
        on_output: OutputSink | None = None,
        on_exit: Callable[[WorkerExit], None] | None = None,
        clock: Clock = SYSTEM_CLOCK,
        storage: StorageHealth | None = None,
    ) -> None:
        """Internal: use :meth:`start`, which returns a group whose workers run."""
        self._storage = storage
        self.pids: dict[int, int] = {}
        self.started_at: dict[int, float] = {}
        self._on_output = on_output
        self._on_exit = on_exit
        self._clock = clock
        self._workers: dict[int, _Worker] = {}
        self._expected = 0
        self._phase = _Phase.STARTING
        self._decided = asyncio.Event()
        self._stop_task: asyncio.Task[GroupResult] | None = None
        self._registry: WorkerRegistry | None = None
        self._policy = DEFAULT_POLICY
        self._on_written: Callable[[Path], None] | None = None
        self._recorded: list[tuple[int, int]] = []
        # One per (filesystem, job user): the room that user has there, shared by the log files.
        self._guards: dict[tuple[int, tuple[int, int] | None], SpaceGuard] = {}
        self._containment: AttemptContainment | None = None
        #: Pids killed at the stop that had left the workers' process groups (strays).
        self.strays: list[int] = []
        self._partial_notice: str | None = None
        self._standbys: StandbyPool | None = None

    @classmethod
    async def start(
        cls,
        launches: Sequence[WorkerLaunch],
        *,
        on_output: OutputSink | None = None,
        on_exit: Callable[[WorkerExit], None] | None = None,
        clock: Clock = SYSTEM_CLOCK,
        storage: StorageHealth | None = None,
        policy: SpawnPolicy = DEFAULT_POLICY,
        on_written: Callable[[Path], None] | None = None,
        standbys: StandbyPool | None = None,
    ) -> WorkerGroupProcesses:
        """Spawn every worker (concurrently) and start watching them.

        If one cannot be spawned, the ones already started are stopped and
        :class:`~elasticd.errors.WorkerSpawnError` is raised naming its local
        rank, entrypoint and the OS error. A cancelled start leaves no process either.
        """
        _check_launches(launches)
        group = cls(on_output=on_output, on_exit=on_exit, clock=clock, storage=storage)
        group._policy = policy
        group._on_written = on_written
        group._standbys = standbys
        group._expected = len(launches)
        try:
            # Concurrently: each spawn waits for its child to join the attempt's cgroup
            # (a short root stage), and a restart should cost one such wait, not one a worker.
            results = await asyncio.gather(
                *(group._spawn(launch) for launch in launches), return_exceptions=True
            )
            failed = [r for r in results if isinstance(r, BaseException)]
            if failed:
                raise failed[0]  # the lowest local rank that failed
        except BaseException:
            await group.stop(0.0)
            raise
        group._phase = _Phase.RUNNING
        return group

    @property
    def containment_partial(self) -> str | None:
        """Why this group is only partly contained (no cgroup: a subreaper), with the fix,
        when it is the daemon's first such group; None otherwise (said once per daemon)."""
        return self._partial_notice

    @property
    def closed(self) -> bool:
        """True once :meth:`stop` has finished: every worker exited, logs closed."""
        return self._phase is _Phase.CLOSED

    def snapshot(self) -> GroupResult:
        """The exits seen so far, without waiting."""
        exits = {
            rank: worker.exit
            for rank, worker in sorted(self._workers.items())
            if worker.exit is not None
        }
        failures = [exit_ for exit_ in exits.values() if exit_.failed]
        return GroupResult(
            succeeded=len(exits) == self._expected and not failures,
            exits=exits,
            failures=failures,
        )

    async def wait(self) -> GroupResult:
        """Return as soon as the outcome is known, without stopping anyone.

        That is: every worker exited 0, or one failed (the others may still
        run), or :meth:`stop` finished. Exits caused by a concurrent
        :meth:`stop` do not count as the first failure; then this returns
        with the final result when the stop is over.
        """
        if self._phase is _Phase.STARTING:
            raise RuntimeError("the worker group is still starting")
        await self._decided.wait()
        return self.snapshot()

    async def stop(self, grace: float = DEFAULT_STOP_GRACE) -> GroupResult:
        """End every worker and return the final result: the one termination routine.

        SIGTERM goes to the process group of every worker (so grandchildren
        get it too); after all workers have exited and their output pipes
        are closed, or after `grace` seconds, whatever is left of the groups
        gets SIGKILL, and every exit is awaited. Then whatever else is left
        of the attempt (its cgroup, or the daemon's adopted children: processes
        that left the workers' groups) is killed and listed in :attr:`strays`,
        the output is drained and the log files closed.

        Idempotent and safe alongside :meth:`wait`: a second call, concurrent
        or later, waits for the same routine (the first call's `grace` holds).
        If the caller is cancelled, the routine still runs to its end before
        the cancellation is raised, so no worker outlives a cancelled stop.
        """
        if grace < 0:
            raise ValueError(f"grace must be >= 0, got {grace}")
        if self._stop_task is None:
            if self._phase is not _Phase.CLOSED:
                self._phase = _Phase.STOPPING
            self._stop_task = asyncio.get_running_loop().create_task(
                self._terminate(grace), name="elasticd-workers-stop"
            )
        task = self._stop_task
        interrupted: asyncio.CancelledError | None = None
        while True:
            try:
                result = await asyncio.shield(task)
                break
            except asyncio.CancelledError as exc:
                if task.done():
                    raise  # the routine itself was cancelled (loop teardown): nothing to wait for
                interrupted = exc
        if interrupted is not None:
            raise interrupted
        return result

    async def __aenter__(self) -> WorkerGroupProcesses:
        if self._phase is not _Phase.RUNNING:
            raise RuntimeError(f"cannot enter a worker group that is {self._phase.value}")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop(DEFAULT_STOP_GRACE)

    # Across the daemon's re-exec (elasticd.supervise.adopt).

    def pending_exit(self) -> bool:
        """Some worker was reaped but asyncio has not delivered its exit yet."""
        return any(unreported_exit(w.pid, w.process.returncode) for w in self._workers.values())

    def snapshot_at_exec(self) -> tuple[GroupResult, frozenset[int]]:
        """The exits as they are at the exec, no await: :meth:`snapshot` and the exits not
        recorded yet (reaped, their log awaited; reaped, not delivered; a zombie nobody has
        reaped: looked at, not reaped), and the local ranks of those (nothing said them)."""
        exits = {rank: w.exit for rank, w in self._workers.items() if w.exit is not None}
        unsaid = set()
        for rank, worker in self._workers.items():
            if worker.exit is not None:
                continue
            returncode = worker.process.returncode
            if returncode is None:
                returncode = zombie_status(worker.pid)
            if returncode is not None:
                exits[rank] = self._exit_of(worker, returncode)
                unsaid.add(rank)
        exits = dict(sorted(exits.items()))
        failures = [exit_ for exit_ in exits.values() if exit_.failed]
        succeeded = len(exits) == self._expected and not failures
        return GroupResult(succeeded, exits, failures), frozenset(unsaid)

    def hand_over(self) -> tuple[list[HandedWorker], str | None] | None:
        """The workers for the next program image (inheritable copies of their descriptors),
        and the attempt's cgroup; None when this group is not simply running."""
        if self._phase is not _Phase.RUNNING or self._stop_task is not None:
            return None
        recorded = dict(self._recorded)
        handed = []
        for rank, w in sorted(self._workers.items()):
            start_time = recorded.get(w.pid)
            if start_time is None:
                return None  # never recorded: nothing proves its identity to the next image
            returncode = w.process.returncode
            reported_at = None
            if w.exit is not None:  # reported already: the next image only counts it
                code = w.exit.exit_code
                returncode = -(w.exit.signal or 0) if code is None else code
                reported_at = w.exit.exited_at
            handed.append(
                HandedWorker(
                    local_rank=rank,
                    pid=w.pid,
                    start_time=start_time,
                    started_at=self.started_at[rank],
                    stdout=w.pipes[0].hand_over(),
                    stderr=w.pipes[1].hand_over(),
                    heartbeat_fd=None,
                    beat_started=None,
                    returncode=returncode,
                    reported_at=reported_at,
                )
            )
        cgroup = self._containment.cgroup if self._containment is not None else None
        return handed, str(cgroup.path) if cgroup is not None else None

    @classmethod
    async def adopt(
        cls,
        launches: Sequence[WorkerLaunch],
        handed: Sequence[HandedWorker],
        cgroup: str | None,
        *,
        on_output: OutputSink | None = None,
        on_exit: Callable[[WorkerExit], None] | None = None,
        clock: Clock = SYSTEM_CLOCK,
        storage: StorageHealth | None = None,
        policy: SpawnPolicy = DEFAULT_POLICY,
        on_written: Callable[[Path], None] | None = None,
    ) -> WorkerGroupProcesses:
        """Take up workers the previous program image of this daemon spawned (checked by
        the caller: :func:`elasticd.supervise.adopt.check_worker`); watched from now on
        exactly as if this image had spawned them."""
        by_rank = {launch.local_rank: launch for launch in launches}
        group = cls(on_output=on_output, on_exit=on_exit, clock=clock, storage=storage)
        group._policy, group._on_written, group._registry = policy, on_written, policy.registry
        group._expected = len(handed)
        job_id = launches[0].job_id or launches[0].env.get("ELASTICD_JOB_ID", "")
        containment = policy.containment
        group._containment = AttemptContainment(
            cgroup=Cgroup(Path(cgroup)) if cgroup is not None else None,
            job_id=job_id,
            attempt_tag=launches[0].env.get("ELASTICD_ATTEMPT"),
            known=containment._known if containment is not None else frozenset,
        )
        for worker in handed:
            launch = by_rank[worker.local_rank]
            pipes = (
                await group._adopt_pipe(launch, "stdout", launch.console_stdout, worker.stdout),
                await group._adopt_pipe(launch, "stderr", launch.console_stderr, worker.stderr),
            )
            process = AdoptedProcess(worker.pid, worker.returncode)
            w = _Worker(launch, process, pipes)
            w.reported_at = worker.reported_at
            group._workers[worker.local_rank] = w
            group.pids[worker.local_rank] = worker.pid
            group.started_at[worker.local_rank] = worker.started_at
            group._recorded.append((worker.pid, worker.start_time))
            group._arm_watch(w)
        group._phase = _Phase.RUNNING
        return group

    async def _adopt_pipe(
        self, launch: WorkerLaunch, stream: Stream, console: bool, handed: HandedPipe
    ) -> OutputPipe:
        # A pipe at its end (its worker exited before the exec) writes nothing more.
        guard = None if handed.at_eof else self._guard(os.fstat(handed.file_fd).st_dev, None)
        return await OutputPipe.adopt(
            launch.local_rank,
            stream,
            launch.log_dir / stream_file(stream),
            self._on_output if console else None,
            handed,
            health=self._storage,
            on_written=self._on_written,
            limit_bytes=launch.log_limit_bytes,
            guard=guard,
        )

    # Spawning.

    async def _spawn(self, launch: WorkerLaunch) -> None:
        rank = launch.local_rank
        argv = [str(arg) for arg in launch.argv]
        policy = self._policy
        self._registry = policy.registry
        try:
            identity = policy.identity_for(
                launch.user,
                owner_user=launch.owner_user,
                job_id=launch.job_id or launch.env.get("ELASTICD_JOB_ID"),
            )
        except WorkerSpawnError as exc:
            raise WorkerSpawnError(
                f"local rank {rank}: {exc}", stage=exc.stage or SpawnStage.USER, errno=exc.errno
            ) from None
        try:
            prepare_worker_dir(launch.log_dir, identity)
            _remove_stale_error_file(launch)
            stdout = await self._open_pipe(launch, "stdout", launch.console_stdout, identity)
            try:
                stderr = await self._open_pipe(launch, "stderr", launch.console_stderr, identity)
            except BaseException:
                stdout.close()
                raise
        except OSError as exc:
            raise WorkerSpawnError(
                f"local rank {rank}: cannot set up the logs of {argv[0]!r} in "
                f"{launch.log_dir}: {exc}",
                stage=SpawnStage.LOGS,
            ) from exc
        try:
            if self._containment is None and policy.containment is not None:
                self._containment = policy.containment.open_attempt(
                    launch.job_id or launch.env.get("ELASTICD_JOB_ID", ""),
                    launch.attempt if launch.attempt is not None else attempt_of(launch.log_dir),
                    launch.env.get("ELASTICD_ATTEMPT"),
                )
                self._partial_notice = policy.containment.notice()
        except OSError as exc:
            stdout.close()
            stderr.close()
            raise WorkerSpawnError(
                f"local rank {rank}: cannot make its cgroup: {exc}", stage=SpawnStage.CGROUP
            ) from exc
        try:
            # The entrypoint is looked up, and cwd entered, by the child as the job's
            # user: the daemon never probes a job-chosen path with its own rights. Forked on
            # the loop's (main) thread: the parent-death signal belongs to the forking thread,
            # and only the main thread lives through the daemon's re-exec (node/reexec.py).
            process = None
            if self._standbys is not None:
                process = await self._standbys.hand_off(
                    launch,
                    identity,
                    stdout=stdout.write_fd,
                    stderr=stderr.write_fd,
                    stdin=policy.worker_stdin,
                    containment=self._containment,
                )
            process = process or await start_process(
                argv,
                launch.env,
                identity=identity,
                cwd=launch.cwd,
                stdout=stdout.write_fd,
                stderr=stderr.write_fd,
                policy=policy,
                cgroup_procs=self._containment.procs_fd if self._containment else None,
                stdin=policy.worker_stdin,
                umask=launch.umask,
            )
        except BaseException as exc:
            stdout.close()
            stderr.close()
            if isinstance(exc, WorkerSpawnError):
                raise WorkerSpawnError(
                    f"local rank {rank}: {exc}", stage=exc.stage, errno=exc.errno
                ) from exc.__cause__
            raise
        finally:
            # The worker has its own copies now; the daemon's would keep EOF from ever coming.
            stdout.close_write_end()
            stderr.close_write_end()
        worker = _Worker(launch, process, (stdout, stderr))  # pipes[1]: stderr
        self._workers[rank] = worker
        self.pids[rank] = process.pid
        self.started_at[rank] = self._clock.time()
        self._record(launch, process.pid)
        self._arm_watch(worker)
        log.info("local rank %d started: pid %d, %s", rank, process.pid, argv[0])

    async def _open_pipe(
        self, launch: WorkerLaunch, stream: Stream, console: bool, identity: Identity | None
    ) -> OutputPipe:
        sink = self._on_output if console else None
        owner = (identity.uid, identity.gid) if identity is not None else None
        guard = self._guard(os.stat(launch.log_dir).st_dev, owner)
        pipe = await OutputPipe.open(
            launch.local_rank,
            stream,
            launch.log_dir / stream_file(stream),
            sink,
            owner=owner,
            health=self._storage,
            on_written=self._on_written,
            limit_bytes=launch.log_limit_bytes,
            guard=guard,
        )
        pipe.clock = self._clock.time
        return pipe

    def _guard(self, device: int, owner: tuple[int, int] | None) -> SpaceGuard:
        """One per (filesystem, job user): the room that user has there."""
        guard = self._guards.get((device, owner))
        if guard is None:
            guard = self._guards[(device, owner)] = SpaceGuard(owner, self._clock)
        return guard

    def lost_output(self) -> dict[int, int]:
        """Bytes of output per local rank that could not be written to its log files."""
        lost = {
            rank: sum(pipe.bytes_lost for pipe in worker.pipes)
            for rank, worker in self._workers.items()
        }
        return {rank: n for rank, n in sorted(lost.items()) if n}

    def over_budget(self) -> dict[int, int]:
        """Bytes of output per local rank dropped past the attempt's ``log_limit_bytes``."""
        over = {
            rank: sum(pipe.bytes_over_budget for pipe in worker.pipes)
            for rank, worker in self._workers.items()
        }
        return {rank: n for rank, n in sorted(over.items()) if n}

    def _record(self, launch: WorkerLaunch, pid: int) -> None:
        """Remember the worker in the daemon's database, for the start-up sweep of orphans."""
        if self._registry is None:
            return
        start_time = process_start_time(pid)
        if start_time is None:
            return  # already gone
        try:
            self._registry.record_worker(
                WorkerRecord(
                    pid=pid,
                    start_time=start_time,
                    boot_id=boot_id(),
                    job_id=launch.job_id or launch.env.get("ELASTICD_JOB_ID", ""),
                    attempt=launch.attempt
                    if launch.attempt is not None
                    else attempt_of(launch.log_dir),
                    local_rank=launch.local_rank,
                )
            )
            self._recorded.append((pid, start_time))
        except Exception:  # the record is a safety net; never fail a spawn over it
            log.exception("cannot record worker pid %d for the orphan sweep", pid)

    def _forget(self) -> None:
        if self._registry is None or not self._recorded:
            return
        try:
            self._registry.forget_workers(self._recorded)
            self._recorded = []
        except Exception:
            log.exception("cannot forget stopped workers in the daemon's database")

    # Watching.

    def _arm_watch(self, worker: _Worker) -> None:
        """Watch ``worker`` for its exit; again when its watch ended without one.

        A watch ends early only when it is cancelled, which only a loop tearing down does
        (``asyncio.run`` ending with tasks left, the test runner's clean-up): the stop that
        follows still has to see each exit, or it would wait for ever.
        """
        if worker.exit is None and (worker.watch is None or worker.watch.done()):
            worker.watch = asyncio.get_running_loop().create_task(
                self._watch(worker), name=f"elasticd-worker-{worker.launch.local_rank}-exit"
            )

    async def _watch(self, worker: _Worker) -> None:
        # The process holds no pipe of ours, so this returns when its exit is reaped
        # (asyncio's child watcher), not when its output closes.
        returncode = await worker.process.wait()
        worker.reaped_at = self._clock.monotonic()
        worker.reaped_wall = self._clock.time()
        if returncode != 0 and not worker.signalled and worker.reported_at is None:
            # Its traceback may still be in the stderr pipe: let it reach stderr.log
            # (at once, unless a child of the worker still holds the pipe).
            await _all_done([worker.pipes[1].wait_eof], LOG_SETTLE_TIMEOUT)
        self._record_exit(worker, returncode)

    def _record_exit(self, worker: _Worker, returncode: int) -> None:
        exit_ = self._exit_of(worker, returncode)
        reported = exit_.reported
        worker.exit = exit_
        worker.exited.set()
        # INFO, a failure too: the agent's worker.exited event says it (at WARNING it was
        # said twice in a daemon's log, and twice on `elasticd run`'s console).
        if not reported:
            log.info("%s", exit_.describe())
        if self._on_exit is not None:
            try:
                self._on_exit(exit_)
            except Exception:
                log.exception("the on_exit callback failed for local rank %d", exit_.local_rank)
        if (exit_.failed and not exit_.stopped) or self.snapshot().succeeded:
            self._decided.set()

    def _exit_of(self, worker: _Worker, returncode: int) -> WorkerExit:
        """How ``worker`` ended, its status ``returncode`` (its error file or log read)."""
        reported = worker.reported_at is not None
        exited_at = worker.reported_at if worker.reported_at is not None else self._clock.time()
        exit_code, signal_number = (None, -returncode) if returncode < 0 else (returncode, None)
        failed = exit_code != 0
        error_file = worker.launch.error_file
        error = (
            read_error_file(error_file, default_timestamp=exited_at)
            if failed and error_file is not None
            else None
        )
        if error is None and failed and not worker.signalled:
            # The time it said so on stderr, when it did: its exit may come much later.
            said = worker.pipes[1].error_at
            error = traceback_from_log(worker.launch.log_dir, timestamp=said or exited_at)
        return WorkerExit(
            local_rank=worker.launch.local_rank,
            pid=worker.pid,
            exit_code=exit_code,
            signal=signal_number,
            exited_at=exited_at,
            error=error,
            stopped=worker.signalled,
            reported=reported,
            seen_at=None if reported else _seen_at(worker, error),
        )

    # Stopping.

    async def _terminate(self, grace: float) -> GroupResult:
        workers = list(self._workers.values())
        pipes = [pipe for worker in workers for pipe in worker.pipes]
        for worker in workers:
            if worker.exit is None:
                worker.signalled = True
            _signal_group(worker, signal.SIGTERM)
        if grace > 0:
            # Exited and EOF together: a child of the worker that still holds its
            # stdout is still shutting down, and gets the same grace; unless the
            # workers' groups are empty, and what holds the pipe is a stray that
            # never got the SIGTERM (it is killed with the attempt below).
            await _all_done(
                [w.exited.wait for w in workers]
                + [functools.partial(_eof_or_groups_gone, workers, pipes)],
                grace,
            )
        # Whatever is left of the groups: workers that ignored SIGTERM, and
        # their children, with or without the pipes. A no-op for empty groups.
        for worker in workers:
            _signal_group(worker, signal.SIGKILL)
            if worker.exit is None:
                # Also by pid, in case the worker moved itself out of its group.
                _kill_pid(worker, signal.SIGKILL)
        for worker in workers:
            self._arm_watch(worker)
        while not await _all_done([w.exited.wait for w in workers], _KILL_WARN_INTERVAL):
            alive = [w.launch.local_rank for w in workers if w.exit is None]
            log.warning("local ranks %s still there after SIGKILL; waiting", alive)
            for worker in workers:
                self._arm_watch(worker)
        if self._containment is not None:
            # Everything else the attempt created: the processes that left the groups.
            try:
                self.strays = await self._containment.stop({w.pid for w in workers})
            except OSError as exc:
                log.warning("cannot stop the attempt's cgroup: %s", exc)
            if self.strays:
                log.warning(
                    "killed %d process(es) that had left the workers' process groups: %s",
                    len(self.strays),
                    self.strays,
                )
        if not await _all_done([p.wait_eof for p in pipes], DRAIN_TIMEOUT):
            open_ = sorted({p.local_rank for p in pipes if not p.at_eof})
            log.warning(
                "output of local ranks %s is still held open by a process outside the "
                "worker's process group; giving it up",
                open_,
            )
        for pipe in pipes:
            pipe.close()
        for worker in workers:
            if worker.watch is not None:
                await worker.watch
        self._forget()  # every group was SIGKILLed above: nothing of them is left to sweep
        self._phase = _Phase.CLOSED
        self._decided.set()
        return self.snapshot()


def _check_launches(launches: Sequence[WorkerLaunch]) -> None:
    if not launches:
        raise ValueError("a worker group needs at least one worker")
    ranks = [launch.local_rank for launch in launches]
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"local ranks must be unique, got {ranks}")
    for launch in launches:
        if not launch.argv:
            raise ValueError(f"local rank {launch.local_rank}: argv is empty")


def _remove_stale_error_file(launch: WorkerLaunch) -> None:
    # A file left by an earlier run at the same path would be read as this
    # worker's error (torch empties the attempt folder for the same reason).
    path = launch.error_file
    if path is None:
        return
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        log.warning(
            "local rank %d: cannot remove old error file %s: %s", launch.local_rank, path, exc
        )


def _signal_group(worker: _Worker, sig: signal.Signals) -> None:
    """Send `sig` to the worker's process group, if that group can still be ours."""
    pgid = worker.pid  # a session leader's group id is its pid
    if worker.exit is not None and _pid_in_use(pgid):
        # The worker was reaped, so its pid is free: a process that has it now
        # is someone else, who may lead a group with this id. Linux keeps a pid
        # reserved while it names a live group, so no process with this pid
        # means the id still names only the worker's leftovers, or nothing.
        return
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass  # the group is empty
    except PermissionError as exc:
        log.warning(
            "local rank %d: cannot send %s to process group %d: %s",
            worker.launch.local_rank,
            sig.name,
            pgid,
            exc,
        )


def _kill_pid(worker: _Worker, sig: signal.Signals) -> None:
    try:
        os.kill(worker.pid, sig)
    except ProcessLookupError:
        pass


def _pid_in_use(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


async def _eof_or_groups_gone(workers: Sequence[_Worker], pipes: Sequence[OutputPipe]) -> None:
    """Until every pipe is at EOF, or every worker exited and left an empty process group."""
    while not all(pipe.at_eof for pipe in pipes):
        if all(w.exit is not None for w in workers) and not any(
            group_has_live_members(w.pid) for w in workers
        ):
            return
        await asyncio.sleep(0.05)


async def _all_done(waits: Iterable[Callable[[], Awaitable[object]]], timeout: float) -> bool:
    """Await every one of `waits`; False if `timeout` seconds pass first."""
    try:
        async with asyncio.timeout(timeout):
            for wait in waits:
                await wait()
    except TimeoutError:
        return False
    return True


@functools.cache
def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
