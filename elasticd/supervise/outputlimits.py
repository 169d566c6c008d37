"""How much of a worker's output may still be written: its budget, and the disk as its user sees it.

The daemon appends worker output to log files as root, and root may write
where the job's user could not: into ext4's root reserve (``f_bfree -
f_bavail``, kept so that root's own services still work on a disk users have
filled) and past the user's disk quota (root holds CAP_SYS_RESOURCE, which
the quota code honours). Four workers printing in a loop once took a disk's
reserve down to 17% in seconds. So the daemon limits itself to what the
job's user could write, and to a budget:

* the attempt's budget: ``log_limit_bytes`` per stream of each worker
  (:class:`~elasticd.models.JobSpec`, 1 GiB by default);
* the space unprivileged users have left on the log filesystem
  (``fstatvfs().f_bavail``), less a margin (:func:`margin_for`);
* the room under the job user's (and group's) hard block quota, where quotas
  are on for that filesystem (``quotactl_fd(Q_GETQUOTA)``; a kernel without
  quota support has no quota to respect).

Past any of them the output is still read from the pipe (the worker never
blocks on it), counted and dropped; :mod:`elasticd.supervise.output` applies
this. Reading the disk costs system calls, so it is not done per chunk: a
:class:`SpaceGuard` reads it once, subtracts what it lets through, and reads
again after :data:`REFRESH_BYTES` or :data:`REFRESH_SECONDS`. Other writers
on the filesystem are seen at the next reading; the margin covers what they
write in between.

Decisions are pure (:func:`needs_reading`, :func:`room`, :func:`admit`); the
guard only reads the disk and applies them.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
from dataclasses import dataclass
from typing import Literal

from elasticd.clock import SYSTEM_CLOCK, Clock

__all__ = [
    "MARGIN_MAX",
    "REFRESH_BYTES",
    "REFRESH_SECONDS",
    "Admission",
    "DiskReading",
    "Limit",
    "SpaceGuard",
    "admit",
    "margin_for",
    "needs_reading",
    "quota_room",
    "room",
]

log = logging.getLogger(__name__)

#: Which limit stopped output: the attempt's budget, the space users have, the user's quota.
Limit = Literal["budget", "space", "quota"]

#: The disk is read again once this much was let through since the last reading ...
REFRESH_BYTES = 8 << 20
#: ... or this long after it, whichever comes first (also how soon freed space is seen).
REFRESH_SECONDS = 1.0
#: At most this much of the users' space is left unwritten (see :func:`margin_for`).
MARGIN_MAX = 64 << 20


@dataclass(frozen=True)
class DiskReading:
    """What the job's user may still write on the log filesystem, read at ``at`` (monotonic)."""

    free: int
    """Bytes unprivileged users may still allocate: ``f_bavail * f_frsize``."""
    size: int
    """The filesystem's size in bytes (``f_blocks * f_frsize``), for the margin."""
    quota: int | None
    """Bytes left under the job user's hard block quota; None where no quota applies."""
    at: float


@dataclass(frozen=True)
class Admission:
    """How much of a chunk is written, and why the rest (``dropped``) is not."""

    keep: int
    dropped: int
    limit: Limit | None
    """What stopped the rest (None when nothing was dropped)."""


