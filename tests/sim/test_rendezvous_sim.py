"""The rendezvous under seeded adversarial schedules (see tests/sim/rendezvous.py).

A bounded sweep runs in CI (``make sim SEEDS=N`` runs long ones); the seeds that
once found a defect are replayed on their own, each named after what it found.
"""

from __future__ import annotations

import pytest

from tests.sim.rendezvous import simulate
from tests.sim.sweep import sweep

#: Seeds that broke an invariant before the fix named beside them (issue 33).
FOUND = [
    # D1: a complete round shrunk in place when a participant's lease expired.
    pytest.param(0, None, id="D1-round-rewritten-in-place"),
    pytest.param(2, None, id="D1-ranks-with-a-gap"),
    pytest.param(11, None, id="D1-world-below-min"),
    # A wall clock stepped an hour forward timed a join out: FailJob.
    pytest.param(22, None, id="join-timeout-on-the-wall-clock"),
    # Large jobs: a stale head sent a participant of a complete round back into it.
    pytest.param(159, True, id="stale-head-rejoins-the-same-round"),
    # Large jobs: a joining node whose lease was granted anew was never placed.
    pytest.param(75, True, id="relet-lease-never-announced"),
    # Large jobs: a node killed and started again took its earlier incarnation's seat.
    pytest.param(21, True, id="restart-takes-the-old-seat"),
    # Large jobs: a head put out of order hid the closure from followers of the head.
    pytest.param(0, True, id="head-went-back-over-the-closure"),
    # Large jobs: a head lost after a round opened left its wait list waiting for ever.
    pytest.param(48, True, id="lagging-head-never-caught-up"),
]

#: Found by the 100,000-schedule sweep (100 steps, 3-6 nodes, agents that leave for good).
FOUND_IN_THE_SWEEP = [
    # A last call's deadline written by a node whose clock ran an hour ahead, then was
    # corrected: the live nodes waited out the hour.
    pytest.param(1000718, id="a-deadline-from-a-clock-an-hour-ahead"),
]


@pytest.mark.parametrize(("seed", "large"), FOUND)
def test_a_seed_that_found_a_defect_now_keeps_every_invariant(
    seed: int, large: bool | None
) -> None:
    """The schedule replays from its seed and every invariant holds to the end."""
    outcome = simulate(seed, 300, large, leaves=False)  # the schedule that found it
    assert outcome.violation is None, f"{outcome.violation}\n{outcome.tail()}"


@pytest.mark.parametrize("seed", FOUND_IN_THE_SWEEP)
def test_a_seed_the_sweep_found_now_keeps_every_invariant(seed: int) -> None:
    outcome = simulate(seed, 100, False)
    assert outcome.violation is None, f"{outcome.violation}\n{outcome.tail()}"


def test_a_seed_replays_exactly() -> None:
    """Two runs of one seed make the same trace, line for line."""
    assert simulate(5).trace == simulate(5).trace


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    ("first", "count", "large"),
    [(1000, 1200, False), (1000, 80, True)],
    ids=["3-6-nodes", "16-20-nodes"],
)
def test_a_bounded_sweep_keeps_every_invariant(first: int, count: int, large: bool) -> None:
    """Every schedule of the sweep keeps every invariant, and the cluster settles."""
    verdicts = sweep("rendezvous", first, count, 300, large)
    bad = [v for v in verdicts if not v.ok]
    assert not bad, "\n\n".join(f"seed {v.seed}: {v.summary}\n{v.tail}" for v in bad[:3])
