"""The job-document edits of a round's failures: the first in time is the cause, the rest
collateral, whatever the nodes' wall clocks say (issue 37)."""

from __future__ import annotations

import pytest

from elasticd.agent.edits import in_time_order, record_failure
from elasticd.models import Job, JobSpec, RootCause
from elasticd.rendezvous import RoundInfo
from elasticd.states import JobState

WALL = 1_700_000_000.0


def _failure(node: str, since: float | None, wall: float = WALL) -> RootCause:
    return RootCause(
        message=f"{node} failed", node=node, rank=0, since_round_s=since, timestamp=wall, round=3
    )


@pytest.mark.parametrize(
    ("recorded", "expected"),
    [
        ([], []),
        # The monotonic time since the round formed decides, not the order recorded...
        ([("b", 2.0), ("a", 1.0)], ["a", "b"]),
        # ...nor a wall clock an hour behind (b's) or ahead.
        ([("a", 1.0, WALL), ("b", 1.5, WALL - 3600)], ["a", "b"]),
        ([("a", 1.0, WALL + 3600), ("b", 1.5, WALL)], ["a", "b"]),
        # An exact tie and failures without the reference keep the store's order.
        ([("b", 1.0), ("a", 1.0)], ["b", "a"]),
        ([("c", None), ("b", 5.0), ("a", None)], ["b", "c", "a"]),
    ],
)
def test_in_time_order(recorded: list[tuple], expected: list[str]) -> None:
    """Ordered by `since_round_s`, then by the store's order; wall clocks never compared."""
    failures = [_failure(*r) for r in recorded]
    assert [f.node for f in in_time_order(failures)] == expected


def _job(state: JobState = JobState.RUNNING) -> Job:
    return Job(
        id="j",
        spec=JobSpec(entrypoint="x", max_restarts=3),
        state=state,
        max_restarts=3,
        created_at=0.0,
    )


def _round() -> RoundInfo:
    return RoundInfo(
        round=3,
        group_rank=0,
        group_world_size=3,
        nodes=[],
        master_addr="h",
        master_port=1,
        participants={"a": 0, "b": 1, "c": 2},
    )


def _apply(job: Job, root: RootCause) -> Job:
    return job.model_copy(update=dict(record_failure(_round(), root)(job)))


def test_the_first_failure_in_time_is_the_cause_and_the_rest_collateral() -> None:
    """A survivor recorded first (its clock behind) is collateral once the culprit's comes in."""
    survivor = _failure("b", 0.9, WALL - 3600)  # "connection reset", its clock an hour behind
    job = _apply(_job(), survivor)
    assert job.state is JobState.RESTARTING and job.error == survivor and job.collateral == []
    culprit = _failure("a", 0.5)
    job = _apply(job, culprit)
    assert job.error == culprit
    assert [(c.node, c.collateral) for c in job.collateral] == [("b", True)]
    assert job.reason is not None and job.reason.startswith("rank 0 (node a) failed")
    job = _apply(job, _failure("c", 1.2, WALL + 3600))
    assert job.error == culprit
    assert [(c.node, c.collateral) for c in job.collateral] == [("b", True), ("c", True)]
    assert job.pending_failure is not None
    assert [f.node for f in job.pending_failure.failures] == ["b", "a", "c"]  # store's order
    assert record_failure(_round(), _failure("a", 0.1))(job) == {}  # a node's one failure
