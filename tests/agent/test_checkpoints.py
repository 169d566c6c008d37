"""The attempt's progress record and the no-progress rule (pure tables)."""

from __future__ import annotations

import pytest

from elasticd.agent.checkpoints import close_attempt, made_progress, merge_attempt, observe
from elasticd.agent.edits import settle_failure
from elasticd.agent.progress import Beat
from elasticd.models import (
    AttemptProgress,
    Job,
    JobProgress,
    JobSpec,
    PendingFailure,
    RootCause,
)
from elasticd.rendezvous import RoundInfo
from elasticd.states import JobState


def _job(
    progress: JobProgress,
    *,
    restarts: int = 1,
    limit: int | None = 2,
    state: JobState = JobState.RESTARTING,
    pending: int | None = None,
) -> Job:
    return Job(
        id="j",
        spec=JobSpec(entrypoint="x", max_restarts=10, max_no_progress_restarts=limit),
        state=state,
        restart_count=restarts,
        max_restarts=10,
        created_at=0.0,
        pending_failure=None
        if pending is None
        else PendingFailure(round=pending, participants=["a"], error=RootCause(message="boom")),
        progress=progress,
    )


def _round(n: int) -> RoundInfo:
    return RoundInfo(
        round=n,
        group_rank=0,
        group_world_size=1,
        nodes=[],
        master_addr="h",
        master_port=1,
        participants={"a": 0},
    )


def test_observe_keeps_the_highest_step_and_checkpoint_and_wall_times() -> None:
    """Beats fold into the record: max step, the newest checkpoint with its path, first/last
    ping in wall time, and the earliest checkpoint in progress (None once none is)."""
    start = AttemptProgress(round=3, started_from=10)
    beats = [
        Beat(0, 0.0, 5.0, 4, step=14, checkpoint_step=12, checkpoint_path="/c12"),
        Beat(1, 0.0, 6.0, 4, step=13, checkpoint_step=11, checkpointing_since=5.5),
        Beat(2, 0.0, None),
    ]
    got = observe(start, beats, wall_offset=1000.0)
    assert (got.max_step, got.checkpoint_step, got.checkpoint_path) == (14, 12, "/c12")
    assert (got.first_step_at, got.last_step_at) == (1005.0, 1006.0)
    assert got.checkpointing_since == 1005.5 and got.started_from == 10
    later = observe(got, [Beat(0, 0.0, 7.0, 5, step=9)], wall_offset=1000.0)
    assert later.max_step == 14 and later.checkpoint_step == 12  # never backwards
    assert later.checkpointing_since is None and later.first_step_at == 1005.0


@pytest.mark.parametrize(
    ("attempt", "earlier_max", "checkpoints", "expected"),
    [
        (None, None, False, False),  # nothing reported
        (AttemptProgress(round=1, checkpoint_step=5), None, True, True),  # first checkpoint
        (AttemptProgress(round=1, started_from=5, checkpoint_step=5), 9, True, False),
        (AttemptProgress(round=1, started_from=5, checkpoint_step=8), 9, True, True),
        # A checkpointing job: steps past the best do not count without a checkpoint.
        (AttemptProgress(round=1, started_from=5, max_step=20), 9, True, False),
        # A job that never checkpoints: a step past every earlier attempt's.
        (AttemptProgress(round=1, max_step=20), 9, False, True),
        (AttemptProgress(round=1, max_step=9), 9, False, False),
        (AttemptProgress(round=1, max_step=0), None, False, True),
        (AttemptProgress(round=1), None, False, False),
    ],
)
def test_made_progress(
    attempt: AttemptProgress | None, earlier_max: int | None, checkpoints: bool, expected: bool
) -> None:
    """Progress: a checkpoint past the start; without checkpoints, a step past the best."""
    assert made_progress(attempt, earlier_max, checkpoints=checkpoints) is expected


