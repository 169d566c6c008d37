"""Containment: every process a job attempt creates ends when the attempt ends.

A worker's process group catches its ordinary children, but a process that
calls ``setsid()`` (a daemonising data server, a double fork) leaves it and
would outlive the job, the daemon and the start-up sweep. So each job
attempt on a node (one worker group) gets a cgroup v2 of its own, and
stopping the attempt kills the cgroup.

Runs on the daemon's side of the privilege boundary (as root): it creates,
kills and removes cgroups and reads ``/proc``; nothing here opens a path a
job chose. The only thing a job's process touches is the cgroup it is put
in, and it cannot leave it (below).

Where the cgroups are
    The cgroup2 mount is read from ``/proc/self/mountinfo`` (``/sys/fs/cgroup``
    on a pure-v2 host, ``/sys/fs/cgroup/unified`` on a hybrid one) and the
    daemon's own cgroup from ``/proc/self/cgroup`` (``0::/...``). Under it the
    daemon makes its subtree ``elasticd.<node>.<hash of the state folder>``
    (several daemons may share a cgroup, as in tests, and a restarted daemon
    with the same state folder finds its own again), and in that subtree one
    cgroup per attempt, ``a<attempt>.<random>.<job id>``. Under systemd the
    daemon's cgroup is its unit's, handed over by ``Delegate=yes``
    (``systemd/elasticd.service``).

    The daemon stays in its own cgroup; it does not move to a leaf. cgroup v2's
    no-internal-processes rule forbids *enabling controllers* in a cgroup that
    has processes (which the kernel already guarantees for the cgroup the
    daemon is in) and moving processes into a cgroup with controllers enabled
    below it; it does not forbid children. Attempt cgroups use only the core
    files (``cgroup.procs``, ``cgroup.kill``, ``cgroup.freeze``,
    ``cgroup.events``), which need no controller. Limiting a job's memory or
    pids would need the daemon in a leaf (``<unit>/daemon``) first: not done.

How a worker gets in before the job's code runs
    :func:`~elasticd.supervise.spawn.start_process` is given a descriptor of the
    attempt's ``cgroup.procs``, opened by the daemon. Then the first program
    the child execs is a short stage (``perl -e``, else ``python -I -S``;
    :mod:`elasticd.supervise.spawn`) that runs as root with
    an *empty* environment (so no ``LD_PRELOAD`` or other setting of the job
    is seen by a privileged process): it writes ``0`` (itself) to the
    descriptor and closes it, reads the job's environment from a memfd,
    switches to the job's user, sets the parent-death signal and execs the
    usual resolver with the job's environment. So every process of the job
    is born inside the cgroup, and the root-opened descriptor is closed
    before any code of the job runs (a descriptor opened by root carries
    root's right to move *any* process, so it must never reach the job).

Why the job cannot leave
    Moving a process needs write access to the ``cgroup.procs`` of the
    destination and of the common ancestor. Every cgroup file the daemon
    creates is owned by root and not writable by others (mode 0644, folders
    0755), so the job's user can neither move itself out, nor write
    ``cgroup.kill``/``cgroup.freeze``, nor make sub-cgroups.

Stopping an attempt
    After the workers' own process-group stop, whatever is left in the
    attempt's cgroup outside the workers' process groups is a *stray*; the
    cgroup is killed (``cgroup.kill``; on kernels before 5.14, freeze and
    SIGKILL every pid of ``cgroup.procs``), ``cgroup.events`` is awaited until
    ``populated 0`` (bounded) and the cgroup is removed. The strays are
    reported (``workers.strays``). After a ``kill -9`` of the daemon, the
    start-up sweep walks the daemon's subtree and does the same to every
    attempt cgroup it finds.

The fallback: a child subreaper
    Where no cgroup can be made (no cgroup2 mount, read-only, EACCES: a daemon
    that is not root), or with ``containment = "subreaper"``, the daemon makes
    itself a child subreaper (``prctl(PR_SET_CHILD_SUBREAPER)``): a process
    that escapes a worker's group is re-parented to the daemon when its
    parent dies, and at the attempt's stop every child of the daemon it did
    not start whose environment names the job and attempt is killed and
    reaped. That is partial: a stray whose parent is still alive, or that
    cleared its environment, is not found, and nothing is found after a
    ``kill -9`` of the daemon. The daemon says so once (:meth:`Containment.notice`):
    in its log, and in a ``containment.partial`` event of the first job it runs.

    A subreaper must also *reap*: an orphan that exits on its own becomes a
    zombie child of the daemon, and nobody else will wait for it.
    :meth:`Containment.reap_zombies` looks at the daemon's children every
    :data:`REAP_INTERVAL` seconds and waits (``WNOHANG``) for exactly the
    zombies :func:`zombies_to_reap` names. Never ``waitpid(-1)``: asyncio's
    child watcher, and ``subprocess`` in threads, wait for the processes the
    daemon started itself, and taking their exit status would report a
    worker's exit code as 255 (or 0). So a zombie is reaped only when it is
    not one the daemon started (:func:`~elasticd.supervise.spawn.live_children`)
    and was already a zombie at the previous look: a child's own waiter reaps
    it at once, so a process that stays a zombie for a whole interval has none.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import hashlib
import logging
import os
import re
import secrets
import signal
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from elasticd.supervise.sweep import own_children

log = logging.getLogger(__name__)

__all__ = [
    "AttemptContainment",
    "AttemptName",
    "Containment",
    "STANDBY_MARKER",
    "Leftover",
    "Move",
    "attempt_name",
    "containment_fix",
    "partial_log_level",
    "cgroup2_mount",
    "leftovers",
    "own_cgroup",
    "parse_attempt_name",
    "strays",
    "subtree_name",
    "zombies_to_reap",
]

#: The ``containment`` config key.
ContainmentChoice = Literal["auto", "cgroup", "subreaper"]

#: How long a killed cgroup may take to empty before it is given up (left for the sweep).
EMPTY_TIMEOUT = 10.0

#: Seconds a move of a whole cgroup (a standby's, at its hand-off) may hold the event loop
#: (the default of the ``prewarm_move_budget`` setting).
MOVE_BUDGET = 0.1
#: The environment variable that names one standby's processes (its value, a random token,
#: is the standby's own; the program it becomes does not see it in ``os.environ``).
STANDBY_MARKER = "ELASTICD_STANDBY"
PR_SET_CHILD_SUBREAPER = 36

#: How many more times (20 ms apart) the subreaper looks at an adopted process whose
#: environment reads as empty (an exec in progress shows none) before it gives up on it.
UNREAD_LOOKS = 5

#: Seconds between two looks for zombie children (subreaper mode): an orphan's zombie is
#: reaped within two of them.
REAP_INTERVAL = 1.0

# -- decisions (pure) ----------------------------------------------------------------


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as ``\\ooo``."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def cgroup2_mount(mountinfo: str) -> str | None:
    """The mount point of the cgroup2 hierarchy in ``/proc/self/mountinfo``'s text, if any."""
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if sep and len(fields) >= 5 and tail and tail[0] == "cgroup2":
            return _unescape(fields[4])
    return None


