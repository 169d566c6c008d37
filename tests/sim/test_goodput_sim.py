"""Goodput's accounting under seeded timelines (see tests/sim/goodput.py)."""

from __future__ import annotations

from elasticd.goodput import Goodput, GoodputSteps
from tests.sim.goodput import _check, simulate_goodput
from tests.sim.sweep import sweep


def _figures(**overrides: object) -> Goodput:
    base: dict[str, object] = {
        "job_id": "job", "as_of": 0.0, "finished": True, "wall_s": 10.0, "productive_s": 6.0,
        "goodput": 0.6, "badput_s": {"queue": 4.0}, "attempts": 0, "steps_reported": False,
        "lost_work_known": True,
        "steps": GoodputSteps(max_step=None, checkpoint_step=None, lost_steps=None, failures=0),
    }  # fmt: skip
    return Goodput.model_validate({**base, **overrides})


def test_the_checks_catch_figures_that_break_them() -> None:
    """Each promise fails on figures made to break it (the sweep can fail); the old
    accounting (before issue 33) broke 119 of 500 of these timelines."""
    assert _check(_figures(), []) is not None  # productive time with no progress at all
    assert "negative" in (_check(_figures(wall_s=-3583.0), []) or "")
    assert "add up" in (_check(_figures(wall_s=12.0), []) or "")


def test_a_timeline_replays_exactly() -> None:
    assert simulate_goodput(4).trace == simulate_goodput(4).trace


def test_a_sweep_of_goodput_timelines_keeps_every_promise() -> None:
    verdicts = sweep("goodput", 0, 2000, 300, None)
    bad = [v for v in verdicts if not v.ok]
    assert not bad, "\n\n".join(f"seed {v.seed}: {v.summary}\n{v.tail}" for v in bad[:3])
