"""A node's worker slots as plan application holds and frees them (``node/jobs/reconcile``)."""

from __future__ import annotations

import pytest

from elasticd.models import Job, JobSpec
from elasticd.node.jobs.documents import incarnation
from elasticd.node.jobs.reconcile import Slots, back_to_queue
from elasticd.sched.plan import FleetPlan, Placement, QueueEntry
from elasticd.states import JobState


def test_a_job_takes_the_lowest_free_slots_and_their_gpus() -> None:
    """Slots go lowest first, and a job's CUDA devices are its slots' GPUs."""
    slots = Slots(4, gpu_ids=["g0", "g1", "g2", "g3"])
    assert slots.take("a", 2) == "g0,g1"
    assert slots.take("b", 1) == "g2"
    assert (slots.free, slots.held) == ([3], {"a": [0, 1], "b": [2]})
    assert not slots.fits(2)
    assert slots.fits(1)


def test_released_slots_are_free_again_in_order() -> None:
    """Giving a job's slots back frees them, sorted, and the job holds none."""
    slots = Slots(3)
    assert slots.take("a", 2) is None  # no GPUs on this node
    slots.take("b", 1)
    slots.give_back(slots.release("a"))
    assert (slots.free, slots.held) == ([0, 1], {"b": [2]})
    assert slots.release("a") == []  # a job that holds none gives back nothing


def test_a_crashed_agents_slots_stay_taken_until_given_back() -> None:
    """Released but not given back (a dead agent's workers still stopping): not free."""
    slots = Slots(2)
    slots.take("a", 2)
    held = slots.release("a")
    assert (slots.free, slots.held) == ([], {})
    slots.give_back(held)
    assert slots.free == [0, 1]


def _job(state: JobState, created_at: float = 1.0, round_: int = 4) -> Job:
    spec = JobSpec(entrypoint="x")
    return Job(id="j", spec=spec, state=state, max_restarts=3, created_at=created_at, round=round_)


QUEUED = FleetPlan(
    queue=[
        QueueEntry(job="j", position=1, priority=0, reason="capacity", message="2 slots", since=1)
    ]
)
PLACED = FleetPlan(placements={"j": Placement(nodes=["n1"], placed_at=2.0)})
RAN = incarnation(_job(JobState.RUNNING))


@pytest.mark.parametrize("state", [JobState.RUNNING, JobState.RESTARTING])
def test_an_unplaced_live_job_goes_back_to_the_queue_uncharged(state: JobState) -> None:
    """PENDING with the queue's reason; its last round marked charged, its failure dropped."""
    assert back_to_queue(_job(state), QUEUED, RAN) == {
        "pending_failure": None,
        "charged_round": 4,
        "state": JobState.PENDING,
        "reason": "waiting in the queue: 2 slots",
    }


def test_a_pending_job_only_forgets_what_its_workers_met_on_the_way_out() -> None:
    assert back_to_queue(_job(JobState.PENDING), QUEUED, RAN) == {
        "pending_failure": None,
        "charged_round": 4,
    }


@pytest.mark.parametrize(
    ("job", "plan", "ran", "why"),
    [
        (_job(JobState.RUNNING), PLACED, RAN, "placed again by the time of the write"),
        (_job(JobState.RUNNING), None, RAN, "no plan known"),
        (_job(JobState.FAILED), QUEUED, RAN, "ended meanwhile"),
        (_job(JobState.SUCCEEDED), QUEUED, RAN, "ended meanwhile"),
        (_job(JobState.RUNNING, created_at=9.0), QUEUED, RAN, "another job of the id"),
    ],
)
def test_no_edit_when_the_write_finds_another_situation(
    job: Job, plan: FleetPlan | None, ran: str, why: str
) -> None:
    """Decided on the document written over and the plan then: nothing to write."""
    assert back_to_queue(job, plan, ran) == {}, why
