"""Worker processes carried across the daemon's re-exec (issue 25): hand-over and re-adoption.

The daemon re-executes itself in place (:mod:`elasticd.node.reexec`): the
same pid, so its workers stay its children, no parent-death signal fires,
and nothing is signalled. What the new program image needs of each worker
crosses the ``exec`` as descriptors whose ``FD_CLOEXEC`` is cleared (the read
ends of the two output pipes, the log files they are copied into, the
heartbeat file) and as a small JSON record, :class:`HandedWorker`, in the
hand-over manifest. Never pickle: the new image may be another version.

Nothing may reap a worker between the images. The daemon waits for its
children with :class:`LoopChildWatcher`, which reaps on the event loop's
own thread (never a thread blocked in ``waitpid``, whose reaped status an
``exec`` would lose): :func:`use_loop_child_watcher`. The old image execs from
the loop thread once no exit is half-delivered (:func:`unreported_exit`),
so a worker that exits around the exec is either reported in the manifest
with its status (``returncode``) or still a zombie that the new image
reaps itself, by pidfd (:class:`AdoptedProcess`): its real code or signal
is recorded either way.

The new image checks each worker before it takes it up
(:func:`check_worker`): still this daemon's child, the same start time (a
pid is not an identity), in the attempt's cgroup when there is one; its
pipes and files are what they were. A worker that fails a check is not
adopted (the caller resumes its job as a new attempt).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import stat
import sys
import warnings
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from elasticd.supervise.sweep import process_start_time, start_time_of

__all__ = [
    "AdoptedProcess",
    "HandedPipe",
    "HandedWorker",
    "adopted_children",
    "check_worker",
    "close_fds",
    "end_handed",
    "end_inherited",
    "inherited_to_end",
    "inheritable_dup",
    "unreported_exit",
    "use_loop_child_watcher",
    "zombie_status",
]

#: Adopted workers this image has not reaped yet: the subreaper's zombie sweep leaves them.
_adopted: set[int] = set()


def adopted_children() -> set[int]:
    """Pids of inherited workers this image awaits (not to be reaped by anyone else)."""
    return set(_adopted)


def use_loop_child_watcher() -> bool:
    """Have asyncio reap children on the event loop's thread (:class:`LoopChildWatcher`),
    never in a thread.

    On 3.11 the default watcher blocks a thread per child in ``waitpid``: a
    child reaped there just before an ``exec`` would lose its status. Python
    3.12+ reaps on the loop by pidfd where it works. Returns False where pidfds
    are not available (the new image awaits its adopted workers by pidfd; re-exec
    then refuses: :mod:`elasticd.node.reexec`).
    """
    if not hasattr(os, "pidfd_open"):
        return False
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError:
        return False
    if sys.version_info >= (3, 12):
        return True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        watcher = LoopChildWatcher()
        watcher.attach_loop(asyncio.get_running_loop())
        asyncio.set_child_watcher(watcher)
    return True


#: How often a child is polled (``waitpid(pid, WNOHANG)``) when no pidfd could be opened.
POLL_S = 0.1

#: ``pidfd_open`` failed for want of a descriptor or memory: the node's trouble, not the child's.
_NO_RESOURCE = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM})


def pidfd_or_none(pid: int) -> int | None:
    """``pidfd_open(pid)``, or None when the daemon is out of descriptors (a connection
    flood at the fd limit): the caller polls instead, on the loop's thread."""
    try:
        return os.pidfd_open(pid)
    except OSError as exc:
        if exc.errno in _NO_RESOURCE:
            return None
        raise


class LoopChildWatcher(asyncio.SafeChildWatcher):
    """Reaps the daemon's children on the event loop's thread, with no descriptor per child.

    On ``SIGCHLD`` (delivered on the loop's thread) it polls each child it was
    given with ``waitpid(pid, WNOHANG)``: never ``-1``, never in a thread, so
    nothing is reaped behind the re-exec's back (above). asyncio's pidfd
    watcher, used first, held one descriptor per child: under a connection
    flood at the fd limit those were the ones the daemon lacked, and a spawn
    whose ``pidfd_open`` failed never finished. O(children) per signal is cheap
    at a node's scale (workers and their helpers, not thousands).
    """


def unreported_exit(pid: int, returncode: int | None) -> bool:
    """A child reaped by the loop whose exit asyncio has not delivered yet (still queued).

    ``returncode`` is what asyncio's process knows. The old image runs the loop
    until this is False for every worker, then execs without awaiting again.
    """
    if returncode is not None:
        return False
    try:
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True  # reaped, its status in a callback not yet run
    return False


