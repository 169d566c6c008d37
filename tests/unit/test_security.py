"""Which state paths a daemon refuses to use: pure tables of ``security.ownership_problem``
and ``security.parent_problem`` (issue 35, finding 4)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from elasticd.security import ownership_problem, parent_problem

ME = 0


def st(uid: int, mode: int) -> os.stat_result:
    return os.stat_result((mode, 0, 0, 1, uid, 0, 0, 0, 0, 0))


DIR, REG, LNK = stat.S_IFDIR, stat.S_IFREG, stat.S_IFLNK


@pytest.mark.parametrize(
    ("found", "refused"),
    [
        (None, None),  # missing: the daemon makes it
        (st(ME, DIR | 0o700), None),
        (st(ME, DIR | 0o711), None),
        (st(ME, REG | 0o600), None),
        (st(1001, DIR | 0o700), "belongs to uid 1001 (alice)"),
        (st(1001, REG | 0o600), "belongs to uid 1001 (alice)"),
        (st(ME, DIR | 0o777), "writable by its group or others (mode 0777"),
        (st(ME, DIR | 0o770), "chmod go-w"),
        (st(ME, REG | 0o602), "writable by its group or others"),
        (st(1001, LNK | 0o777), "symbolic link"),
    ],
)
def test_a_state_path_must_be_the_daemons_own_and_private(
    found: os.stat_result | None, refused: str | None
) -> None:
    problem = ownership_problem(Path("/x"), found, ME, what="state folder", owners="alice")
    if refused is None:
        assert problem is None
    else:
        assert problem is not None and refused in problem and "/x" in problem


@pytest.mark.parametrize(
    ("found", "refused"),
    [
        (st(0, DIR | 0o755), None),
        (st(0, DIR | 0o1777), None),  # /tmp: nobody may rename what root made there
        (st(1001, DIR | 0o755), "belongs to uid 1001"),
        (st(1001, DIR | 0o1777), "belongs to uid 1001"),
        (st(0, DIR | 0o777), "without the sticky bit"),
        (st(0, DIR | 0o775), "without the sticky bit"),
    ],
)
def test_a_parent_of_the_state_must_not_let_others_swap_it(
    found: os.stat_result, refused: str | None
) -> None:
    problem = parent_problem(Path("/p"), found, ME, what="state folder")
    if refused is None:
        assert problem is None
    else:
        assert problem is not None and refused in problem
