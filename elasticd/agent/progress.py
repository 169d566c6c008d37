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
* ``progress_timeout: "auto"``: the timeout is sized from the intervals
  between pings the monitor observes (:func:`auto_timeout`): each read that
  finds new pings gives one sample, the mean interval since the previous
  read; after :data:`AUTO_WARMUP_SAMPLES` samples the timeout is
  :data:`AUTO_MULTIPLIER` times their :data:`AUTO_PERCENTILE` percentile
  (the last :data:`AUTO_WINDOW`), never under :data:`AUTO_FLOOR_S`; before
  that (start-up, compilation, the first steps) it is
  :data:`AUTO_WARMUP_TIMEOUT_S`. The samples live in the monitor only: a
  restarted daemon (or a new attempt) warms up again.
* ``checkpoint_timeout`` (optional): while a checkpoint is in progress
  (``checkpointing()`` until ``checkpointed()``), the worker's deadline is
  the later of its usual one and ``checkpoint start + checkpoint_timeout``;
  without it, a checkpoint in progress has no deadline. A slow checkpoint is
  not a hang.

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
import math
import os
import shutil
import signal
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elasticd.clock import SYSTEM_CLOCK, Clock
from elasticd.errors import SpawnStage, WorkerSpawnError
from elasticd.goodput import Observation
from elasticd.supervise.adopt import inheritable_dup
from elasticd.supervise.env import WITHHELD
from elasticd.supervise.spawn import DEFAULT_POLICY, SpawnPolicy, track
from elasticd.tasks import race
from elasticd.worker.heartbeat import HeartbeatFile
from elasticd.worker.stacks import STACK_SIGNAL

__all__ = [
    "AUTO_FLOOR_S",
    "AUTO_MULTIPLIER",
    "AUTO_PERCENTILE",
    "AUTO_WARMUP_SAMPLES",
    "AUTO_WARMUP_TIMEOUT_S",
    "AUTO_WINDOW",
    "Beat",
    "Hang",
    "ProgressMonitor",
    "ProgressSettings",
    "StackDump",
    "auto_timeout",
    "dump_stacks",
    "next_deadline",
]

#: The longest ``dump_stacks`` output kept (characters): enough for dozens of threads.
MAX_STACKS_CHARS = 64 * 1024


#: ``progress_timeout: "auto"``: samples (mean ping intervals) needed before the sizing applies.
AUTO_WARMUP_SAMPLES = 5
#: ... and the timeout until then: start-up, compilation and first steps are slow.
AUTO_WARMUP_TIMEOUT_S = 600.0
#: The percentile of the samples the timeout is a multiple of.
AUTO_PERCENTILE = 0.95
#: The multiple.
AUTO_MULTIPLIER = 4.0
#: The least an automatic timeout is: a step a few times slower than usual is not a hang.
AUTO_FLOOR_S = 10.0
#: The most recent samples kept (per worker group).
AUTO_WINDOW = 256


