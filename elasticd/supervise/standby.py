"""Standby interpreters: one per local rank, past its imports, for the next attempt (issue 27).

A job that names modules in ``prewarm`` gets, while an attempt runs, one
standby process per local rank (:class:`StandbyPool`): started exactly as
that rank's worker is (:func:`~elasticd.supervise.spawn.start_process`: the
job's user, umask, working folder, the parent-death signal, a cgroup), with
the worker's environment less :data:`~elasticd.supervise.env.ROUND_VARIABLES`,
running :mod:`elasticd.standby_main`: it imports the modules and blocks on
its control socket. Its output goes nowhere (``/dev/null``) and it opens no
file of the job; it lives in a cgroup of its own, with all it starts.

On the next start, :meth:`StandbyPool.hand_off` gives the rank's worker to
its standby instead of a new interpreter: the standby, and everything its
imports started (in any session), is moved into the attempt's cgroup, gets
the worker's stdout/stderr pipes (and stdin) and the whole environment over
the socket (JSON and ``SCM_RIGHTS``, never pickle), and runs the program as
the cold start would. The supervisor then holds the same
:class:`asyncio.subprocess.Process` it would have spawned: pid, exit, logs,
heartbeat and stack dumps follow.

Where it cannot apply, the worker starts cold and the pool says why
(:attr:`StandbyPool.cold`): the entrypoint is not ``python`` running a script
or ``-m module`` (:func:`python_program`), the worker's argv, folder, user,
umask or environment differ from what the standby was made for
(:func:`mismatch`), or the standby died or failed its imports. A standby that
dies after it was ready is replaced (at most :data:`MAX_REPLACEMENTS` times
an attempt); :meth:`StandbyPool.aclose` leaves none. A standby that ends any
way but the hand-off takes its cgroup along (killed, removed); under the
subreaper, its process group, then what of the job's orphans reached the daemon.

A cold attempt's standbys start with its workers where the node has a spare
CPU for each, so that they are ready for an early crash; on a node without,
only after the workers' own imports (:func:`fill_wait`): beside them they
would take the CPU the attempt needs. A standby still importing when its rank
starts again is never waited for: the rank starts cold at once, and the
standby is killed (its end does not hold the start).

If the daemon dies, its standbys die with it (the parent-death signal). They
are in the spawn registry all the same (attempt None): their imports are the
job's code (the job's modules, its ``.pth`` files, its ``LD_PRELOAD``), and what
they started in their process group is the next daemon's to sweep, as a
worker's is; a standby that becomes a worker is recorded again as that worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import importlib.util
import json
import logging
import os
import re
import secrets
import signal
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from elasticd.errors import WorkerSpawnError
from elasticd.security import Identity
from elasticd.supervise.cgroup import STANDBY_MARKER
from elasticd.supervise.env import ROUND_VARIABLES
from elasticd.supervise.records import WorkerRecord
from elasticd.supervise.spawn import SpawnPolicy, process_env, start_process
from elasticd.supervise.sweep import boot_id, process_start_time

if TYPE_CHECKING:
    from elasticd.supervise.cgroup import AttemptContainment
    from elasticd.supervise.process import WorkerLaunch

__all__ = [
    "PythonProgram",
    "StandbyInfo",
    "StandbyPool",
    "fill_wait",
    "handoff_failure",
    "mismatch",
    "python_program",
    "standby_env",
    "still_importing",
]

log = logging.getLogger(__name__)

#: How long a hand-off waits for the standby's answer before the worker starts cold.
HANDOFF_TIMEOUT = 5.0
#: A cold attempt's standbys, on a node without a spare CPU for each, wait this long for the
#: workers' own imports (IMPORT_MARGIN times the slowest standby import seen, plus
#: IMPORT_SLACK_S).
IMPORT_MARGIN = 1.5
IMPORT_SLACK_S = 1.0
#: Import times kept per pool (the newest).
IMPORT_SAMPLES = 8


#: A cold attempt's standbys start once its workers have all pinged their heartbeat (past
#: their imports), or at the latest this long after the workers started when no import
#: time was seen yet: before, they would take the CPU from the workers' own imports.
FIRST_FILL_AFTER_S = 5.0
#: With import times seen, the latest is as long as the slowest of them (IMPORT_MARGIN,
#: IMPORT_SLACK_S), never more than this.
MAX_FILL_AFTER_S = 30.0


def fill_wait(
    *,
    spare_cpus: int,
    wanted: int,
    warm: bool,
    pinged: bool,
    age: float,
    observed: Sequence[float],
) -> float:
    """How much longer an attempt's standbys wait before they start (pure; 0: now).

    ``spare_cpus``: the node's CPUs less the slots its running workers hold; ``wanted``:
    the standbys to start (one per local rank); ``warm``: every worker took over a standby
    (past its imports already); ``pinged``: every worker has pinged its heartbeat; ``age``:
    seconds since the workers started; ``observed``: how long this pool's standbys took to
    import. With a spare CPU for each, they start with the workers, ready for an early
    crash (issue 40). Without, a cold worker imports what its standby would: the standbys
    wait for the workers' imports, as long as one takes, not to take their CPU.
    """
    if warm or pinged or spare_cpus >= wanted:
        return 0.0
    bound = (
        min(max(observed) * IMPORT_MARGIN + IMPORT_SLACK_S, MAX_FILL_AFTER_S)
        if observed
        else FIRST_FILL_AFTER_S
    )
    return max(0.0, bound - age)


def still_importing(age: float, observed: Sequence[float]) -> str:
    """Why a rank whose standby was not ready at its start started cold (pure)."""
    seen = f"; imports here took {max(observed):.1f} s at most" if observed else ""
    return (
        f"its standby was still importing ({age:.1f} s after it started{seen}): "
        "the worker started cold at once rather than wait"
    )


#: The most of a standby's "ready" line that is read (it is the job's process that writes it).
MAX_READY_LINE = 64 << 10
#: Standbys that died after they were ready are replaced this many times an attempt.
MAX_REPLACEMENTS = 3

#: An interpreter by name: ``python``, ``python3``, ``python3.11``, a path to one.
_PYTHON = re.compile(r"python(\d+(\.\d+)?)?")
#: Interpreter options without a value, and those that take one (``-X dev``, ``-W error``).
_FLAGS = frozenset({"-b", "-bb", "-B", "-d", "-E", "-I", "-O", "-OO", "-P", "-q", "-R", "-s", "-S",
                    "-u", "-v", "-vv"})  # fmt: skip
_VALUED = frozenset({"-X", "-W"})


@dataclass(frozen=True)
class PythonProgram:
    """``<interpreter> <options> <target> <rest>``: a script or ``-m module``."""

    interpreter: str
    options: tuple[str, ...]
    kind: str
    """``script`` or ``module``."""
    target: str
    rest: tuple[str, ...]


def python_program(argv: Sequence[str]) -> PythonProgram | str:
    """The Python program ``argv`` runs, or why a standby cannot run it (pure)."""
    if not argv or not _PYTHON.fullmatch(os.path.basename(argv[0])):
        return f"the entrypoint {argv[0] if argv else ''!r} is not a Python interpreter"
    options: list[str] = []
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg == "-m" and i + 1 < len(argv):
            return PythonProgram(
                argv[0], tuple(options), "module", argv[i + 1], tuple(argv[i + 2 :])
            )
        if arg in _VALUED and i + 1 < len(argv):
            options += [arg, argv[i + 1]]
            i += 2
            continue
        if arg in _FLAGS:
            options.append(arg)
            i += 1
            continue
        if arg.startswith("-"):
            return f"the interpreter option {arg!r} is not one a standby runs"
        return PythonProgram(argv[0], tuple(options), "script", arg, tuple(argv[i + 1 :]))
    return "the interpreter runs no script or module"


def standby_env(env: Mapping[str, str]) -> dict[str, str]:
    """A worker's environment less what the next round changes (pure)."""
    return {k: v for k, v in env.items() if k not in ROUND_VARIABLES}