def own_cgroup(proc_cgroup: str) -> str | None:
    """The cgroup v2 path in ``/proc/self/cgroup``'s text (the ``0::`` line), if any."""
    for line in proc_cgroup.splitlines():
        if line.startswith("0::"):
            return line[3:] or "/"
    return None


def subtree_name(node: str, state_dir: str) -> str:
    """The daemon's own subtree: one per node name and state folder (stable across restarts)."""
    digest = hashlib.sha256(state_dir.encode()).hexdigest()[:12]
    return f"elasticd.{node}.{digest}"


@dataclass(frozen=True)
class AttemptName:
    """What an attempt cgroup's name says."""

    name: str
    job_id: str
    attempt: int | None


_ATTEMPT_RE = re.compile(r"^a(-|\d+)\.([0-9a-f]{8})\.([A-Za-z0-9][A-Za-z0-9._-]{0,127})$")


def attempt_name(job_id: str, attempt: int | None, token: str) -> str:
    """``a<attempt>.<token>.<job id>`` (``a-`` without an attempt); token: 8 hex digits."""
    return f"a{'-' if attempt is None else attempt}.{token}.{job_id}"


def parse_attempt_name(name: str) -> AttemptName | None:
    match = _ATTEMPT_RE.match(name)
    if match is None:
        return None
    attempt = None if match.group(1) == "-" else int(match.group(1))
    return AttemptName(name, match.group(3), attempt)


