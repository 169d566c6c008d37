"""The output limits' decisions, as tables: budget, users' space, quota, when to read the disk."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from elasticd.clock import FakeClock
from elasticd.supervise.outputlimits import (
    MARGIN_MAX,
    REFRESH_BYTES,
    REFRESH_SECONDS,
    Admission,
    DiskReading,
    SpaceGuard,
    admit,
    margin_for,
    needs_reading,
    quota_room,
    room,
)

MiB = 1 << 20
GiB = 1 << 30


@pytest.mark.parametrize(
    ("size", "budget_left", "disk", "expected"),
    [
        # Nothing limits: all of it.
        (100, None, None, Admission(100, 0, None)),
        (100, 1000, (1000, "space"), Admission(100, 0, None)),
        # Exactly fits.
        (100, 100, (100, "space"), Admission(100, 0, None)),
        # The budget binds: the head is written, the rest dropped.
        (100, 40, (1000, "space"), Admission(40, 60, "budget")),
        (100, 0, None, Admission(0, 100, "budget")),
        (100, -5, None, Admission(0, 100, "budget")),  # overspent: never negative
        # The users' space binds.
        (100, 1000, (30, "space"), Admission(30, 70, "space")),
        (100, None, (0, "space"), Admission(0, 100, "space")),
        # The quota binds.
        (100, None, (10, "quota"), Admission(10, 90, "quota")),
        # A tie is the budget's: the job's own setting, and it does not heal.
        (100, 30, (30, "space"), Admission(30, 70, "budget")),
    ],
)
def test_admit_writes_the_head_and_blames_the_tighter_limit(size, budget_left, disk, expected):
    """A chunk is cut at the tightest limit, and the drop is blamed on it."""
    assert admit(size, budget_left, disk) == expected


@pytest.mark.parametrize(
    ("size", "margin"),
    [(0, 0), (64 * MiB, 64 * MiB // 100), (100 * GiB, MARGIN_MAX), (10 * (1 << 40), MARGIN_MAX)],
)
def test_margin_is_one_percent_capped(size, margin):
    """The margin left to users is 1% of the filesystem, at most MARGIN_MAX."""
    assert margin_for(size) == margin


@pytest.mark.parametrize(
    ("free", "quota", "written_since", "expected"),
    [
        # Room is the users' free space less the margin and what was written since.
        (50 * MiB, None, 0, (50 * MiB - margin_for(GiB), "space")),
        (50 * MiB, None, 10 * MiB, (40 * MiB - margin_for(GiB), "space")),
        # Only root's reserve left (f_bavail = 0): no room, never negative.
        (0, None, 0, (0, "space")),
        (5 * MiB, None, 10 * MiB, (0, "space")),
        # A quota tighter than the space binds; a looser one does not.
        (50 * MiB, 3 * MiB, 1 * MiB, (2 * MiB, "quota")),
        (50 * MiB, 20 * GiB, 0, (50 * MiB - margin_for(GiB), "space")),
        (50 * MiB, 0, 0, (0, "quota")),
    ],
)
def test_room_is_what_the_user_may_still_write(free, quota, written_since, expected):
    """Room = users' free space (f_bavail) less the margin, or the quota left if tighter."""
    reading = DiskReading(free=free, size=GiB, quota=quota, at=0.0)
    assert room(reading, written_since) == expected


@pytest.mark.parametrize(
    ("reading_at", "written_since", "now", "expected"),
    [
        (None, 0, 0.0, True),  # never read
        (10.0, 0, 10.0, False),
        (10.0, REFRESH_BYTES - 1, 10.0 + REFRESH_SECONDS / 2, False),
        (10.0, REFRESH_BYTES, 10.0, True),  # let enough through since
        (10.0, 0, 10.0 + REFRESH_SECONDS, True),  # long enough since (freed space is seen)
    ],
)
def test_the_disk_is_read_per_bytes_or_interval_not_per_chunk(
    reading_at, written_since, now, expected
):
    """The disk is read again only after REFRESH_BYTES or REFRESH_SECONDS."""
    reading = None if reading_at is None else DiskReading(GiB, GiB, None, reading_at)
    assert needs_reading(reading, written_since, now) is expected


@pytest.mark.parametrize(
    ("hard_kib", "used", "expected"),
    [(0, 123, None), (1024, 0, MiB), (1024, 1000, MiB - 1000), (1, 4096, 0)],
)
def test_quota_room_is_the_hard_limit_less_what_is_used(hard_kib, used, expected):
    """No hard limit means no quota; otherwise the KiB limit less the bytes used."""
    assert quota_room(hard_kib, used) == expected


def test_the_guard_reads_the_disk_again_only_when_due(tmp_path: Path, monkeypatch):
    """A guard counts what it let through and reads fstatvfs again per interval, not per chunk."""
    clock = FakeClock()
    guard = SpaceGuard(None, clock)
    reads = []
    real = os.fstatvfs

    def counting(fd: int) -> os.statvfs_result:
        reads.append(fd)
        return real(fd)

    monkeypatch.setattr(os, "fstatvfs", counting)
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        first, _ = guard.room(fd)
        guard.wrote(4096)
        second, _ = guard.room(fd)
        assert len(reads) == 1 and second <= first - 4096
        clock.advance(REFRESH_SECONDS)
        guard.room(fd)
        assert len(reads) == 2
    finally:
        os.close(fd)