def _ids(identity: Identity | None) -> tuple[int, int, tuple[int, ...]] | None:
    return None if identity is None else (identity.uid, identity.gid, identity.groups)


def handoff_failure(pid: int, exc: BaseException, timeout: float) -> str:
    """Why the hand-off to the standby ``pid`` failed, never without its cause (pure).

    The bound's ``TimeoutError`` has an empty ``str``, and an exception object is always
    true, so ``exc or type(exc).__name__`` named nothing (issue 34, defect 6)."""
    if isinstance(exc, TimeoutError):
        cause = f"timed out after {timeout:g} s (the standby does not answer: stopped or stuck)"
    else:
        cause = str(exc).strip() or type(exc).__name__
    return f"the hand-off to its standby (pid {pid}) failed: {cause}"


def mismatch(
    made_for: WorkerLaunch,
    made_as: Identity | None,
    launch: WorkerLaunch,
    identity: Identity | None,
) -> str | None:
    """Why a standby made for ``made_for`` cannot become ``launch``'s worker (None: it can)."""
    if list(made_for.argv) != list(launch.argv):
        return "the job's command changed"
    if made_for.cwd != launch.cwd:
        return "the job's working folder changed"
    if _ids(made_as) != _ids(identity):
        return "the job's user changed"
    if made_for.umask != launch.umask:
        return "the job's umask changed"
    before, now = standby_env(made_for.env), standby_env(launch.env)
    if before != now:
        names = sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k))
        return f"the job's environment changed ({', '.join(names[:5])})"
    return None


