"""How a worker process is started so that it never outlives the daemon, and who it runs as.

Parent-death signal
    Every worker is exec'd through a tiny wrapper that asks the kernel for
    ``SIGKILL`` the moment its parent dies (``prctl(PR_SET_PDEATHSIG)``) and
    then execs the worker itself, which keeps the pid, the process group and
    the signal. The wrapper is util-linux ``setpriv --pdeathsig KILL --``
    (a C program: no start-up cost worth measuring); where ``setpriv`` is
    missing or too old, ``python -I -S -c`` with ``ctypes`` does the same
    and also closes the race ``setpriv`` leaves open (the daemon dying
    between fork and prctl) by checking its parent afterwards.
    ``preexec_fn`` is not used: it is unsafe in a process with threads.

    The signal is tied to the *thread* that forked, not the process: asyncio
    forks on the event loop's thread, which in the daemon is the main thread
    and lives as long as the daemon. A loop run in another thread would take
    its workers with it when that thread ends, which is when the loop ends.

Who the worker runs as
    When the job runs as another user (:mod:`elasticd.security`),
    ``subprocess`` switches groups, gid and uid in the child between fork and
    exec, in C, and the wrapper then runs as that user: the kernel clears
    the parent-death signal on a credential change, so it must be set after
    it, and the job's environment (``LD_PRELOAD`` and friends) is never seen
    by a process with more privilege than the job itself.

The start-up sweep
    The signal does not reach the worker's own children, a set-uid program
    clears it, and a daemon can die between fork and prctl. So every spawn
    is also recorded in the daemon's SQLite (pid, process start time, boot,
    job, attempt) and forgotten when the group is stopped; on start,
    :func:`sweep_orphans` kills the process group of every recorded worker
    that is still alive with the same start time, and the leftovers of a
    recorded group whose leader is gone. Under systemd (``KillMode=mixed``)
    the unit's cgroup is a further net.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from elasticd.security import Identity, JobUsers

log = logging.getLogger(__name__)

__all__ = [
    "SpawnPolicy",
    "WorkerRecord",
    "WorkerRegistry",
    "boot_id",
    "current_policy",
    "install_policy",
    "process_start_time",
    "sweep_orphans",
    "wrap_argv",
]

#: The fallback wrapper: argv is ``ppid executable argv0 args...``. Set the
#: parent-death signal, make sure the parent did not die before that, exec.
PY_WRAPPER = (
    "import ctypes,os,sys\n"
    "if ctypes.CDLL(None,use_errno=True).prctl(1,9,0,0,0)!=0:\n"
    " sys.exit('elasticd: prctl(PR_SET_PDEATHSIG) failed')\n"
    "if os.getppid()!=int(sys.argv[1]):os.kill(os.getpid(),9)\n"
    "try:os.execv(sys.argv[2],sys.argv[3:])\n"
    "except OSError as e:sys.exit(f'elasticd: cannot start {sys.argv[2]!r}: {e}')\n"
)


@functools.cache
def find_setpriv() -> str | None:
    """``setpriv`` if it is installed and knows ``--pdeathsig`` (util-linux 2.33 or later)."""
    exe = shutil.which("setpriv", path=os.defpath + ":/usr/bin:/bin")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, "--help"], capture_output=True, text=True, timeout=5, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return exe if "--pdeathsig" in out else None


def wrap_argv(executable: str, argv: Sequence[str], *, setpriv: str | None) -> list[str]:
    """The command line that runs ``argv`` (program ``executable``) under the parent-death signal.

    With ``setpriv`` the worker's ``argv[0]`` becomes ``executable`` (the path
    it was resolved to); the Python fallback keeps ``argv[0]`` as given.
    """
    if setpriv is not None:
        return [setpriv, "--pdeathsig", "KILL", "--", executable, *argv[1:]]
    return [
        sys.executable,
        "-I",
        "-S",
        "-c",
        PY_WRAPPER,
        str(os.getpid()),
        executable,
        *argv,
    ]


# -- the registry of spawned workers -----------------------------------------------


@dataclass(frozen=True)
class WorkerRecord:
    """One spawned worker as the daemon's database remembers it."""

    pid: int
    start_time: int
    """Field 22 of ``/proc/<pid>/stat``: when the process started, in clock ticks since boot."""
    boot_id: str
    job_id: str
    attempt: int | None
    local_rank: int


class WorkerRegistry(Protocol):
    """Where spawned workers are recorded (the daemon's :class:`elasticd.db.Database`)."""

    def record_worker(self, record: WorkerRecord) -> None: ...

    def forget_workers(self, pids: Sequence[tuple[int, int]]) -> None: ...

    def recorded_workers(self) -> list[WorkerRecord]: ...


