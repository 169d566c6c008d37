"""The job-document edits of a round's failures: the first in time is the cause, the rest
collateral, whatever the nodes' wall clocks say (issue 37)."""

from __future__ import annotations

import pytest

from elasticd.agent.edits import (
    in_time_order,
    record_carried_failure,
    record_failure,
    settle_failure,
)
from elasticd.models import Job, JobMutation, JobSpec, RankStack, RootCause, incarnation_tag
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


@pytest.mark.parametrize(
    ("alone", "restarts", "state", "count"),
    [
        (True, 0, JobState.FAILED, 0),  # a job of one node, no restart left: failed at once
        (True, 1, JobState.RESTARTING, 0),  # a restart left: charged when the round forms
        (False, 0, JobState.RESTARTING, 0),  # a node may yet be lost: free if so
    ],
)
def test_a_job_of_one_node_with_no_restart_left_fails_at_once(
    alone: bool, restarts: int, state: JobState, count: int
) -> None:
    """Issue 41: with `--max-restarts 0` the job said it was re-forming the group, held a
    new round, then failed. Where no participant can be lost before the next round, the
    failure is charged as it is recorded."""
    job = _job().model_copy(update={"max_restarts": restarts})
    solo = RoundInfo(
        round=3, group_rank=0, group_world_size=1, nodes=["a"], master_addr="h", master_port=1,
        participants={"a": 0},
    )  # fmt: skip
    root = _failure("a", 0.5)
    after = job.model_copy(update=dict(record_failure(solo, root, alone=alone)(job)))
    assert (after.state, after.restart_count, after.error) == (state, count, root)
    if state is JobState.FAILED:
        assert after.reason is not None and after.reason.startswith("restart budget spent (0")
        assert after.pending_failure is None and after.charged_round == 3


ALL_REDUCE = "all_reduce (distributed_c10d.py:3252) < wrapper (c10d_logger.py:83) < train (t.py:13)"
SLEEP = "slow_step (t.py:7) < train (t.py:12) < <module> (t.py:16)"


def _hang(node: str, rank: int, stack: str, since: float) -> RootCause:
    return RootCause(
        message=f"rank {rank} hung: no progress",
        node=node,
        rank=rank,
        local_rank=0,
        since_round_s=since,
        round=3,
        stacks=[RankStack(rank=rank, local_rank=0, stack=stack)],
    )


@pytest.mark.parametrize(
    ("order", "error"),
    [
        # whatever order the nodes' hangs come in, once rank 1's is in it is the cause
        (["a", "b", "c"], [("a", 0), ("b", 1), ("b", 1)]),
        (["b", "a", "c"], [("b", 1), ("b", 1), ("b", 1)]),
        (["c", "a", "b"], [("c", 2), ("c", 2), ("b", 1)]),
    ],
)
def test_a_hang_names_the_rank_whose_stack_differs(order: list[str], error: list) -> None:
    """Rank 1 asleep while ranks 0 and 2 wait in all_reduce: as the nodes' hangs are joined
    rank 1 becomes the error (on its node, with its frame), the rest collateral."""
    hangs = {
        "a": _hang("a", 0, ALL_REDUCE, 1.0),
        "b": _hang("b", 1, SLEEP, 1.1),
        "c": _hang("c", 2, ALL_REDUCE, 0.9),
    }
    job = _job()
    for node, (named_node, named_rank) in zip(order, error, strict=True):
        job = _apply(job, hangs[node])
        assert job.error is not None
        assert (job.error.node, job.error.rank) == (named_node, named_rank)
    assert job.error is not None and job.pending_failure is not None
    assert job.error.message == (
        "rank 1 on b hung in slow_step (t.py:7), while the 2 other ranks wait in "
        "all_reduce (distributed_c10d.py:3252)"
    )
    assert job.pending_failure.error == job.error
    assert job.reason == f"{job.error.message}; restarting the group"
    assert sorted(c.node for c in job.collateral) == ["a", "c"]
    assert all(c.collateral and c.stacks is None for c in job.collateral)
    assert len(job.pending_failure.failures) == 3  # each with its stacks, for the next join
    assert all(f.stacks for f in job.pending_failure.failures)


