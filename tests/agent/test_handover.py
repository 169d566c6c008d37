"""Whether an agent can hand its attempt over at the daemon's re-exec (pure table)."""

from __future__ import annotations

import dataclasses

import pytest

from elasticd.agent.handover import HandoverFacts, not_ready
from elasticd.agent.machine import Phase
from elasticd.states import WorkerState

#: Watching its running, healthy workers: the one state that hands over.
WATCHING = HandoverFacts(
    phase=Phase.RUNNING,
    state=WorkerState.HEALTHY,
    monitoring=True,
    holding_exits=False,
    has_round=True,
    has_workers=True,
)


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({}, None),
        ({"phase": Phase.FORMING, "state": WorkerState.INIT}, "not running (forming)"),
        ({"phase": Phase.STARTING, "state": WorkerState.INIT}, "not running (starting)"),
        ({"phase": Phase.RESTARTING, "state": WorkerState.STOPPED}, "not running (restarting)"),
        ({"phase": Phase.BARRIER}, "not running (barrier)"),
        ({"phase": Phase.DONE, "state": WorkerState.SUCCEEDED}, "not running (done)"),
        ({"has_round": False}, "not running (running)"),
        ({"has_workers": False}, "not running (running)"),
        ({"state": WorkerState.INIT}, "group was INIT"),
        ({"state": WorkerState.UNHEALTHY}, "group was UNHEALTHY"),
        ({"holding_exits": True}, "start was not confirmed"),
        ({"monitoring": False}, "handling an event"),
    ],
)
def test_only_an_agent_watching_its_running_workers_is_ready(
    change: dict[str, object], why: str | None
) -> None:
    reason = not_ready(dataclasses.replace(WATCHING, **change))  # type: ignore[arg-type]
    if why is None:
        assert reason is None
    else:
        assert reason is not None and why in reason, reason
