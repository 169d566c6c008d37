"""Per-job uids (``run_as = "dynamic"``): two jobs on a node never share a uid.

When every job runs as one ``run_as`` user, one job can read another's
``/proc/<pid>/environ`` (its secrets) and signal its workers: the kernel
sees one user. So, as systemd's ``DynamicUser=`` does for services, a
daemon with ``run_as = "dynamic"`` gives each job that names no ``user`` a
uid of its own from a configured range (``dynamic_uids``, by default
systemd's ``61184-65519``). The uid has no passwd entry; its gid is the
same number and it has no supplementary groups, so it reaches only what is
open to everyone and what the daemon hands it (its log folders).

Deciding (pure): :func:`choose_uid`
    A function of the job id and the uids in use on the node: the first
    free uid at or after a hash of the job id, wrapping round the range.
    Starting from the hash spreads jobs over the range (a uid just released
    is rarely the next one given) and gives a job the same uid on every node
    where that uid is free, which keeps its files on a shared file system
    its own.

In use (read): :meth:`DynamicUids.in_use`
    The uids this node's agents hold, every uid or gid of the range that a
    process still has (``/proc/<pid>/status``: real, effective, saved and
    file-system ids), so a uid is not given again while a leftover process
    of its last job lives, and every uid or gid of the range that has a
    passwd or group entry (that user's files, or that group's, must not
    become a job's).

Applying: :class:`DynamicUids`
    The agent of a job claims its uid before anything of the job runs (its
    health check included) and keeps it for every attempt on the node; it
    is released when that agent ends. A claim is idempotent: the spawn of
    each worker asks again and gets the same uid.
"""

from __future__ import annotations

import grp
import hashlib
import os
import pwd
import re
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

__all__ = [
    "DEFAULT_RANGE",
    "DynamicUids",
    "UidRange",
    "choose_uid",
    "parse_uid_range",
    "process_ids",
]

#: systemd's range for ``DynamicUser=`` (0xEF00-0xFFEF): kept free of regular users by
#: distributions, below 65534 (``nobody``) and 65535 (the 16-bit "no uid").
DEFAULT_RANGE = "61184-65519"


@dataclass(frozen=True)
class UidRange:
    """An inclusive range of uids, ``first-last``."""

    first: int
    last: int

    def __contains__(self, uid: object) -> bool:
        return isinstance(uid, int) and self.first <= uid <= self.last

    def __len__(self) -> int:
        return self.last - self.first + 1

    def __str__(self) -> str:
        return f"{self.first}-{self.last}"


def parse_uid_range(text: str) -> UidRange:
    """``"61184-65519"`` as a :class:`UidRange`; ``ValueError`` with the reason otherwise.

    Root (0), ``nobody`` (65534) and the "no uid" values (65535, 2^32-1) are
    never a job's, nor is anything past 2^31-1 (a negative ``uid_t`` to some tools).
    """
    match = re.fullmatch(r"\s*(\d{1,10})\s*-\s*(\d{1,10})\s*", text)
    if match is None:
        raise ValueError(f"{text!r} is not a range of uids like {DEFAULT_RANGE!r}")
    first, last = int(match[1]), int(match[2])
    if first > last:
        raise ValueError(f"{text!r}: the first uid is above the last")
    if first < 1 or last > 2**31 - 1:
        raise ValueError(f"{text!r}: uids must lie between 1 and {2**31 - 1}")
    for reserved in (65534, 65535):
        if first <= reserved <= last:
            raise ValueError(f"{text!r} holds {reserved} (nobody / no uid)")
    return UidRange(first, last)


def choose_uid(job_id: str, uids: UidRange, in_use: Collection[int]) -> int | None:
    """The uid of ``job_id``: the first one of ``uids`` not ``in_use`` at or after the job's
    hash, wrapping round; None when every uid of the range is in use."""
    size = len(uids)
    start = int.from_bytes(hashlib.sha256(job_id.encode()).digest()[:8], "big") % size
    for step in range(size):
        uid = uids.first + (start + step) % size
        if uid not in in_use:
            return uid
    return None


# -- /proc and the user database -------------------------------------------------------


def process_ids(proc: str = "/proc") -> Iterable[int]:
    """Every uid and gid (real, effective, saved, file system) of every process now."""
    try:
        entries = os.listdir(proc)
    except OSError:  # pragma: no cover - no /proc
        return
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"{proc}/{name}/status", "rb") as f:
                text = f.read(4096)
        except OSError:
            continue  # gone meanwhile
        for line in text.splitlines():
            if line.startswith((b"Uid:", b"Gid:")):
                yield from (int(x) for x in line.split()[1:5])


def _registered(uids: UidRange) -> set[int]:
    """The uids and gids of ``uids`` that a passwd or group entry names."""
    found = {i for entry in pwd.getpwall() for i in (entry.pw_uid, entry.pw_gid) if i in uids}
    found |= {entry.gr_gid for entry in grp.getgrall() if entry.gr_gid in uids}
    return found


@dataclass
class DynamicUids:
    """The uids this node's jobs hold; the one mutable part of ``run_as = "dynamic"``."""

    uids: UidRange
    held: dict[str, int] = field(default_factory=dict)
    """The uid of each job whose agent runs on this node."""
    scan: Callable[[], Iterable[int]] = process_ids
    """The ids processes have now (injected by the unit tests)."""
    registered: Callable[[UidRange], Collection[int]] = _registered

    def in_use(self) -> set[int]:
        """Every uid of the range that must not be given to a new job now."""
        taken = set(self.held.values())
        taken.update(uid for uid in self.scan() if uid in self.uids)
        taken.update(self.registered(self.uids))
        return taken

    def claim(self, job_id: str) -> int | None:
        """The job's uid, the one it holds already or a free one; None: the range is full."""
        uid = self.held.get(job_id)
        if uid is None:
            uid = choose_uid(job_id, self.uids, self.in_use())
            if uid is not None:
                self.held[job_id] = uid
        return uid

    def release(self, job_id: str) -> None:
        """The job's agent on this node has ended: its uid may go to another job once no
        process has it any more (:meth:`in_use` reads that from /proc)."""
        self.held.pop(job_id, None)
