"""Whose fault a failed start is, and when the node retries or gives the job back (pure tables)."""

from __future__ import annotations

import errno

import pytest

from api.protocol import connection_cap
from elasticd.agent.nodefail import (
    GiveBack,
    Retry,
    RetrySettings,
    Side,
    cause_of,
    classify,
    decide_retry,
    side_of,
)
from elasticd.errors import SpawnStage, WorkerSpawnError

S = SpawnStage
NODE, JOB = Side.NODE, Side.JOB


@pytest.mark.parametrize(
    ("stage", "code", "side"),
    [
        # The node ran out of something: its own, wherever it happened.
        (S.FORK, errno.EMFILE, NODE),
        (S.FORK, errno.ENFILE, NODE),
        (S.FORK, errno.EAGAIN, NODE),  # fork: RLIMIT_NPROC, pids.max
        (S.FORK, errno.ENOMEM, NODE),
        (S.LOGS, errno.EMFILE, NODE),  # the output pipes
        (S.LOGS, errno.ENOSPC, NODE),  # the node's disk
        (S.HEARTBEAT, errno.EMFILE, NODE),
        (S.DAEMON, errno.EMFILE, NODE),
        (None, errno.EMFILE, NODE),  # an unknown stage, but an exhausted resource
        # The daemon's own machinery: the node's, whatever the error.
        (S.CGROUP, errno.ENOENT, NODE),  # the attempt's cgroup tree was removed
        (S.JOIN_CGROUP, errno.ENOENT, NODE),
        (S.JOIN_CGROUP, errno.EACCES, NODE),
        (S.STAGE, None, NODE),  # the root stage could not run a step
        (S.TOKEN, errno.EACCES, NODE),
        (S.DAEMON, None, NODE),
        (S.FORK, errno.ENOENT, NODE),  # the daemon's own wrapper is missing
        # The job's own: fails as before.
        (S.FORK, errno.E2BIG, JOB),  # its arguments and environment are too large
        (S.FORK, None, JOB),  # a NUL in its environment (ValueError)
        (S.PROGRAM, errno.ENOENT, JOB),
        (S.PROGRAM, errno.EACCES, JOB),
        (S.PROGRAM, None, JOB),  # not on its PATH
        (S.CWD, errno.ENOENT, JOB),
        (S.CWD, errno.EACCES, JOB),  # a cwd its user cannot enter
        (S.CWD, errno.ENOTDIR, JOB),
        (S.USER, None, JOB),  # a refused user
        (S.LOGS, errno.ELOOP, JOB),  # a link put in place of its log file
        (S.LOGS, None, JOB),
        (S.HEARTBEAT, errno.EEXIST, JOB),
        (S.PLAN, None, JOB),
        (None, None, JOB),  # unknown: as before issue 23
        (None, errno.EACCES, JOB),
    ],
)
def test_classify(stage: SpawnStage | None, code: int | None, side: Side) -> None:
    """Each failed start is the node's or the job's as the table says."""
    assert classify(stage, code) is side


def test_an_error_carries_its_stage_and_the_errno_of_its_cause() -> None:
    """A spawn error re-raised with a rank prefix keeps what classifies it."""
    try:
        try:
            raise OSError(errno.EMFILE, "Too many open files")
        except OSError as cause:
            raise WorkerSpawnError("cannot start 'x'", stage=S.FORK) from cause
    except WorkerSpawnError as exc:
        wrapped = WorkerSpawnError(f"local rank 0: {exc}", stage=exc.stage, errno=exc.errno)
    assert wrapped.errno == errno.EMFILE
    assert side_of(wrapped) is NODE
    assert cause_of(wrapped) == "EMFILE"
    assert cause_of(WorkerSpawnError("x", stage=S.CGROUP)) == "cgroup"
    assert side_of(WorkerSpawnError("x")) is JOB


SETTINGS = RetrySettings(grace=10.0, first_delay=0.25, max_delay=2.0)


@pytest.mark.parametrize(
    ("tries", "now", "expected"),
    [
        (1, 100.0, Retry(0.25)),  # the first failure: a short wait
        (2, 100.3, Retry(0.5)),
        (3, 100.8, Retry(1.0)),
        (4, 101.8, Retry(2.0)),
        (5, 103.8, Retry(2.0)),  # capped
        (40, 105.0, Retry(2.0)),  # no overflow however many tries
        (9, 109.5, Retry(0.5)),  # the last wait ends at the grace: one more try there
        (10, 110.0, GiveBack(10.0)),  # a failure at the grace gives the job back
        (11, 125.0, GiveBack(25.0)),
    ],
)
def test_decide_retry(tries: int, now: float, expected: Retry | GiveBack) -> None:
    """Backoff doubles to its cap, never past the grace; at the grace the job is given back."""
    assert decide_retry(100.0, tries, now, SETTINGS) == expected


def test_a_grace_of_zero_gives_back_at_the_first_failure() -> None:
    """node_failure_grace = 0: no retry at all."""
    assert decide_retry(5.0, 1, 5.0, RetrySettings(grace=0.0)) == GiveBack(0.0)


def test_decide_retry_refuses_zero_tries() -> None:
    with pytest.raises(ValueError, match="tries"):
        decide_retry(0.0, 0, 0.0, SETTINGS)


@pytest.mark.parametrize(
    ("limit", "cap"),
    [(16, 8), (48, 24), (64, 32), (1024, 512), (4096, 1000), (1 << 20, 1000), (3, 8)],
)
def test_connection_cap(limit: int, cap: int) -> None:
    """Half the descriptor limit, at most 1000, at least 8."""
    assert connection_cap(limit) == cap