@dataclass(frozen=True)
class ProgressSettings:
    """A job's progress rules; ``None`` turns a rule off."""

    progress_timeout: float | None = None
    startup_timeout: float | None = None
    auto: bool = False
    """``progress_timeout: "auto"``: sized from observed intervals (then ``progress_timeout``
    is ignored; :func:`auto_timeout` gives it)."""
    checkpoint_timeout: float | None = None

    def __post_init__(self) -> None:
        for name in ("progress_timeout", "startup_timeout", "checkpoint_timeout"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds, not {value!r}")

    @classmethod
    def of(
        cls,
        progress_timeout: float | str | None,
        startup_timeout: float | None = None,
        checkpoint_timeout: float | None = None,
    ) -> ProgressSettings:
        """From a job spec's fields (``progress_timeout`` may be ``"auto"``)."""
        auto = progress_timeout == "auto"
        return cls(
            progress_timeout=None if auto or progress_timeout is None else float(progress_timeout),
            startup_timeout=startup_timeout,
            auto=auto,
            checkpoint_timeout=checkpoint_timeout,
        )

    @property
    def enabled(self) -> bool:
        """Whether any rule is on."""
        return self.progress_timeout is not None or self.startup_timeout is not None or self.auto


def auto_timeout(samples: Sequence[float]) -> float:
    """The automatic ``progress_timeout`` for these ping intervals (seconds; pure).

    :data:`AUTO_WARMUP_TIMEOUT_S` before :data:`AUTO_WARMUP_SAMPLES`
    samples; then :data:`AUTO_MULTIPLIER` times the :data:`AUTO_PERCENTILE`
    percentile (nearest rank), floored at :data:`AUTO_FLOOR_S`.
    """
    if len(samples) < AUTO_WARMUP_SAMPLES:
        return AUTO_WARMUP_TIMEOUT_S
    ordered = sorted(samples)
    high = ordered[min(len(ordered) - 1, math.ceil(AUTO_PERCENTILE * len(ordered)) - 1)]
    return min(86_400.0, max(AUTO_FLOOR_S, AUTO_MULTIPLIER * high))


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
    step: int | None = None
    """The last step it reported (``ping(step=N)``)."""
    checkpoint_step: int | None = None
    """Its last durable checkpoint (``checkpointed(step)``)."""
    checkpoint_path: str | None = None
    checkpointing_since: float | None = None
    """When the checkpoint in progress began (monotonic); None when none is."""


@dataclass(frozen=True)
class Hang:
    """A worker that missed its deadline."""

    local_rank: int
    silent_for: float
    """Seconds since its last ping (since its start when it never pinged)."""
    never_pinged: bool
    deadline: float
    """The monotonic time it was due by."""
    rule: str = "progress_timeout"
    """The rule it broke: ``progress_timeout`` (``= auto, N s`` when sized), ``startup_timeout``,
    ``checkpoint_timeout``."""

    def describe(self) -> str:
        """One line for people."""
        if self.never_pinged:
            return (
                f"local rank {self.local_rank} has not reported progress since it started "
                f"{self.silent_for:.1f} s ago ({self.rule})"
            )
        return (
            f"local rank {self.local_rank} has reported no progress for "
            f"{self.silent_for:.1f} s ({self.rule})"
        )


def deadline_of(
    beat: Beat, settings: ProgressSettings, auto: float | None = None
) -> tuple[float, str] | None:
    """When ``beat``'s worker is due next, and the rule; None when no rule applies to it.

    ``auto``: the automatic progress timeout (:func:`auto_timeout`) when the
    settings ask for one.
    """
    if beat.last_ping is None:
        if settings.startup_timeout is None:
            return None
        return beat.started_at + settings.startup_timeout, "startup_timeout"
    timeout = settings.progress_timeout
    rule = "progress_timeout"
    if settings.auto:
        timeout = AUTO_WARMUP_TIMEOUT_S if auto is None else auto
        rule = f"progress_timeout = auto, {timeout:.1f} s"
    due = None if timeout is None else (beat.last_ping + timeout, rule)
    if beat.checkpointing_since is not None:
        # A checkpoint in progress: its own bound, and only ever later than the usual one.
        if settings.checkpoint_timeout is None:
            return None
        mine = beat.checkpointing_since + settings.checkpoint_timeout
        if due is None or mine > due[0]:
            due = (mine, "checkpoint_timeout")
    return due


def next_deadline(
    beats: Iterable[Beat], now: float, settings: ProgressSettings, auto: float | None = None
) -> tuple[float | None, Hang | None]:
    """The pure decision: ``(earliest future deadline, None)`` or ``(None, hang)``.

    A hang is reported for the worker most overdue (lowest local rank on a
    tie). ``(None, None)`` means nothing can become hung until a beat changes
    (no rule applies, or no worker is left). ``auto``: as for :func:`deadline_of`.
    """
    earliest: float | None = None
    worst: tuple[float, int, Beat, str] | None = None
    for beat in beats:
        ruled = deadline_of(beat, settings, auto)
        if ruled is None:
            continue
        due, rule = ruled
        if due <= now:
            key = (due, beat.local_rank, beat, rule)
            if worst is None or key[:2] < worst[:2]:
                worst = key
        elif earliest is None or due < earliest:
            earliest = due
    if worst is not None:
        due, _, beat, rule = worst
        since = beat.started_at if beat.last_ping is None else beat.last_ping
        return None, Hang(
            local_rank=beat.local_rank,
            silent_for=max(0.0, now - since),
            never_pinged=beat.last_ping is None,
            deadline=due,
            rule=rule,
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
        #: ``progress_timeout: "auto"``: the mean ping interval of each read that found
        #: new pings, and what each worker's last read found (count, last ping).
        self.samples: deque[float] = deque(maxlen=AUTO_WINDOW)
        self._seen: dict[int, tuple[int, float]] = {}
        self._auto: float | None = None

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
        self._seen.clear()
        self.samples.clear()
        self._auto = None

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
        now = self._clock.monotonic()
        last = min(value.last, now)
        self._sample(local_rank, value.count, last)
        since = value.checkpointing_since
        return Beat(
            local_rank,
            started,
            last,
            value.count,
            step=value.step,
            checkpoint_step=value.checkpoint_step,
            checkpoint_path=value.checkpoint_path,
            checkpointing_since=None if since is None else min(since, now),
        )

    def _sample(self, local_rank: int, count: int, last: float) -> None:
        """One interval sample for ``"auto"``: the mean gap of the pings since the last read."""
        seen = self._seen.get(local_rank)
        self._seen[local_rank] = (count, last)
        if not self.settings.auto or seen is None or count <= seen[0] or last <= seen[1]:
            return
        self.samples.append((last - seen[1]) / (count - seen[0]))
        auto = auto_timeout(self.samples)
        if auto != self._auto:
            self._auto = auto
            self._changed.set()  # the waiter sleeps until a deadline of the old timeout

    @property
    def auto(self) -> float | None:
        """The automatic progress timeout now (None unless the settings ask for one)."""
        return auto_timeout(self.samples) if self.settings.auto else None

    def observation(self, local_rank: int, clock: Clock | None = None) -> Observation:
        """The worker's progress as read now, in ``clock``'s wall time (its monotonic clock
        is this one's; default: this one), for goodput (also once it exited)."""
        clock = clock if clock is not None else self._clock
        handle = self._handles.get(local_rank)
        value = handle.read() if handle is not None else None
        if value is None or value.last is None:
            return Observation(None)
        now = clock.monotonic()
        at = clock.time() - (now - min(value.last, now))
        return Observation(at, value.step, value.checkpoint_step)

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

    def beats(self, *, finished: bool = False) -> list[Beat]:
        """The beats of every started worker that has not finished (``finished``: all)."""
        out = []
        for rank in sorted(self._started):
            if rank in self._done and not finished:
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
            now = self._clock.monotonic()
            deadline, hang = next_deadline(beats, now, self.settings, self.auto)
            if hang is not None:
                return hang
            waits: list[Awaitable[Any]] = [self._changed.wait()]
            timeout = self.auto if self.settings.auto else self.settings.progress_timeout
            if deadline is None and timeout is not None and beats:
                # A worker that has not pinged yet has no deadline (no startup_timeout),
                # but its first ping starts one; a checkpoint in progress without a
                # checkpoint_timeout ends and starts one: look again one timeout later.
                deadline = now + timeout
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
    track(proc)  # the daemon's own child: a re-exec kills it (nobody reads the dump)
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
