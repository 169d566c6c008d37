"""The log retention decision (issue 23 item 7): newest attempts, a byte bound, never a running one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from elasticd.logs import LogLayout, attempts_to_remove


@pytest.mark.parametrize(
    ("attempts", "keep", "keep_bytes", "running", "removed"),
    [
        ([(0, 10), (1, 10), (2, 10)], 5, 0, None, []),  # within the bound
        ([(0, 10), (1, 10), (2, 10), (3, 10)], 2, 0, None, [0, 1]),  # the newest two stay
        ([(0, 10), (1, 10), (2, 10), (3, 10)], 2, 0, 3, [0, 1]),  # the running one is among them
        ([(0, 10), (1, 10), (2, 10), (3, 10)], 1, 0, 2, [0, 1]),  # running: it and newer stay
        ([(0, 50), (1, 50), (2, 50)], 3, 60, None, [0, 1]),  # bytes: the oldest go
        ([(0, 50), (1, 50), (2, 500)], 3, 60, None, [0, 1]),  # the newest finished stays
        ([(0, 50), (1, 50), (2, 500)], 3, 60, 2, [0]),  # running 2: 1 is the newest finished
        ([(5, 1), (3, 1), (4, 1)], 1, 0, None, [3, 4]),  # order does not matter
    ],
)
def test_attempts_to_remove(
    attempts: list[tuple[int, int]],
    keep: int,
    keep_bytes: int,
    running: int | None,
    removed: list[int],
) -> None:
    """Which attempt folders a retention pass removes."""
    assert attempts_to_remove(attempts, keep, keep_bytes, running) == removed


def test_retain_removes_folders_and_follows_no_link(tmp_path: Path) -> None:
    """retain() removes whole attempt folders; a link a job left in one is removed, not followed."""
    layout = LogLayout(tmp_path / "logs")
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "keep.txt").write_text("x")
    for n in range(4):
        worker = layout.worker_dir("j", n, 0)
        worker.mkdir(parents=True)
        (worker / "stdout.log").write_text("out" * n)
    os.symlink(outside, layout.worker_dir("j", 0, 0) / "escape")
    assert layout.retain("j", keep_attempts=1, keep_bytes=0, running=True) == [0, 1, 2]
    assert layout.attempts("j") == [3]
    assert (outside / "keep.txt").read_text() == "x"
