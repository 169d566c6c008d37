"""The fleet scheduler under seeded churn (see tests/sim/fleet.py)."""

from __future__ import annotations

import pytest

from elasticd.sched.plan import Demand, FleetPlan, NodeCapacity, Placement
from tests.sim.fleet import _check, simulate_fleet
from tests.sim.sweep import sweep


def test_the_checks_catch_a_plan_that_breaks_them() -> None:
    """Each invariant fails on a plan made to break it (the sweep can fail)."""
    nodes = {"h0": NodeCapacity("h0", 2), "h1": NodeCapacity("h1", 2)}
    jobs = {"a": Demand("a", nproc=2, min_nodes=2, max_nodes=2), "b": Demand("b", nproc=1)}
    overfull = FleetPlan(
        placements={
            "a": Placement(nodes=["h0", "h1"], placed_at=0),
            "b": Placement(nodes=["h0"], placed_at=0),
        }
    )
    assert "holds 3 slots of 2" in (_check(overfull, jobs, nodes, FleetPlan()) or "")
    half_gang = FleetPlan(placements={"a": Placement(nodes=["h0"], placed_at=0)})
    assert "runs on 1 nodes" in (_check(half_gang, jobs, nodes, FleetPlan()) or "")
    assert "neither placed nor queued" in (_check(FleetPlan(), jobs, nodes, FleetPlan()) or "")


def test_a_fleet_schedule_replays_exactly() -> None:
    assert simulate_fleet(3).trace == simulate_fleet(3).trace


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_bounded_fleet_sweep_keeps_every_invariant() -> None:
    """Every schedule keeps slots, gangs, preemptions and the queue right, and settles."""
    verdicts = sweep("fleet", 0, 150, 200, None)
    bad = [v for v in verdicts if not v.ok]
    assert not bad, "\n\n".join(f"seed {v.seed}: {v.summary}\n{v.tail}" for v in bad[:3])
