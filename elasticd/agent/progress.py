"""Hang detection: the daemon's side of the progress heartbeat.

Each worker writes its heartbeat file (count + ``CLOCK_MONOTONIC`` of the
last :func:`elasticd.worker.ping`, see :mod:`elasticd.worker.heartbeat`);
:class:`ProgressMonitor` creates those files before the workers start and
tells the agent when one of them misses its deadline.

**The files are read through the daemon's own descriptors.** A heartbeat
lies in the worker's log folder, which belongs to the job's user, so the
worker may put anything at that path later (a FIFO, a link to a root-only
file, a directory). The monitor keeps the descriptor of each file it
created (:class:`elasticd.worker.heartbeat.HeartbeatFile`) and never opens
the path again: nothing there can block the event loop or be read on the
worker's behalf. A worker whose pings miss that file (it maps what it put
at the path instead) reports no progress, so its deadlines apply as usual,
and ``on_replaced`` tells the agent once, with what lies there now. The
file belongs to the job's user (the one :mod:`elasticd.supervise.spawn` will
run the worker as), who must write it.

The rules (settings of the job):

* ``progress_timeout`` (off by default): once a worker has pinged, it must
  ping again within this many seconds.
* ``startup_timeout`` (optional): a worker that has not pinged yet must do so
  within this many seconds of its start. Without it, a worker that never
  pings is never declared hung: it may not use the library at all.

**Event-by-deadline, not polling.** A worker's deadline only moves forward,
and only when it pings: it is ``last ping + progress_timeout`` (or ``start +
startup_timeout`` before the first ping). So a hang can only become true at
the earliest deadline of the group, and nothing needs to be looked at before
then. :meth:`ProgressMonitor.wait_for_hang` reads the files, computes that
earliest deadline with the pure :func:`next_deadline`, and sleeps exactly
until it; at that instant it reads the files again. If the worker pinged
meanwhile, its deadline moved and the loop sleeps until the new earliest
one; if not, the worker is hung, detected at its deadline (plus the event
loop's scheduling delay), not up to a poll interval later. A worker that
pings steadily costs the daemon one file read per ``progress_timeout``, not
one per second. A worker that exits is taken out (:meth:`finished`), which
wakes the waiter so that it recomputes.

Stack dumps (:func:`dump_stacks`) use ``py-spy dump`` when it is installed
and may attach, else ``SIGUSR1``, which ``elasticd.worker`` turns into a
``faulthandler`` dump on the worker's stderr (its ``stderr.log``). SIGUSR1
is only sent to a process whose signal mask shows it is caught: its default
action would kill the worker.

This module does not import torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elasticd.clock import SYSTEM_CLOCK, Clock
from elasticd.errors import SpawnStage, WorkerSpawnError
from elasticd.supervise.adopt import inheritable_dup
from elasticd.supervise.env import WITHHELD
from elasticd.supervise.spawn import DEFAULT_POLICY, SpawnPolicy
from elasticd.tasks import race
from elasticd.worker.heartbeat import HeartbeatFile
from elasticd.worker.stacks import STACK_SIGNAL

__all__ = [
    "Beat",
    "Hang",
    "ProgressMonitor",
    "ProgressSettings",
    "StackDump",
    "dump_stacks",
    "next_deadline",
]

#: The longest ``dump_stacks`` output kept (characters): enough for dozens of threads.
MAX_STACKS_CHARS = 64 * 1024


@dataclass(frozen=True)
class ProgressSettings:
    """A job's progress rules; ``None`` turns a rule off."""

    progress_timeout: float | None = None
    startup_timeout: float | None = None

    def __post_init__(self) -> None:
        for name in ("progress_timeout", "startup_timeout"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds, not {value!r}")

    @property
    def enabled(self) -> bool:
        """Whether any rule is on."""
        return self.progress_timeout is not None or self.startup_timeout is not None


@dataclass(frozen=True)
class Beat:
    """What the daemon knows about one worker's progress, in monotonic seconds."""

    local_rank: int
    started_at: float
    """When the worker was started."""
    last_ping: float | None
    """When it last pinged; None when it never did."""
    count: int = 0
    """How many pings so far."""


@dataclass(frozen=True)
class Hang:
    """A worker that missed its deadline."""

    local_rank: int
    silent_for: float
    """Seconds since its last ping (since its start when it never pinged)."""
    never_pinged: bool
    deadline: float
    """The monotonic time it was due by."""

    def describe(self) -> str:
        """One line for people."""
        if self.never_pinged:
            return (
                f"local rank {self.local_rank} has not reported progress since it started "
                f"{self.silent_for:.1f} s ago (startup_timeout)"
            )
        return (
            f"local rank {self.local_rank} has reported no progress for "
            f"{self.silent_for:.1f} s (progress_timeout)"
        )


def deadline_of(beat: Beat, settings: ProgressSettings) -> float | None:
    """When ``beat``'s worker is due next; None when no rule applies to it."""
    if beat.last_ping is None:
        if settings.startup_timeout is None:
            return None
        return beat.started_at + settings.startup_timeout
    if settings.progress_timeout is None:
        return None
    return beat.last_ping + settings.progress_timeout


def next_deadline(
    beats: Iterable[Beat], now: float, settings: ProgressSettings
) -> tuple[float | None, Hang | None]:
    """The pure decision: ``(earliest future deadline, None)`` or ``(None, hang)``.

    A hang is reported for the worker most overdue (lowest local rank on a
    tie). ``(None, None)`` means nothing can become hung until a beat changes
    (no rule applies, or no worker is left).
    """
    earliest: float | None = None
    worst: tuple[float, int, Beat] | None = None
    for beat in beats:
        due = deadline_of(beat, settings)
        if due is None:
            continue
        if due <= now:
            key = (due, beat.local_rank, beat)
            if worst is None or key[:2] < worst[:2]:
                worst = key
        elif earliest is None or due < earliest:
            earliest = due
    if worst is not None:
        due, _, beat = worst
        since = beat.started_at if beat.last_ping is None else beat.last_ping
        return None, Hang(
            local_rank=beat.local_rank,
            silent_for=max(0.0, now - since),
            never_pinged=beat.last_ping is None,
            deadline=due,
        )
    return earliest, None


class ProgressMonitor:
    """Watches the heartbeat files of one worker group (one attempt on one node).

    Use: ``prepare()`` before spawning (creates the files, passed to workers
    as ``ELASTICD_HEARTBEAT_FILE``), ``started()`` once they run,
    ``finished(local_rank)`` when one exits, and race ``wait_for_hang()``
    against the group's exit; ``close()`` releases the files' descriptors.
    ``on_check(beats)`` is called each time the files are read (at most once
    per deadline): a free moment to refresh ``last_progress_at`` in the
    group view. ``on_replaced(local_rank, what)`` is called once per worker
    whose file was replaced by something else. The files belong to
    ``owner`` (uid, gid) when given, else to the identity ``policy`` (the
    daemon's spawn policy) gives ``user`` (None: the daemon's own). The heartbeat holds
    ``CLOCK_MONOTONIC``, so ``clock`` must be the system clock outside tests
    of the pure parts.
    """

    def __init__(
        self,
        files: Mapping[int, Path],
        settings: ProgressSettings,
        *,
        clock: Clock = SYSTEM_CLOCK,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        owner: tuple[int, int] | None = None,
        user: str | None = None,
        owner_user: str | None = None,
        on_check: Callable[[list[Beat]], None] | None = None,
        on_replaced: Callable[[int, str], None] | None = None,
        policy: SpawnPolicy = DEFAULT_POLICY,
    ) -> None:
        self.files = dict(files)
        self._policy = policy
        self._on_check = on_check
        self._on_replaced = on_replaced
        self._user = user
        self._owner_user = owner_user
        self._handles: dict[int, HeartbeatFile] = {}
        self._reported: set[int] = set()
        self.settings = settings
        self._clock = clock
        self._sleep = sleep
        self._owner = owner
        self._started: dict[int, float] = {}
        self._done: set[int] = set()
        self._changed = asyncio.Event()

    def prepare(self) -> None:
        """Create every heartbeat file, "never pinged", owned by the job's user; keep descriptors.

        Raises ``WorkerSpawnError`` when the job's user is refused or a file
        cannot be created (the worker's folder is a link, a directory lies
        at the path), as the spawn itself would.
        """
        owner = self._owner
        if owner is None:
            identity = self._policy.identity_for(self._user, owner_user=self._owner_user)
            owner = (identity.uid, identity.gid) if identity is not None else None
        self.close()
        for rank, path in self.files.items():
            try:
                self._handles[rank] = HeartbeatFile.create(path, owner=owner)
            except OSError as exc:
                self.close()
                raise WorkerSpawnError(
                    f"local rank {rank}: cannot create the heartbeat file {path}: "
                    f"{exc.strerror or exc}",
                    stage=SpawnStage.HEARTBEAT,
                ) from exc
        self._reported.clear()

    def hand_over(self) -> dict[int, tuple[int, float | None]]:
        """Each worker's heartbeat for the daemon's next program image (re-exec): an
        inheritable copy of the file's descriptor, and when its clock started."""
        return {
            rank: (inheritable_dup(handle.fileno()), self._started.get(rank))
            for rank, handle in self._handles.items()
        }

    def adopt(self, local_rank: int, fd: int, started: float | None) -> None:
        """Take up a heartbeat the previous program image created (its descriptor, never
        the path), with its deadline's clock where it was."""
        os.set_inheritable(fd, False)
        self._handles[local_rank] = HeartbeatFile(self.files[local_rank], fd)
        if started is not None:
            self.started(local_rank, at=started)

    def close(self) -> None:
        """Release the descriptors of the heartbeat files (idempotent)."""
        handles, self._handles = self._handles, {}
        for handle in handles.values():
            handle.close()

    def started(self, local_rank: int | None = None, at: float | None = None) -> None:
        """Record that a worker (default: all) started, at monotonic ``at`` (default: now)."""
        when = self._clock.monotonic() if at is None else at
        ranks = self.files if local_rank is None else [local_rank]
        for rank in ranks:
            self._started[rank] = when
            self._done.discard(rank)
        self._changed.set()

    def finished(self, local_rank: int) -> None:
        """Stop watching a worker that exited."""
        self._done.add(local_rank)
        self._changed.set()

    def beat(self, local_rank: int) -> Beat | None:
        """The worker's current beat (file read now); None before it started."""
        started = self._started.get(local_rank)
        handle = self._handles.get(local_rank)
        if started is None or handle is None:
            return None
        self._check_replaced(local_rank, handle)
        value = handle.read()
        if value is None or value.last is None:
            return Beat(local_rank, started, None, 0)
        # A value from the future is garbage (or a lie): count it as "now", never later.
        last = min(value.last, self._clock.monotonic())
        return Beat(local_rank, started, last, value.count)

    def _check_replaced(self, local_rank: int, handle: HeartbeatFile) -> None:
        if local_rank in self._reported or self._on_replaced is None:
            return
        what = handle.replaced()
        if what is not None:
            self._reported.add(local_rank)
            self._on_replaced(local_rank, what)

    def last_progress_at(self, local_rank: int) -> float | None:
        """Wall time of the worker's last ping, for the API; None when it never pinged."""
        beat = self.beat(local_rank) if local_rank in self.files else None
        if beat is None or beat.last_ping is None:
            return None
        return self._clock.time() - (self._clock.monotonic() - beat.last_ping)

    def beats(self) -> list[Beat]:
        """The beats of every started worker that has not finished."""
        out = []
        for rank in sorted(self._started):
            if rank in self._done:
                continue
            beat = self.beat(rank)
            if beat is not None:
                out.append(beat)
        return out

    async def wait_for_hang(self) -> Hang:
        """Return when a worker misses its deadline (see the module doc: no polling)."""
        while True:
            self._changed.clear()
            beats = self.beats()
            if self._on_check is not None:
                self._on_check(beats)  # e.g. refresh last_progress_at in the published view
            deadline, hang = next_deadline(beats, self._clock.monotonic(), self.settings)
            if hang is not None:
                return hang
            waits: list[Awaitable[Any]] = [self._changed.wait()]
            if (
                deadline is None
                and self.settings.progress_timeout is not None
                and any(b.last_ping is None for b in beats)
            ):
                # A worker that has not pinged yet has no deadline (no startup_timeout),
                # but its first ping starts one: look again one progress_timeout later.
                deadline = self._clock.monotonic() + self.settings.progress_timeout
            if deadline is not None:
                waits.append(self._sleep(max(0.0, deadline - self._clock.monotonic())))
            await race(*waits)


# -- stack dumps ---------------------------------------------------------------------


def catches_signal(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (Linux: ``SigCgt`` in /proc)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    mask = int(line.split(":", 1)[1].strip(), 16)
                    return bool(mask & (1 << (signum - 1)))
    except (OSError, ValueError):
        return False
    return False


async def _py_spy(exe: str, pid: int, timeout: float) -> tuple[bool, str]:
    proc = await asyncio.create_subprocess_exec(
        exe,
        "dump",
        "--pid",
        str(pid),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,  # so that a timeout ends it and anything it started
        # The daemon's own environment less its secrets, as every other child gets.
        env={k: v for k, v in os.environ.items() if k not in WITHHELD},
    )
    try:
        async with asyncio.timeout(timeout):
            out, _ = await proc.communicate()
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.communicate()
        return False, f"py-spy dump did not finish within {timeout:g} s"
    text = out.decode("utf-8", "replace")
    if len(text) > MAX_STACKS_CHARS:
        text = text[:MAX_STACKS_CHARS] + "\n[... truncated]"
    return proc.returncode == 0, text


@dataclass(frozen=True)
class StackDump:
    """What :func:`dump_stacks` did: the stacks, or a note saying where they went."""

    text: str
    to_stderr: bool = False
    """``SIGUSR1`` was sent: the worker's faulthandler is writing them to its stderr log."""


async def dump_stacks(
    pid: int,
    *,
    timeout: float = 10.0,
    py_spy: str | None = None,
    use_py_spy: bool = True,
) -> StackDump:
    """The Python stacks of worker ``pid``, or a note saying where they went.

    With py-spy (on PATH, or ``py_spy``): its ``dump`` output. Else, or when
    py-spy fails (e.g. ptrace is not allowed): ``SIGUSR1`` to the worker,
    whose ``faulthandler`` writes to its stderr log, if the worker catches
    it (``to_stderr``); otherwise nothing is sent.
    """
    note = ""
    exe = (py_spy or shutil.which("py-spy")) if use_py_spy else None
    if exe is not None:
        try:
            ok, text = await _py_spy(exe, pid, timeout)
        except OSError as exc:
            ok, text = False, f"py-spy could not run: {exc}"
        if ok:
            return StackDump(text)
        note = f"py-spy failed ({text.strip().splitlines()[-1] if text.strip() else 'no output'}); "
    if not catches_signal(pid, STACK_SIGNAL):
        return StackDump(
            f"{note}no stacks: pid {pid} does not handle {STACK_SIGNAL.name} "
            "(it does not import elasticd.worker), and that signal would kill it"
        )
    try:
        os.kill(pid, STACK_SIGNAL)
    except ProcessLookupError:
        return StackDump(f"{note}no stacks: pid {pid} is gone")
    except PermissionError as exc:
        return StackDump(f"{note}no stacks: cannot signal pid {pid}: {exc}")
    return StackDump(
        f"{note}sent {signal.Signals(STACK_SIGNAL).name} to pid {pid}: its faulthandler "
        "wrote the stacks of all threads to the worker's stderr log",
        to_stderr=True,
    )