def leftovers(children: Iterable[str], live: Collection[str]) -> list[AttemptName]:
    """The attempt cgroups among ``children`` (names in the daemon's subtree) not in ``live``.

    Anything else there (not an attempt name) is not the daemon's and is left alone.
    """
    found = (parse_attempt_name(name) for name in sorted(children) if name not in live)
    return [f for f in found if f is not None]


def strays(members: Mapping[int, int | None], worker_groups: Collection[int]) -> list[int]:
    """Pids of an attempt left outside its workers' process groups.

    ``members`` maps each pid found in the attempt (its cgroup, or the
    daemon's adopted children) to its process group (None: gone meanwhile);
    processes still in a worker's group were already killed with the group.
    """
    return sorted(
        pid for pid, pgrp in members.items() if pgrp is not None and pgrp not in worker_groups
    )


def zombies_to_reap(
    zombies: Collection[int], zombies_before: Collection[int], known: Collection[int]
) -> set[int]:
    """The zombie children the daemon may wait for: a zombie now and at the previous look,
    and not a process the daemon started itself (``known``: its own waiter reaps it)."""
    return (set(zombies) & set(zombies_before)) - set(known)


# -- /proc -------------------------------------------------------------------------


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    return text.rpartition(")")[2].split()


def _pgrp(pid: int) -> int | None:
    """The process group of a live (non-zombie) ``pid``, else None."""
    fields = _stat_fields(pid)
    if fields is None or len(fields) < 3 or fields[0] in ("Z", "X"):
        return None
    return int(fields[2])


def _children_of(parent: int) -> list[tuple[int, bool]]:
    """``(pid, is_zombie)`` for every child of ``parent``."""
    found = []
    with os.scandir("/proc") as entries:
        for entry in entries:
            if not entry.name.isdigit():
                continue
            fields = _stat_fields(int(entry.name))
            if fields is not None and len(fields) > 1 and fields[1] == str(parent):
                found.append((int(entry.name), fields[0] in ("Z", "X")))
    return found


def _zombie_children() -> set[int]:
    """This process's children that are zombies."""
    found = set()
    for pid in own_children():
        fields = _stat_fields(pid)
        if fields is not None and fields[:1] == ["Z"]:
            found.add(pid)
    return found


def _reap(pids: Iterable[int]) -> list[int]:
    """``waitpid(pid, WNOHANG)`` on exactly ``pids`` (zombies: it returns at once)."""
    reaped = []
    for pid in pids:
        with contextlib.suppress(ChildProcessError):
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                reaped.append(pid)
    return reaped


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


# -- one cgroup ----------------------------------------------------------------------