def test_close_attempt_counts_restarts_in_a_row_and_stops_at_the_limit() -> None:
    """No progress adds one (only for an attempt that was a restart); progress resets; the
    limit gives the reason, naming the setting and the last checkpoint."""
    stuck = AttemptProgress(round=4, started_from=5, max_step=7)
    p = JobProgress(checkpoint_step=5, max_step=9, attempt=stuck, no_progress_restarts=0)
    new, reason = close_attempt(_job(p), 4)
    assert new.no_progress_restarts == 1 and reason is None and new.max_step == 9
    new, reason = close_attempt(_job(new), 4)
    assert new.no_progress_restarts == 2
    assert reason == (
        "no progress in 2 restarts in a row (max_no_progress_restarts = 2): "
        "the last checkpoint is step 5"
    )
    # The first attempt (no restart spent before it) is no restart that failed.
    new, reason = close_attempt(_job(p, restarts=0), 4)
    assert new.no_progress_restarts == 0 and reason is None
    # Progress resets the count; no limit never stops.
    moved = p.model_copy(
        update={
            "attempt": stuck.model_copy(update={"checkpoint_step": 6}),
            "no_progress_restarts": 1,
        }
    )
    assert close_attempt(_job(moved), 4)[0].no_progress_restarts == 0
    assert (
        close_attempt(_job(p.model_copy(update={"no_progress_restarts": 50}), limit=None), 4)[1]
        is None
    )
    # A report of another round is no report of this one: no progress.
    assert close_attempt(_job(moved), 5)[0].no_progress_restarts == 2


def test_settle_failure_fails_the_job_for_no_progress_before_the_budget() -> None:
    """The charged failure of a stuck restart fails the job with the rule's reason."""
    stuck = AttemptProgress(round=4, started_from=5)
    p = JobProgress(checkpoint_step=5, attempt=stuck, no_progress_restarts=1)
    edit = settle_failure(_round(5))(_job(p, restarts=2, pending=4))
    assert edit["state"] is JobState.FAILED
    assert edit["reason"] is not None and edit["reason"].startswith("no progress in 2 restarts")
    assert "root cause: a worker: boom" in edit["reason"] and "None" not in edit["reason"]
    assert edit["progress"].no_progress_restarts == 2
    assert "restart_count" not in edit


def test_merge_attempt_joins_nodes_and_moves_the_checkpoint_forward_only() -> None:
    """Two nodes' reports of one round combine; a newer round replaces the attempt (its max
    step joins the job's); an older report only adds; the checkpoint never goes back."""
    job = _job(JobProgress(), state=JobState.RUNNING)
    a = AttemptProgress(
        round=2, started_from=None, max_step=10, checkpoint_step=8, checkpoint_path="/8"
    )
    edit = merge_attempt(a, now=50.0)(job)
    p = edit["progress"]
    assert (p.checkpoint_step, p.checkpoint_path, p.checkpoint_at) == (8, "/8", 50.0)
    job = job.model_copy(update={"progress": p})
    b = AttemptProgress(round=2, max_step=12, checkpoint_step=6, first_step_at=1.0)
    p = merge_attempt(b, now=60.0)(job)["progress"]
    assert p.attempt is not None
    assert (p.attempt.max_step, p.attempt.checkpoint_step, p.attempt.first_step_at) == (12, 8, 1.0)
    assert p.checkpoint_step == 8 and p.checkpoint_at == 50.0
    job = job.model_copy(update={"progress": p})
    newer = AttemptProgress(round=3, started_from=8, max_step=3)
    p = merge_attempt(newer, now=70.0)(job)["progress"]
    assert p.attempt == newer and p.max_step == 12
    job = job.model_copy(update={"progress": p})
    late = AttemptProgress(round=2, max_step=15, checkpoint_step=14, checkpoint_path="/14")
    p = merge_attempt(late, now=80.0)(job)["progress"]
    assert p.attempt == newer and p.max_step == 15 and p.checkpoint_step == 14
    assert merge_attempt(newer, now=90.0)(job.model_copy(update={"progress": p})) == {}
    done = job.model_copy(update={"state": JobState.SUCCEEDED})
    assert merge_attempt(late, now=90.0)(done) == {}
