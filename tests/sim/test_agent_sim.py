"""The agent's machine under a seeded walk (see tests/sim/agent.py)."""

from __future__ import annotations

from elasticd.agent import machine as m
from elasticd.eventkinds import EventKind
from elasticd.rendezvous import Change
from tests.sim.agent import _check, simulate_agent
from tests.sim.sweep import sweep


def test_the_checks_catch_a_step_that_breaks_them() -> None:
    """Each invariant fails on a step made to break it (the sweep can fail)."""
    running = m.AgentState(phase=m.Phase.RUNNING)
    changed = m.RoundChanged(Change.LOSS)
    charged = (m.RecordFailure(changed, 0.0),)  # type: ignore[arg-type]
    assert "recorded as a failure" in (_check(running, changed, running, charged, 0, 3) or "")
    failed = (m.FailJob(EventKind.WORKERS_STOPPED, "x"),)
    assert "not its own failure" in (_check(running, changed, running, failed, 0, 3) or "")


def test_a_walk_replays_exactly() -> None:
    assert simulate_agent(9).trace == simulate_agent(9).trace


def test_a_sweep_of_the_agent_machine_keeps_every_invariant() -> None:
    verdicts = sweep("agent", 0, 3000, 300, None)
    bad = [v for v in verdicts if not v.ok]
    assert not bad, "\n\n".join(f"seed {v.seed}: {v.summary}\n{v.tail}" for v in bad[:3])