@dataclass(frozen=True)
class SpawnPolicy:
    """What the daemon decides about every worker spawn on this node."""

    users: JobUsers | None = None
    """Who jobs run as; None: as the daemon itself, whatever they ask."""
    registry: WorkerRegistry | None = None
    """Records every spawn for the start-up sweep; None: nothing recorded."""
    setpriv: str | None | bool = True
    """True: ``setpriv`` when usable, else the Python wrapper; a path; False: always Python."""

    def wrapper(self) -> str | None:
        if self.setpriv is True:
            return find_setpriv()
        if self.setpriv is False:
            return None
        return self.setpriv

    def identity_for(self, requested: str | None) -> Identity | None:
        if self.users is None:
            if requested is not None and requested != _my_name():
                from elasticd.errors import WorkerSpawnError

                raise WorkerSpawnError(
                    f"the job asks to run as {requested!r}; this daemon runs jobs as itself"
                )
            return None
        return self.users.for_job(requested)


def _my_name() -> str:
    import pwd

    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return str(os.geteuid())


_policies: list[SpawnPolicy] = []
_DEFAULT = SpawnPolicy()


def current_policy() -> SpawnPolicy:
    """The policy of the most recently started daemon in this process (the default without one)."""
    return _policies[-1] if _policies else _DEFAULT


def install_policy(policy: SpawnPolicy) -> Callable[[], None]:
    """Make ``policy`` apply to every worker spawned from now on; returns the undo.

    Process-wide on purpose: the daemon is the only spawner of workers in its
    process, and the agents that ask for spawns need not carry it.
    """
    _policies.append(policy)

    def uninstall() -> None:
        with contextlib.suppress(ValueError):
            _policies.remove(policy)

    return uninstall


# -- /proc -------------------------------------------------------------------------


@functools.cache
def boot_id() -> str:
    """This boot's id: a recorded pid from before a reboot names nobody now."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:  # pragma: no cover - not Linux
        return ""


@dataclass(frozen=True)
class _Stat:
    pid: int
    state: str
    pgrp: int
    session: int
    start_time: int


def _read_stat(pid: int | str) -> _Stat | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    head, _, rest = text.rpartition(")")
    fields = rest.split()
    try:
        return _Stat(
            pid=int(head.split(" ", 1)[0]),
            state=fields[0],
            pgrp=int(fields[2]),
            session=int(fields[3]),
            start_time=int(fields[19]),
        )
    except (IndexError, ValueError):
        return None


def process_start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot), or None if it is gone or a zombie."""
    st = _read_stat(pid)
    if st is None or st.state in ("Z", "X"):
        return None
    return st.start_time


def _all_stats() -> Iterator[_Stat]:
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            st = _read_stat(entry.name)
            if st is not None and st.state not in ("Z", "X"):
                yield st


# -- the sweep ---------------------------------------------------------------------


@dataclass(frozen=True)
class Orphan:
    """A recorded worker (or what is left of its process group) that the sweep killed."""

    record: WorkerRecord
    pids: tuple[int, ...]
    """Every process killed: the worker and the members of its process group."""
    leader_alive: bool


def sweep_orphans(registry: WorkerRegistry) -> list[Orphan]:
    """Kill what is left of every worker a previous run of the daemon recorded; forget them all.

    A recorded worker is ours if a process with its pid and its start time
    (same boot) is alive: its whole process group is killed. If the worker
    is gone but processes remain in its group (a session it led, started no
    earlier than it), those are its children and are killed too: Linux does
    not reuse a pid while it still names a process group. Anything else (a
    pid now used by someone else, an earlier boot) is only forgotten.
    SIGKILL is final, so nothing here waits for the processes to go.
    """
    records = registry.recorded_workers()
    if not records:
        return []
    me = boot_id()
    stats = list(_all_stats())
    killed: list[Orphan] = []
    for record in records:
        if record.boot_id != me:
            continue
        by_pid = next((s for s in stats if s.pid == record.pid), None)
        if by_pid is not None and by_pid.start_time != record.start_time:
            continue  # the pid was reused by another process: not ours
        members = [
            s.pid
            for s in stats
            if s.pgrp == record.pid
            and s.session == record.pid
            and s.start_time >= record.start_time
            and s.pid != os.getpid()
        ]
        if by_pid is None and not members:
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(record.pid, signal.SIGKILL)
        if by_pid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(record.pid, signal.SIGKILL)
        pids = tuple(sorted(set(members) | ({record.pid} if by_pid is not None else set())))
        killed.append(Orphan(record, pids, by_pid is not None))
        log.warning(
            "killed orphaned worker of job %s (local rank %d, pid %d%s) left by a previous run",
            record.job_id,
            record.local_rank,
            record.pid,
            f", {len(pids) - 1} more in its group" if len(pids) > 1 else "",
        )
    registry.forget_workers([(r.pid, r.start_time) for r in records])
    return killed
