"""A node's worker slots as plan application holds and frees them (``node/jobs/reconcile``)."""

from __future__ import annotations

from elasticd.node.jobs.reconcile import Slots


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