def margin_for(size: int) -> int:
    """Space left to users: 1% of the filesystem, at most :data:`MARGIN_MAX`.

    It covers what other writers (and the filesystem's own metadata) take
    between two readings, so the daemon stops before users' space runs out,
    not after.
    """
    return min(MARGIN_MAX, max(size, 0) // 100)


def needs_reading(reading: DiskReading | None, written_since: int, now: float) -> bool:
    """True when the disk must be read again before admitting more output."""
    if reading is None:
        return True
    return written_since >= REFRESH_BYTES or now - reading.at >= REFRESH_SECONDS


def room(reading: DiskReading, written_since: int) -> tuple[int, Limit]:
    """Bytes that may still be written since ``reading``, and which of space or quota binds."""
    space = reading.free - margin_for(reading.size) - written_since
    if reading.quota is not None:
        quota = reading.quota - written_since
        if quota < space:
            return max(quota, 0), "quota"
    return max(space, 0), "space"


def admit(size: int, budget_left: int | None, disk: tuple[int, Limit] | None) -> Admission:
    """How much of a ``size``-byte chunk to write under the budget and the disk's room.

    The rest is blamed on the tighter limit (the budget when they tie: it is
    the job's own setting, and it does not heal by itself).
    """
    limits: list[tuple[int, int, Limit]] = []
    if budget_left is not None:
        limits.append((max(budget_left, 0), 0, "budget"))
    if disk is not None:
        limits.append((disk[0], 1, disk[1]))
    if not limits:
        return Admission(size, 0, None)
    allowed, _, limit = min(limits)
    if allowed >= size:
        return Admission(size, 0, None)
    return Admission(allowed, size - allowed, limit)


def quota_room(hard_limit_kib: int, used_bytes: int) -> int | None:
    """Bytes left under a hard block limit (in 1 KiB quota blocks); None when there is no limit."""
    if hard_limit_kib <= 0:
        return None
    return max(hard_limit_kib * 1024 - used_bytes, 0)


class SpaceGuard:
    """The disk room of one job user on one filesystem, shared by the log files of an attempt.

    :meth:`room` is asked before each chunk with the descriptor of the file
    it goes to (the disk is read through that descriptor, never a path the
    job's user could swap); :meth:`wrote` is told what was written.
    """

    def __init__(self, owner: tuple[int, int] | None, clock: Clock = SYSTEM_CLOCK) -> None:
        self._owner = owner
        self._clock = clock
        self._reading: DiskReading | None = None
        self._written_since = 0
        self._quota_works = owner is not None

    def room(self, fd: int) -> tuple[int, Limit]:
        now = self._clock.monotonic()
        if needs_reading(self._reading, self._written_since, now):
            try:
                self._reading = self._read(fd, now)
                self._written_since = 0
            except OSError as exc:
                # The write itself will say what is wrong with this filesystem.
                log.debug("cannot read the log filesystem's free space: %s", exc)
                self._reading = None
                return (1 << 62), "space"
        assert self._reading is not None
        return room(self._reading, self._written_since)

    def wrote(self, n: int) -> None:
        self._written_since += n

    def _read(self, fd: int, now: float) -> DiskReading:
        st = os.fstatvfs(fd)
        return DiskReading(
            free=st.f_bavail * st.f_frsize,
            size=st.f_blocks * st.f_frsize,
            quota=self._quota(fd),
            at=now,
        )

    def _quota(self, fd: int) -> int | None:
        """The tighter of the user's and the group's hard block quota room, None without one."""
        if not self._quota_works or self._owner is None:
            return None
        rooms: list[int] = []
        for kind, ident in ((_USRQUOTA, self._owner[0]), (_GRPQUOTA, self._owner[1])):
            try:
                hard_kib, used = _get_quota(fd, kind, ident)
            except OSError as exc:
                if exc.errno in (errno.ENOSYS, errno.EPERM):
                    self._quota_works = False  # no quota support, or not allowed: never again
                    return None
                continue  # ESRCH (quotas off), ENOENT, EINVAL: no quota of this kind here
            left = quota_room(hard_kib, used)
            if left is not None:
                rooms.append(left)
        return min(rooms) if rooms else None


# quotactl_fd(2) (Linux 5.14+; the same number on every architecture but alpha).
_SYS_QUOTACTL_FD = 443
_Q_GETQUOTA = 0x800007
_USRQUOTA = 0
_GRPQUOTA = 1


class _IfDqblk(ctypes.Structure):
    _fields_ = [
        ("dqb_bhardlimit", ctypes.c_uint64),
        ("dqb_bsoftlimit", ctypes.c_uint64),
        ("dqb_curspace", ctypes.c_uint64),
        ("dqb_ihardlimit", ctypes.c_uint64),
        ("dqb_isoftlimit", ctypes.c_uint64),
        ("dqb_curinodes", ctypes.c_uint64),
        ("dqb_btime", ctypes.c_uint64),
        ("dqb_itime", ctypes.c_uint64),
        ("dqb_valid", ctypes.c_uint32),
    ]


_libc: ctypes.CDLL | None = None


def _get_quota(fd: int, kind: int, ident: int) -> tuple[int, int]:
    """``(hard block limit in KiB, bytes used)`` of user or group ``ident`` where ``fd`` lies."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    block = _IfDqblk()
    cmd = (_Q_GETQUOTA << 8) | kind  # QCMD(Q_GETQUOTA, kind)
    result = _libc.syscall(
        ctypes.c_long(_SYS_QUOTACTL_FD),
        ctypes.c_uint(fd),
        ctypes.c_uint(cmd),
        ctypes.c_int(ident),
        ctypes.byref(block),
    )
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(block.dqb_bhardlimit), int(block.dqb_curspace)
