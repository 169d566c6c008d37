"""What the daemon reads of ``/proc``, and the start-up sweep of what a previous run left.

The parent-death signal (:mod:`elasticd.supervise.spawn`) does not reach the worker's
own children, a set-uid program clears it, and a daemon can die between fork and prctl.
So every spawn is also recorded in the daemon's SQLite (pid, process start time, boot,
job, attempt) and forgotten when the group is stopped; on start, :func:`sweep_orphans`
kills the process group of every recorded worker that is still alive with the same start
time, and the leftovers of a recorded group whose leader is gone. What left the process
groups is caught by the attempt cgroups (:mod:`elasticd.supervise.cgroup`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

from elasticd.supervise.records import WorkerRecord
from elasticd.supervise.spawn import WorkerRegistry

log = logging.getLogger(__name__)

__all__ = [
    "Orphan",
    "boot_id",
    "group_has_live_members",
    "own_children",
    "process_start_time",
    "start_time_of",
    "sweep_orphans",
]


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
    ppid: int
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
            ppid=int(fields[1]),
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


def start_time_of(pid: int) -> int | None:
    """When ``pid`` started, a zombie's too (its start time stays until it is reaped): with
    the pid, the identity of a child (None: no such process)."""
    st = _read_stat(pid)
    return None if st is None else st.start_time


def own_children() -> set[int]:
    """This process's children, zombies included (``/proc/self/task/*/children``: every
    thread's, cheap; else a walk of /proc)."""
    me = os.getpid()
    try:
        tasks = os.listdir(f"/proc/{me}/task")
        children: set[int] = set()
        for tid in tasks:
            with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
                text = Path(f"/proc/{me}/task/{tid}/children").read_text()
                children.update(int(pid) for pid in text.split())
    except OSError:  # no CONFIG_PROC_CHILDREN
        return {st.pid for st in _all_stats() if st.ppid == me}
    return children


def _all_stats() -> Iterator[_Stat]:
    with os.scandir("/proc") as entries:  # closed also when a caller stops early (any())
        for entry in entries:
            if entry.name.isdigit():
                st = _read_stat(entry.name)
                if st is not None and st.state not in ("Z", "X"):
                    yield st


def group_has_live_members(pgid: int) -> bool:
    """True while a process that is not a zombie belongs to process group ``pgid``.

    A zombie (an exited child whose new parent, often init, has not reaped it
    yet) keeps its group id in use, but it can hold no pipe and run no code.
    """
    try:
        os.killpg(pgid, 0)  # cheap: no member at all
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return any(st.pgrp == pgid for st in _all_stats())


# -- the sweep ---------------------------------------------------------------------


@dataclass(frozen=True)
class Orphan:
    """A recorded worker (or what is left of its process group) that the sweep killed."""

    record: WorkerRecord
    pids: tuple[int, ...]
    """Every process killed: the worker and the members of its process group."""
    leader_alive: bool


def sweep_orphans(registry: WorkerRegistry, keep: Collection[tuple[int, int]] = ()) -> list[Orphan]:
    """Kill what is left of every worker a previous run of the daemon recorded; forget them all.

    A recorded worker is ours if a process with its pid and its start time
    (same boot) is alive: its whole process group is killed. If the worker
    is gone but processes remain in its group (a session it led, started no
    earlier than it), those are its children and are killed too: Linux does
    not reuse a pid while it still names a process group. Anything else (a
    pid now used by someone else, an earlier boot) is only forgotten.
    SIGKILL is final, so nothing here waits for the processes to go.
    ``keep``: (pid, start time) of workers carried across the daemon's re-exec:
    neither killed nor forgotten.
    """
    records = [r for r in registry.recorded_workers() if (r.pid, r.start_time) not in keep]
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