class _State(enum.Enum):
    STARTING = "starting"
    """Importing its modules."""
    READY = "ready"
    """Past its imports, blocked on its socket."""
    GONE = "gone"
    """Handed off, discarded or dead."""


@dataclass(frozen=True)
class StandbyInfo:
    """What ``/workers`` shows of a standby."""

    local_rank: int
    pid: int
    state: str
    rss_bytes: int | None


@dataclass(eq=False)
class _Standby:
    launch: WorkerLaunch
    identity: Identity | None
    program: PythonProgram
    process: asyncio.subprocess.Process
    control: socket.socket
    given: dict[str, str]
    """The environment it was started with (after :func:`process_env`)."""
    containment: AttemptContainment | None
    """Its own cgroup (or the subreaper's bookkeeping): it and all it starts, until the
    hand-off moves them into the attempt's, or its end kills them."""
    state: _State = _State.STARTING
    watch: asyncio.Task[None] | None = None
    record: tuple[int, int] | None = None
    """(pid, start time) in the spawn registry, until it is forgotten or handed off."""
    started_at: float = field(default_factory=lambda: asyncio.get_running_loop().time())
    """When it was started (the loop's clock): its age, for :func:`still_importing`."""

    @property
    def pid(self) -> int:
        return self.process.pid

    def info(self) -> StandbyInfo:
        return StandbyInfo(self.launch.local_rank, self.pid, self.state.value, rss_of(self.pid))


def rss_of(pid: int) -> int | None:
    """The resident memory of ``pid`` in bytes (``/proc/<pid>/status``), None if gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return None


def _bootstrap() -> str:
    """The ``-c`` text: :mod:`elasticd.standby_main`'s source, run in a namespace of its own."""
    spec = importlib.util.find_spec("elasticd.standby_main")
    assert spec is not None
    assert spec.origin is not None
    source = Path(spec.origin).read_text(encoding="utf-8")
    return (
        f"exec(compile({source!r},'<elasticd-standby>','exec'),"
        "{'__name__':'elasticd_standby','__builtins__':__builtins__})"
    )