def zombie_status(pid: int) -> int | None:
    """The status of a child that exited and is not reaped yet, as asyncio's ``returncode``
    says it (negative: the signal); None while it runs (or when it is not a child of ours).
    Looked at only (``WNOWAIT``): whoever reaps it later still gets it."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return None
    if info is None or info.si_pid == 0:
        return None
    if info.si_code == os.CLD_EXITED:
        return info.si_status
    return -info.si_status


def inheritable_dup(fd: int) -> int:
    """A copy of ``fd`` that survives ``exec`` (``FD_CLOEXEC`` cleared on the copy only)."""
    copy = os.dup(fd)
    os.set_inheritable(copy, True)
    return copy


@dataclass(frozen=True)
class HandedPipe:
    """One output stream across the exec: the pipe's read end and the log file's descriptor."""

    read_fd: int
    file_fd: int
    offered: int
    """Bytes already handed to the file (the attempt's ``log_limit_bytes`` counts them)."""
    at_eof: bool = False
    """The pipe had reached its end (every byte is in the file, both closed): nothing
    crosses the exec, and ``read_fd`` and ``file_fd`` are -1 (a worker that exited)."""

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> HandedPipe:
        return cls(
            read_fd=int(doc["read_fd"]),
            file_fd=int(doc["file_fd"]),
            offered=int(doc["offered"]),
            at_eof=bool(doc.get("at_eof", False)),
        )

    @property
    def fds(self) -> list[int]:
        return [] if self.at_eof else [self.read_fd, self.file_fd]


@dataclass(frozen=True)
class HandedWorker:
    """What the new image needs of one running worker (JSON in the manifest)."""

    local_rank: int
    pid: int
    start_time: int
    """Clock ticks since boot (``/proc/<pid>/stat``): with the pid, the worker's identity."""
    started_at: float
    """Wall time the worker was spawned (the group view's ``started_at``)."""
    stdout: HandedPipe
    stderr: HandedPipe
    heartbeat_fd: int | None
    beat_started: float | None
    """Monotonic time its heartbeat clock started (``CLOCK_MONOTONIC`` survives exec)."""
    returncode: int | None = None
    """The old image reaped it (asyncio's convention: ``-signal`` when killed); the new
    image records it as the exit."""
    reported_at: float | None = None
    """When the old image recorded the exit and reported it (``worker.exited``): the new
    image counts it and never reports it again (None: not reported)."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> HandedWorker:
        return cls(
            local_rank=int(doc["local_rank"]),
            pid=int(doc["pid"]),
            start_time=int(doc["start_time"]),
            started_at=float(doc["started_at"]),
            stdout=HandedPipe.from_json(doc["stdout"]),
            stderr=HandedPipe.from_json(doc["stderr"]),
            heartbeat_fd=None if doc.get("heartbeat_fd") is None else int(doc["heartbeat_fd"]),
            beat_started=None if doc.get("beat_started") is None else float(doc["beat_started"]),
            returncode=None if doc.get("returncode") is None else int(doc["returncode"]),
            reported_at=None if doc.get("reported_at") is None else float(doc["reported_at"]),
        )

    @property
    def fds(self) -> list[int]:
        out = self.stdout.fds + self.stderr.fds
        return out + ([self.heartbeat_fd] if self.heartbeat_fd is not None else [])


def check_worker(worker: HandedWorker, cgroup: Path | None) -> str | None:
    """Why ``worker`` cannot be taken up by this image (None: it can).

    It must still be this process's child (alive, or a zombie of ours that
    exited during the exec), with the recorded start time, in the attempt's
    cgroup when it has one; its pipes must be pipes and its log files regular
    files. A worker the old image already reaped (``returncode``) is only
    checked for its descriptors.
    """
    for pipe, fd, kind, what in (
        (worker.stdout, worker.stdout.read_fd, stat.S_ISFIFO, "stdout pipe"),
        (worker.stderr, worker.stderr.read_fd, stat.S_ISFIFO, "stderr pipe"),
        (worker.stdout, worker.stdout.file_fd, stat.S_ISREG, "stdout log file"),
        (worker.stderr, worker.stderr.file_fd, stat.S_ISREG, "stderr log file"),
    ):
        if pipe.at_eof:
            continue  # at its end before the exec: nothing of it crossed
        try:
            if not kind(os.fstat(fd).st_mode):
                return f"its {what} (fd {fd}) is not what was handed over"
        except OSError:
            return f"its {what} (fd {fd}) was lost in the exec"
    if worker.returncode is not None:
        return None
    try:
        zombie = os.waitid(os.P_PID, worker.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return f"pid {worker.pid} is no longer a child of the daemon"
    if zombie is None:  # alive: the same process, in its attempt's cgroup
        if process_start_time(worker.pid) != worker.start_time:
            return f"pid {worker.pid} is another process now (its start time differs)"
        if cgroup is not None and not _in_cgroup(worker.pid, cgroup):
            return f"pid {worker.pid} left its attempt's cgroup"
    return None


def _in_cgroup(pid: int, cgroup: Path) -> bool:
    try:
        text = Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return True  # gone meanwhile: its exit is awaited like any
    return any(
        line.startswith("0::") and str(cgroup).endswith(line[3:].strip())
        for line in text.splitlines()
    )


class AdoptedProcess:
    """A child this image did not spawn (it came through the exec), awaited by pidfd.

    Duck-types what :class:`~elasticd.supervise.process.WorkerGroupProcesses`
    uses of ``asyncio.subprocess.Process``: ``pid``, ``returncode``, ``wait()``.
    It reaps the child itself, on the loop's thread, with ``waitpid(pid)``:
    only its own pid, never ``-1``.
    """

    def __init__(self, pid: int, returncode: int | None = None, *, worker: bool = True) -> None:
        """``worker``: a handed-over worker, which no one else may reap or kill (the
        containment's strays and the zombie sweep leave it); False: an inherited child
        that is only reaped here, and stays a stray of its job for the containment."""
        self.pid = pid
        self.returncode = returncode
        if returncode is None and worker:
            _adopted.add(pid)

    async def wait(self) -> int:
        while self.returncode is None:
            loop = asyncio.get_running_loop()
            try:
                pidfd = pidfd_or_none(self.pid)
            except ProcessLookupError:
                self._reap()  # a zombie: waitpid below has it
                continue
            if pidfd is None:  # out of descriptors: poll
                if not self._reap():
                    await asyncio.sleep(POLL_S)
                continue
            ready: asyncio.Future[None] = loop.create_future()
            loop.add_reader(pidfd, _settle, ready)
            try:
                if not self._reap():
                    await ready
                    self._reap()
            finally:
                loop.remove_reader(pidfd)
                os.close(pidfd)
        return self.returncode

    def _reap(self) -> bool:
        """``waitpid(pid, WNOHANG)``: True once the exit is known."""
        try:
            done, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            # Reaped by someone else: the status is lost; say so as a failure.
            done, status = self.pid, 255 << 8
        if done == 0:
            return False
        self.returncode = os.waitstatus_to_exitcode(status)
        _adopted.discard(self.pid)
        return True


async def end_handed(workers: list[HandedWorker]) -> None:
    """End handed-over workers nobody takes up: SIGKILL to each one's process group (only
    while it is still the same process), then reap it; their descriptors are closed."""
    for worker in workers:
        if worker.returncode is None and process_start_time(worker.pid) == worker.start_time:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(worker.pid, signal.SIGKILL)
        close_fds(worker.fds)
    ours = []
    for worker in workers:
        if worker.returncode is not None:
            continue
        with contextlib.suppress(ChildProcessError):
            os.waitid(os.P_PID, worker.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)  # noqa: ASYNC222
            ours.append(AdoptedProcess(worker.pid))
    await asyncio.gather(*(child.wait() for child in ours))


def inherited_to_end(
    children: Mapping[int, int | None],
    handed: Collection[tuple[int, int]],
    unhanded: Collection[tuple[int, int]],
) -> tuple[set[int], set[int]]:
    """Which of the children a new image found at its start it ends: ``(kill, reap)``.

    ``children``: each child's pid and start time (None: unreadable), read before the new
    image started anything. ``handed``: the (pid, start time) of the workers it takes up;
    their exits are the adopting group's to reap, with their real code. Every other child
    is the old image's and nobody else waits for it (a health check, a stack dump, a
    swept worker): reaped, once it exits. ``unhanded``: what the old image started and did
    not hand over (nobody will read its result): killed first.
    """
    reap = {pid for pid, start in children.items() if start is None or (pid, start) not in handed}
    kill = {pid for pid in reap if (pid, children[pid]) in set(unhanded)}
    return kill, reap


async def end_inherited(
    kill: Collection[int], reap: Collection[int], started: Mapping[int, int | None]
) -> None:
    """SIGKILL each of ``kill`` (its process group when it leads one) while it is still
    the process of its start time in ``started``, then reap each of ``reap`` as it exits,
    on the loop (pidfd). Only this process's children; the subreaper's zombie sweep may
    reap one first (its pid may then be reused): hence the start-time check before the
    kill, and the wait never signals. They stay strays of their job (not "adopted"):
    an attempt's containment still kills the ones its job left."""
    for pid in kill:
        if started.get(pid) is None or start_time_of(pid) != started[pid]:
            continue  # gone, or no longer the process the old image started
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
    await asyncio.gather(*(AdoptedProcess(pid, worker=False).wait() for pid in reap))


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def close_fds(fds: list[int]) -> None:
    """Close handed-over descriptors nobody took up (a worker that was not adopted)."""
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