def test_a_crash_before_the_hangs_stays_the_cause() -> None:
    """The stacks of ranks that timed out after a peer crashed name no one."""
    crash = RootCause(message="Segmentation fault", node="c", rank=2, since_round_s=0.5, round=3)
    job = _apply(
        _apply(_apply(_job(), _hang("a", 0, ALL_REDUCE, 1.0)), crash), _hang("b", 1, SLEEP, 1.1)
    )
    assert job.error == crash


def _next_round(number: int) -> RoundInfo:
    return RoundInfo(
        round=number, group_rank=0, group_world_size=3, nodes=[], master_addr="h",
        master_port=1, participants={"a": 0, "b": 1, "c": 2},
    )  # fmt: skip


def _edit(job: Job, mutate: JobMutation) -> Job:
    return job.model_copy(update=dict(mutate(job)))


@pytest.mark.parametrize("landed", [False, True])
def test_a_failure_carried_across_the_reexec_is_charged_once(landed: bool) -> None:
    """The new image records the failure the re-exec cut its agent off from recording (its
    write may have landed after all: then nothing changes); the next round charges it once,
    and a record of it arriving later still (a charged round) changes nothing."""
    root = _failure("a", 0.5)
    tag = incarnation_tag(_job())
    job = _apply(_job(), root) if landed else _job()
    carried = record_carried_failure(_round(), root, alone=False, job_tag=tag)
    if landed:
        assert carried(job) == {}
    job = _edit(job, carried)
    assert job.state is JobState.RESTARTING and job.error == root
    job = _edit(job, settle_failure(_next_round(4)))
    assert (job.restart_count, job.charged_round, job.pending_failure) == (1, 3, None)
    assert carried(job) == {}
    job = _edit(job, settle_failure(_next_round(5)))
    assert job.restart_count == 1


def test_a_carried_failure_is_not_another_job_of_its_id() -> None:
    """A job deleted and submitted again under its id across the exec: not its failure."""
    root = _failure("a", 0.5)
    carried = record_carried_failure(_round(), root, alone=False, job_tag="another")
    assert carried(_job()) == {}


@pytest.mark.parametrize(
    ("settled", "count", "pending", "charged", "then"),
    [
        # The store formed the early round as predicted: recorded, charged at the next.
        (True, 1, 3, 1, 2),
        # Not formed yet at the exec: the failure before it charged, and this one at once.
        (False, 1, None, 2, 2),
        # Another restart count than predicted: not that round, never counted.
        (True, 2, None, 1, 1),
        (False, 2, 2, 0, 1),
    ],
)
def test_a_carried_failure_of_an_early_start_is_charged_once(
    settled: bool, count: int, pending: int | None, charged: int, then: int
) -> None:
    """Workers started early (round 3, predicted with restart count ``count`` after round 2
    failed), their round not confirmed at the exec, failed: where the store formed it as
    predicted the failure waits for the next round, as any; where the exec cut the
    formation short, the failure before is charged as the round would have and this one at
    once (the next image may form round 3 anew: it would never be charged there)."""
    before = _edit(_job(), record_failure(_next_round(2), _failure("a", 0.1)))
    if settled:
        before = _edit(before, settle_failure(_round()))
        assert before.restart_count == 1
    root = _failure("a", 0.5)
    tag = incarnation_tag(_job())
    carried = record_carried_failure(_round(), root, alone=False, job_tag=tag, early_count=count)
    after = _edit(before, carried)
    waiting = after.pending_failure.round if after.pending_failure is not None else None
    assert (waiting, after.restart_count) == (pending, charged)
    after = _edit(after, settle_failure(_next_round(4)))
    assert after.restart_count == then