class StandbyPool:
    """One job's standbys on this node (see the module). Close with :meth:`aclose`."""

    def __init__(
        self,
        job_id: str,
        modules: Sequence[str],
        policy: SpawnPolicy,
        *,
        on_lost: Callable[[int, str], None] | None = None,
        on_ready: Callable[[], None] | None = None,
    ) -> None:
        self.job_id = job_id
        self.modules = list(modules)
        self.policy = policy
        self._on_lost = on_lost
        self._on_ready = on_ready
        self._standbys: dict[int, _Standby] = {}
        self._closed = False
        self._filling: asyncio.Lock = asyncio.Lock()
        self._made_for: dict[int, tuple[WorkerLaunch, Identity | None]] = {}
        self._replacements = 0
        self._replacing: set[asyncio.Task[None]] = set()
        #: The ends of standbys dropped at a hand-off (:meth:`_drop`), until done.
        self._ending: set[asyncio.Task[None]] = set()
        #: Why a local rank has no standby (it was lost), until a new one starts.
        self._why_none: dict[int, str] = {}
        #: How long this pool's standbys took to become ready (the newest), for fill_wait.
        self._import_s: list[float] = []
        #: Why each local rank of the last start started cold.
        self.cold: dict[int, str] = {}
        #: Whether a standby was ever started (a node's first attempt has none).
        self.filled = False
        self._bootstrap = _bootstrap()

    @property
    def import_times(self) -> list[float]:
        """How long this pool's standbys took to import (the newest), seconds."""
        return list(self._import_s)

    def infos(self) -> list[StandbyInfo]:
        """The live standbys, by local rank, with their memory."""
        return [s.info() for _, s in sorted(self._standbys.items()) if s.state is not _State.GONE]

    async def fill(self, launches: Sequence[WorkerLaunch], identity: Identity | None) -> None:
        """One standby per launch that has none, made for that launch (in the background)."""
        async with self._filling:
            self._replacements = 0
            for launch in launches:
                self._made_for[launch.local_rank] = (launch, identity)
            for launch in launches:
                if self._closed:
                    return
                current = self._standbys.get(launch.local_rank)
                if current is not None and current.state is not _State.GONE:
                    if mismatch(current.launch, current.identity, launch, identity) is None:
                        continue
                    await self._discard(current)
                await self._start(launch, identity)

    async def _start(self, launch: WorkerLaunch, identity: Identity | None) -> None:
        program = python_program(launch.argv)
        if isinstance(program, str):
            return  # the start says why, as a cold start's reason
        self.filled = True
        containment = None
        # Names what this standby starts before its hand-off (it leaves the program's
        # os.environ there: ``given`` holds it): under the subreaper, the strays its
        # release may kill are these, never the running attempt's.
        marker = secrets.token_hex(8)
        if self.policy.containment is not None:
            # One cgroup per standby: at the hand-off all of it goes into the attempt's.
            try:
                containment = self.policy.containment.open_attempt(
                    self.job_id, None, None, marker=marker
                )
            except OSError as exc:  # the worker starts cold ("no standby for it")
                log.warning("job %s: no cgroup for a standby: %s", self.job_id, exc)
                return
        spec = json.dumps({"modules": self.modules, "kind": program.kind, "target": program.target})
        argv = [program.interpreter, *program.options, "-c", self._bootstrap, spec]
        env = {**standby_env(launch.env), STANDBY_MARKER: marker}
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        null = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
        try:
            process = await start_process(
                argv,
                env,
                identity=identity,
                cwd=launch.cwd,
                stdout=null,
                stderr=null,
                policy=self.policy,
                cgroup_procs=containment.procs_fd if containment else None,
                stdin=child.fileno(),
                umask=launch.umask,
            )
        except WorkerSpawnError as exc:
            parent.close()
            if containment is not None:
                await containment.stop(())
            log.warning(
                "job %s: no standby for local rank %d: %s", self.job_id, launch.local_rank, exc
            )
            return
        except BaseException:  # cancelled (the job ended): start_process left no process
            parent.close()
            if containment is not None:
                await asyncio.shield(containment.stop(()))
            raise
        finally:
            child.close()
            os.close(null)
        parent.setblocking(False)
        standby = _Standby(
            launch, identity, program, process, parent, process_env(env, identity), containment
        )
        self._record(standby)
        self._standbys[launch.local_rank] = standby
        self._why_none.pop(launch.local_rank, None)
        standby.watch = asyncio.get_running_loop().create_task(
            self._watch(standby), name=f"elasticd-standby-{launch.local_rank}"
        )
        log.info(
            "job %s: standby for local rank %d: pid %d", self.job_id, launch.local_rank, process.pid
        )

    def _record(self, standby: _Standby) -> None:
        """Into the spawn registry, for the next daemon's sweep after a kill -9."""
        registry = self.policy.registry
        start_time = process_start_time(standby.pid)
        if registry is None or start_time is None:
            return
        try:
            registry.record_worker(
                WorkerRecord(
                    pid=standby.pid,
                    start_time=start_time,
                    boot_id=boot_id(),
                    job_id=self.job_id,
                    attempt=None,
                    local_rank=standby.launch.local_rank,
                )
            )
            standby.record = (standby.pid, start_time)
        except Exception:  # a safety net; never fail over it
            log.exception("cannot record standby pid %d for the orphan sweep", standby.pid)

    def _forget(self, standby: _Standby) -> None:
        """Out of the registry: its process group is gone (killed, or it died)."""
        record, standby.record = standby.record, None
        if record is None or self.policy.registry is None:
            return
        try:
            self.policy.registry.forget_workers([record])
        except Exception:
            log.exception("cannot forget standby pid %d", standby.pid)

    async def _watch(self, standby: _Standby) -> None:
        """Its ready line, then its end; a ready one that dies unhanded is replaced."""
        loop = asyncio.get_running_loop()
        line = b""
        with contextlib.suppress(OSError):
            # Written by the job's process (its LD_PRELOAD could write anything): bounded.
            while not line.endswith(b"\n") and len(line) < MAX_READY_LINE:
                chunk = await loop.sock_recv(standby.control, 4096)
                if not chunk:
                    break
                line += chunk
        if standby.state is _State.GONE:
            return  # dropped while importing (its end is :meth:`_kill`'s): not lost
        reason: str | None
        try:
            answer = json.loads(line) if line.endswith(b"\n") else None
        except ValueError:
            answer = None
        if isinstance(answer, dict) and answer.get("ready") is True:
            standby.state = _State.READY
            reason = None
            self._import_s = [*self._import_s, loop.time() - standby.started_at][-IMPORT_SAMPLES:]
        elif isinstance(answer, dict):
            reason = f"its imports failed ({str(answer.get('error'))[:300]})"
        else:
            reason = "it exited before it was ready"
        if reason is None and self._on_ready is not None:
            self._on_ready()
        if reason is not None:
            await self._discard(standby)
            self._lost(standby, reason, replace=False)
            return
        code = await standby.process.wait()
        if standby.state is _State.GONE:
            return  # handed off or discarded: not ours any more
        standby.state = _State.GONE
        standby.control.close()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(standby.pid, signal.SIGKILL)  # what it started in its group goes too
        await self._release(standby)  # and what it started anywhere else
        self._forget(standby)
        how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
        self._lost(standby, f"it died ({how})", replace=True)

    def _lost(self, standby: _Standby, reason: str, *, replace: bool) -> None:
        rank = standby.launch.local_rank
        if self._standbys.get(rank) is standby:
            del self._standbys[rank]
        self._why_none[rank] = f"its standby (pid {standby.pid}) was lost: {reason}"
        if self._on_lost is not None:
            self._on_lost(rank, reason)
        if replace and not self._closed and self._replacements < MAX_REPLACEMENTS:
            self._replacements += 1
            made = self._made_for.get(rank)
            if made is not None:
                task = asyncio.get_running_loop().create_task(
                    self._replace(*made), name=f"elasticd-standby-{rank}-replace"
                )
                self._replacing.add(task)
                task.add_done_callback(self._replacing.discard)

    async def _replace(self, launch: WorkerLaunch, identity: Identity | None) -> None:
        async with self._filling:
            if not self._closed and launch.local_rank not in self._standbys:
                await self._start(launch, identity)

    async def hand_off(
        self,
        launch: WorkerLaunch,
        identity: Identity | None,
        *,
        stdout: int,
        stderr: int,
        stdin: int | None,
        containment: AttemptContainment | None,
    ) -> asyncio.subprocess.Process | None:
        """``launch``'s worker from its standby, or None (start it cold: :attr:`cold` says why)."""
        rank = launch.local_rank
        program = python_program(launch.argv)
        if isinstance(program, str):
            self.cold[rank] = program
            return None
        standby = self._standbys.get(rank)
        if standby is None or standby.state is _State.GONE:
            self.cold[rank] = self._why_none.get(rank, "no standby for it")
            return None
        reason = mismatch(standby.launch, standby.identity, launch, identity)
        if reason is None and standby.state is _State.STARTING:
            # Never waited for (issue 40): the cold start begins now, and the standby's end
            # (its kill, reap and cgroup) follows in the background, not before it.
            age = asyncio.get_running_loop().time() - standby.started_at
            self.cold[rank] = still_importing(age, self._import_s)
            self._drop(standby)
            return None
        if reason is not None:
            self.cold[rank] = reason
            await self._discard(standby)
            return None
        standby.state = _State.GONE  # HANDED OFF: the watch lets go of it
        del self._standbys[rank]
        handed = standby.record
        standby.record = None  # the worker's own record replaces it (same pid, start time)
        try:
            # All of it bounded: a standby that stops reading (stopped, or the job's code
            # in it) must not hold the start, however large the environment sent to it.
            async with asyncio.timeout(HANDOFF_TIMEOUT):
                if standby.containment is not None and containment is not None:
                    # It and everything its imports started (their own sessions too) now
                    # live and die with the attempt, as a cold worker's would.
                    standby.containment.hand_over(containment)
                elif containment is not None and containment.procs_fd is not None:
                    os.write(containment.procs_fd, str(standby.pid).encode())
                await self._send(
                    standby,
                    launch,
                    identity,
                    [stdout, stderr, *([stdin] if stdin is not None else [])],
                )
        except (OSError, TimeoutError, ValueError) as exc:
            standby.record = handed
            self.cold[rank] = handoff_failure(standby.pid, exc, HANDOFF_TIMEOUT)
            await self._kill(standby)
            return None
        except BaseException:
            # Cancelled (the start, the job): it is no longer the pool's, so aclose() would
            # not find it; it may even run the program already. It goes with the start.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(standby.pid, signal.SIGKILL)
            standby.control.close()
            standby.record = handed
            await self._kill(standby)
            raise
        self.cold.pop(rank, None)
        return standby.process

    async def _send(
        self, standby: _Standby, launch: WorkerLaunch, identity: Identity | None, fds: list[int]
    ) -> None:
        loop = asyncio.get_running_loop()
        data = json.dumps(
            {
                "env": process_env(launch.env, identity),
                "given": standby.given,
                "args": [str(a) for a in launch.argv[1:]],
                "rest": list(standby.program.rest),  # the same argv: mismatch() said so
            }
        ).encode()
        control = standby.control
        # The first bytes carry the descriptors (a short write into an empty socket buffer).
        socket.send_fds(control, [str(len(data)).encode() + b"\n"], fds)
        await loop.sock_sendall(control, data)
        answer = await loop.sock_recv(control, 1)
        control.close()
        if answer != b"1":
            raise OSError("the standby ended before it took the worker's place")

    def _drop(self, standby: _Standby) -> None:
        """:meth:`_discard` without waiting: out of the pool and killed now, reaped (and its
        cgroup removed) by a task :meth:`aclose` awaits."""
        standby.state = _State.GONE
        if self._standbys.get(standby.launch.local_rank) is standby:
            del self._standbys[standby.launch.local_rank]
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(standby.pid, signal.SIGKILL)
        task = asyncio.get_running_loop().create_task(
            self._kill(standby), name=f"elasticd-standby-{standby.launch.local_rank}-end"
        )
        self._ending.add(task)
        task.add_done_callback(self._ending.discard)

    async def _discard(self, standby: _Standby) -> None:
        standby.state = _State.GONE
        if self._standbys.get(standby.launch.local_rank) is standby:
            del self._standbys[standby.launch.local_rank]
        await self._kill(standby)

    async def _kill(self, standby: _Standby) -> None:
        watch = standby.watch
        if watch is not None and watch is not asyncio.current_task() and not watch.done():
            watch.cancel()  # before the socket closes under its read
            with contextlib.suppress(asyncio.CancelledError):
                await watch
        standby.control.close()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(standby.pid, signal.SIGKILL)
        await asyncio.shield(standby.process.wait())
        await self._release(standby)
        self._forget(standby)

    @staticmethod
    async def _release(standby: _Standby) -> None:
        """Kill what is left in its cgroup (what its imports started outside its process
        group) and remove the folder; under the subreaper, what of its is orphaned."""
        if standby.containment is not None:
            with contextlib.suppress(OSError):
                await asyncio.shield(standby.containment.stop(()))

    async def aclose(self) -> None:
        """Kill every standby and await its end (a cancel or the job's end leaves none)."""
        self._closed = True
        for task in list(self._replacing):
            task.cancel()
        async with self._filling:
            standbys = list(self._standbys.values())
            for standby in standbys:
                await self._discard(standby)
        if self._ending:  # never cancelled: each ends what it was given
            await asyncio.shield(asyncio.gather(*self._ending, return_exceptions=True))