class Cgroup:
    """One cgroup v2 folder: its members, killing them, removing it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def pids(self) -> list[int]:
        try:
            text = (self.path / "cgroup.procs").read_text()
        except FileNotFoundError:
            return []
        return [int(line) for line in text.split()]

    def populated(self) -> bool:
        try:
            text = (self.path / "cgroup.events").read_text()
        except FileNotFoundError:
            return False
        return "populated 1" in text.splitlines()

    def kill(self) -> None:
        """SIGKILL every process of the cgroup and its descendants (cgroup.kill, else freezer)."""
        try:
            _write(self.path / "cgroup.kill", "1")
            return
        except FileNotFoundError:
            if not self.path.exists():
                return
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.EACCES, errno.EPERM, errno.ENOTSUP):
                raise
        self._kill_frozen()

    def _kill_frozen(self) -> None:
        # Kernels without cgroup.kill (< 5.14): freeze so nobody forks meanwhile, SIGKILL
        # each member (a fatal signal ends a frozen task), thaw.
        with contextlib.suppress(OSError):
            _write(self.path / "cgroup.freeze", "1")
        try:
            for _ in range(100):
                pids = self.pids()
                if not pids:
                    return
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                time.sleep(0.01)
        finally:
            with contextlib.suppress(OSError):
                _write(self.path / "cgroup.freeze", "0")

    def move_all(
        self,
        target: Cgroup,
        target_procs: int,
        budget: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> Move:
        """Move every member into ``target``, whose ``cgroup.procs`` is open as ``target_procs``.

        All or nothing. This cgroup is frozen first, so its members stop forking, and
        ``target`` too for the move's length, so that a member stays frozen where it lands
        (the kernel thaws a task moved into an unfrozen cgroup) until the whole move is
        done. A fork already under way may still leave a child behind: read again until
        none is left. Synchronous, on the caller's thread (the event loop's), so bounded
        by ``budget`` seconds (:data:`MOVE_BUDGET`), looked at before every single move:
        a round of many members would overrun it, and one move may itself wait for the
        forks under way and an RCU grace period (from a few microseconds to, on a loaded
        machine, a few hundred milliseconds). Past it, what was moved is SIGKILLed where
        it landed (still frozen, it started nothing there) and :attr:`Move.done` is False
        (a refused write raises, after the same kills): what is left here is the caller's
        to kill (:meth:`stop`). So a member that forks without end, or a standby with too
        many processes, cannot hold the daemon, nor leave anything in ``target``.

        Without a freezer (an old kernel, or one that will not hold them) the rounds alone
        race the forks; a member moved then may fork in ``target`` before the give-up
        kills it, and such a child is ``target``'s until its own stop.
        """
        with contextlib.suppress(OSError):  # no freezer (an old kernel): the rounds alone
            _write(self.path / "cgroup.freeze", "1")
        held = False
        with contextlib.suppress(OSError):
            _write(target.path / "cgroup.freeze", "1")
            held = True
        start = clock()
        deadline = start + (MOVE_BUDGET if budget is None else budget)
        moved: list[int] = []
        done = False
        try:
            while pids := self.pids():
                for pid in pids:
                    if clock() >= deadline:
                        return Move(False, len(moved), len(self.pids()), clock() - start)
                    try:
                        os.write(target_procs, str(pid).encode())
                    except ProcessLookupError:
                        continue  # gone meanwhile (a zombie is no member: it is out)
                    moved.append(pid)
            done = True
            return Move(True, len(moved), 0, clock() - start)
        finally:
            if not done:  # all or nothing (the budget, or a write refused): what landed goes
                for pid in moved:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            if held:
                with contextlib.suppress(OSError):
                    _write(target.path / "cgroup.freeze", "0")

    def remove(self) -> bool:
        """rmdir; False if it still has members (left for the next sweep)."""
        try:
            self.path.rmdir()
        except FileNotFoundError:
            return True
        except OSError as exc:
            log.warning("cannot remove cgroup %s: %s", self.path, exc)
            return False
        return True

    async def stop(self, timeout: float = EMPTY_TIMEOUT) -> None:
        """Kill, wait (bounded) until ``cgroup.events`` says ``populated 0``, remove."""
        self.kill()
        deadline = time.monotonic() + timeout
        while self.populated() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        self.remove()

    def stop_now(self, timeout: float = EMPTY_TIMEOUT) -> None:
        """:meth:`stop` for the start-up sweep, which runs before the loop serves anything."""
        self.kill()
        deadline = time.monotonic() + timeout
        while self.populated() and time.monotonic() < deadline:
            time.sleep(0.01)
        self.remove()


def _write(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Move:
    """What :meth:`Cgroup.move_all` did: ``done`` (every member moved) or given up at the
    budget (``moved`` killed where they landed, ``left`` still in the source)."""

    done: bool
    moved: int
    left: int
    seconds: float


# -- the daemon's containment -----------------------------------------------------


@dataclass(frozen=True)
class Leftover:
    """An attempt cgroup found by the start-up sweep, killed and removed."""

    name: AttemptName
    pids: tuple[int, ...]


class AttemptContainment:
    """What contains one attempt: a cgroup, or (partial) the daemon as subreaper."""

    def __init__(
        self,
        *,
        cgroup: Cgroup | None,
        job_id: str,
        attempt_tag: str | None,
        known: Callable[[], Collection[int]] = frozenset,
        marker: str | None = None,
        move_budget: float = MOVE_BUDGET,
    ) -> None:
        """``marker``: a standby's (:data:`STANDBY_MARKER`): under the subreaper its strays
        are only the processes whose environment carries it. ``move_budget``: what
        :meth:`hand_over` may spend (:meth:`Cgroup.move_all`)."""
        self.cgroup = cgroup
        self.move_budget = move_budget
        self.job_id = job_id
        self.attempt_tag = attempt_tag
        self.marker = marker
        self._known = known
        self.procs_fd: int | None = None
        if cgroup is not None:
            self.procs_fd = os.open(
                cgroup.path / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW
            )
        self.stopped = False

    @property
    def partial(self) -> bool:
        return self.cgroup is None

    async def stop(self, worker_groups: Collection[int]) -> list[int]:
        """Kill everything of the attempt that is left; returns the strays' pids.

        Called after the workers' own process groups were stopped (SIGKILLed):
        what is still there outside ``worker_groups`` is a stray.
        """
        if self.stopped:
            return []
        self.stopped = True
        if self.procs_fd is not None:
            os.close(self.procs_fd)
            self.procs_fd = None
        if self.cgroup is not None:
            found = strays({pid: _pgrp(pid) for pid in self.cgroup.pids()}, worker_groups)
            await self.cgroup.stop()
            return found
        return await self._reap_adopted(worker_groups)

    def hand_over(self, to: AttemptContainment) -> None:
        """Move everything of this containment into ``to``'s cgroup, then close this one
        (its folder removed): a standby's own and what its imports started go with it.

        Without cgroups (the subreaper) nothing moves: what a standby started in its process
        group is killed with it, and what left it is found by its job's id when orphaned.
        """
        if self.stopped:
            return
        if self.cgroup is not None and to.cgroup is not None:
            if to.procs_fd is None:  # stopped meanwhile: its folder may be gone already
                raise OSError(f"the attempt's cgroup {to.cgroup.path.name} was closed")
            move = self.cgroup.move_all(to.cgroup, to.procs_fd, self.move_budget)
            if not move.done:  # then stop() kills what is left here
                raise OSError(
                    f"its processes did not all move into the attempt's cgroup within "
                    f"{self.move_budget:g} s ({move.moved} moved and killed there, "
                    f"{move.left} still arriving in its own)"
                )
            self.cgroup.remove()
        self.stopped = True
        if self.procs_fd is not None:
            os.close(self.procs_fd)
            self.procs_fd = None

    async def _reap_adopted(self, worker_groups: Collection[int]) -> list[int]:
        """Subreaper: kill and reap the daemon's adopted children that belong to this attempt."""
        me = os.getpid()
        counted: set[int] = set()
        killed: set[int] = set()
        deadline = time.monotonic() + EMPTY_TIMEOUT
        # An environment read as empty may be a process in the middle of an exec (the
        # kernel shows none then): look again a few times before taking it for a stranger.
        second_looks = UNREAD_LOOKS
        # Killing a stray re-parents its own children to the daemon: go round until none.
        while True:
            known = set(self._known())
            members: dict[int, int | None] = {}
            unread = False
            for pid, zombie in _children_of(me):
                if pid in known:
                    continue  # started by the daemon: asyncio reaps it
                if zombie:
                    if pid in killed:  # only ours: another child's status is its owner's
                        with contextlib.suppress(ChildProcessError):
                            os.waitpid(pid, os.WNOHANG)  # noqa: ASYNC222 - a zombie: at once
                    continue
                env = _environ(pid)
                unread = unread or not env
                if env.get("ELASTICD_JOB_ID") != self.job_id:
                    continue  # another job's, or it cleared its environment: not found
                tag = env.get("ELASTICD_ATTEMPT")
                if self.attempt_tag is not None and tag not in (None, self.attempt_tag):
                    continue
                if self.marker is not None and env.get(STANDBY_MARKER) != self.marker:
                    continue  # a standby's release: not the running attempt's strays
                members[pid] = _pgrp(pid)
            if time.monotonic() >= deadline:
                break
            if not members:
                if not unread or second_looks == 0:
                    break
                second_looks -= 1
                await asyncio.sleep(0.02)
                continue
            counted.update(strays(members, worker_groups))
            for pid in members:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            await asyncio.sleep(0.02)
        for pid in killed:  # the last ones killed are zombies now
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)  # noqa: ASYNC222 - a zombie: at once
        return sorted(counted)


