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
    ("found", "refused", "trusted"),
    [
        (st(0, DIR | 0o755), None, False),
        (st(0, DIR | 0o1777), None, False),  # /tmp: nobody may rename what root made there
        (st(1001, DIR | 0o755), "belongs to uid 1001", False),
        (st(1001, DIR | 0o1777), "belongs to uid 1001", False),
        (st(0, DIR | 0o777), "without the sticky bit", False),
        (st(0, DIR | 0o775), "without the sticky bit", False),
        # A trusted group's write bit (Ubuntu's /var/log, 0775 root:syslog) is no way in;
        # the world's still is.
        (st(0, DIR | 0o775), None, True),
        (st(0, DIR | 0o777), "without the sticky bit", True),
    ],
)
def test_a_parent_of_the_state_must_not_let_others_swap_it(
    found: os.stat_result, refused: str | None, trusted: bool
) -> None:
    problem = parent_problem(Path("/p"), found, ME, what="state folder", group_trusted=trusted)
    if refused is None:
        assert problem is None
    else:
        assert problem is not None and refused in problem


def test_a_root_folder_of_a_system_group_is_trusted_and_a_users_group_is_not() -> None:
    """Ubuntu's /var/log (root, group syslog) is trusted; a root folder whose group holds
    ordinary users (gid 1000 and up, not the owner's private group) is not."""
    from elasticd.security import trusted_group

    assert trusted_group(os.stat_result((DIR | 0o775, 0, 0, 1, 0, 4, 0, 0, 0, 0)))
    assert not trusted_group(os.stat_result((DIR | 0o775, 0, 0, 1, 0, 54321, 0, 0, 0, 0)))