def containment_fix(choice: ContainmentChoice, euid: int) -> str:
    """What gives each attempt a cgroup of its own on a daemon that has none (pure)."""
    if choice == "subreaper":
        return 'for a cgroup per attempt, set containment = "auto"'
    if euid != 0:
        return (
            "a daemon that is not root gets cgroups only in a cgroup v2 subtree delegated to "
            "its user (systemd-run --user --scope -p Delegate=yes ...); a root daemon (the "
            "systemd unit, Delegate=yes) gives each attempt one"
        )
    return "mount cgroup v2 and, under systemd, set Delegate=yes (the shipped unit does)"


def partial_log_level(choice: ContainmentChoice, euid: int) -> int:
    """How loudly a daemon says it has no cgroups (pure): a warning where they were expected
    (root, ``auto``), else info (a user's daemon cannot have them; ``subreaper`` was chosen)."""
    return logging.WARNING if euid == 0 and choice == "auto" else logging.INFO


class Containment:
    """How this daemon contains job attempts: cgroups, or a subreaper (partial)."""

    def __init__(
        self,
        mode: Literal["cgroup", "subreaper"],
        *,
        base: Path | None = None,
        reason: str = "",
        known: Callable[[], Collection[int]] = frozenset,
        move_budget: float = MOVE_BUDGET,
    ) -> None:
        self.mode = mode
        self.base = base
        self.reason = reason
        self._known = known
        self.move_budget = move_budget
        self.fix = ""
        """What would give each attempt a cgroup here (set by :meth:`setup`)."""
        self._said = False

    @property
    def partial(self) -> bool:
        return self.mode != "cgroup"

    def notice(self) -> str | None:
        """Why the attempts are only partly contained, with the fix: the first time this
        daemon asks, then None (a daemon says it once, not once per job); None with cgroups."""
        if not self.partial or self._said:
            return None
        self._said = True
        return f"{self.reason or 'no cgroup'}; {self.fix}" if self.fix else self.reason

    @classmethod
    def setup(
        cls,
        choice: ContainmentChoice,
        *,
        node: str,
        state_dir: Path,
        known: Callable[[], Collection[int]] = frozenset,
        proc: Path = Path("/proc/self"),
        move_budget: float = MOVE_BUDGET,
    ) -> Containment:
        """Make the daemon's subtree (``cgroup``) or become a subreaper (``subreaper``).

        ``auto`` tries cgroups and falls back; a forced ``cgroup`` that cannot
        be had raises ``OSError`` (the daemon refuses to start). ``move_budget``: each
        attempt's (:class:`AttemptContainment`).
        """
        if choice != "subreaper":
            try:
                base = cls._make_subtree(node, state_dir, proc)
                return cls("cgroup", base=base, known=known, move_budget=move_budget)
            except OSError as exc:
                if choice == "cgroup":
                    raise
                reason = str(exc)
        else:
            reason = "containment = subreaper in the daemon's configuration"
        _become_subreaper()
        contained = cls("subreaper", reason=reason, known=known, move_budget=move_budget)
        contained.fix = containment_fix(choice, os.geteuid())
        return contained

    @staticmethod
    def _make_subtree(node: str, state_dir: Path, proc: Path) -> Path:
        mount = cgroup2_mount((proc / "mountinfo").read_text())
        if mount is None:
            raise OSError(errno.ENOENT, "no cgroup2 file system is mounted")
        mine = own_cgroup((proc / "cgroup").read_text())
        if mine is None:
            raise OSError(errno.ENOENT, "the daemon is in no cgroup v2")
        parent = Path(mount) / mine.lstrip("/")
        base = parent / subtree_name(node, str(state_dir.resolve()))
        try:
            base.mkdir(mode=0o755)
            # Explicitly: the daemon's umask is 077, and a job may read its own cgroup's
            # limits (cpu.max, memory.max), as runtimes that size themselves do.
            base.chmod(0o755)
        except FileExistsError:
            pass
        # A probe attempt: the folder and its cgroup.procs must be writable by us.
        probe = Cgroup(base / f"probe.{secrets.token_hex(4)}")
        probe.path.mkdir(mode=0o755)
        try:
            os.close(os.open(probe.path / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC))
        finally:
            probe.remove()
        return base

    def open_attempt(
        self, job_id: str, attempt: int | None, attempt_tag: str | None, marker: str | None = None
    ) -> AttemptContainment:
        """A fresh cgroup for one attempt (or the subreaper's bookkeeping); ``marker``: a
        standby's (:class:`AttemptContainment`)."""
        if self.base is None:
            return AttemptContainment(
                cgroup=None, job_id=job_id, attempt_tag=attempt_tag, known=self._known,
                marker=marker,
            )  # fmt: skip
        path = self.base / attempt_name(job_id, attempt, secrets.token_hex(4))
        try:
            path.mkdir(mode=0o755)
        except FileNotFoundError:
            # The subtree was removed under the daemon (an operator's cleanup, a tool that
            # prunes empty cgroups): make it again, once, then the attempt's folder. Any
            # other refusal (EAGAIN under cgroup.max.descendants, EACCES) goes up to the
            # agent, which retries it as the node's trouble (agent/nodefail.py).
            log.warning("the daemon's cgroup subtree %s was removed; making it again", self.base)
            self.base.mkdir(mode=0o755, exist_ok=True)
            self.base.chmod(0o755)
            path.mkdir(mode=0o755)
        path.chmod(0o755)  # not the daemon's umask of 077: the job may read its limits
        try:
            return AttemptContainment(
                cgroup=Cgroup(path), job_id=job_id, attempt_tag=attempt_tag, known=self._known,
                marker=marker, move_budget=self.move_budget,
            )  # fmt: skip
        except BaseException:
            Cgroup(path).remove()
            raise

    def sweep(self, live: Collection[str] = ()) -> list[Leftover]:
        """Kill and remove every attempt cgroup of the subtree not in ``live`` (start-up)."""
        if self.base is None:
            return []
        try:
            with os.scandir(self.base) as entries:
                names = [e.name for e in entries if e.is_dir(follow_symlinks=False)]
        except OSError as exc:
            log.warning("cannot list %s for leftover attempts: %s", self.base, exc)
            return []
        found = []
        for leftover in leftovers(names, live):
            cgroup = Cgroup(self.base / leftover.name)
            pids = tuple(cgroup.pids())
            cgroup.stop_now()
            found.append(Leftover(leftover, pids))
            if pids:
                log.warning(
                    "killed %d process(es) of job %s (attempt %s) left in %s by a previous run",
                    len(pids),
                    leftover.job_id,
                    leftover.attempt,
                    cgroup.path,
                )
        return found

    async def reap_zombies(self, interval: float = REAP_INTERVAL) -> None:
        """Subreaper: reap the orphans' zombies re-parented to the daemon, until cancelled."""
        before: set[int] = set()
        while True:
            try:
                zombies = _zombie_children()
                reaped = _reap(zombies_to_reap(zombies, before, self._known()))
            except OSError as exc:  # /proc unreadable for a moment: look again next time
                log.warning("cannot look for zombie children: %s", exc)
                zombies, reaped = set(), []
            if reaped:
                log.debug("reaped %d orphaned process(es): %s", len(reaped), reaped)
            before = zombies - set(reaped)
            await asyncio.sleep(interval)

    def close(self) -> None:
        """Remove the daemon's subtree if it is empty (at shutdown)."""
        if self.base is not None:
            with contextlib.suppress(OSError):
                self.base.rmdir()


def _become_subreaper() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        code = ctypes.get_errno()
        log.warning("prctl(PR_SET_CHILD_SUBREAPER) failed: %s", os.strerror(code))
