"""Whether an agent can hand its attempt over at the daemon's re-exec, and the failure it has
not recorded when the exec cuts it off (pure tables)."""

from __future__ import annotations

import dataclasses

import pytest

from elasticd.agent.handover import HandoverFacts, not_ready, unrecorded_at_exec
from elasticd.agent.machine import Effect, Phase, RecordFailure, StopWorkers
from elasticd.states import WorkerState
from elasticd.supervise.process import GroupResult, WorkerExit

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


#: A rank exited 3, its peer still runs: the group's failure, not seen by the agent yet.
EXITED_3 = WorkerExit(1, 101, 3, None, 11.0, None)
CRASHED = GroupResult(succeeded=False, exits={1: EXITED_3}, failures=(EXITED_3,))
#: Only an exit the agent's stop caused (SIGTERM): no cause.
TERMINATED = WorkerExit(0, 100, None, 15, 10.0, None, stopped=True)
STOPPED = GroupResult(succeeded=False, exits={0: TERMINATED}, failures=(TERMINATED,))
QUEUED = RecordFailure(CRASHED, 5.0)


@pytest.mark.parametrize(
    ("queued", "change", "result", "inprocess", "expected"),
    [
        # Its record queued (behind the survivors' stop) or under way: that one, wherever.
        ([StopWorkers(None), QUEUED], {"phase": Phase.RESTARTING}, None, False, QUEUED),
        ([QUEUED], {"phase": Phase.RESTARTING}, STOPPED, False, QUEUED),
        # Its workers' failure, not acted on yet: recorded as the agent would have.
        ([], {}, CRASHED, False, RecordFailure(CRASHED, 7.0)),
        ([], {"phase": Phase.STARTING}, CRASHED, False, RecordFailure(CRASHED, 7.0)),
        # Nothing failed, or only what a stop ended; no workers; none of this attempt.
        ([], {}, None, False, None),
        ([], {}, STOPPED, False, None),
        ([], {"phase": Phase.FORMING}, CRASHED, False, None),
        # Early workers, their round unconfirmed: carried (the next image asks the job).
        (
            [],
            {"phase": Phase.FORMING, "holding_exits": True},
            CRASHED,
            False,
            RecordFailure(CRASHED, 7.0),
        ),
        # Exits an adoption holds (the previous image's, said there): not this one's.
        ([], {"holding_exits": True}, CRASHED, False, None),
        # An in-process restart's failed rank is its wrapper's business.
        ([], {}, CRASHED, True, None),
    ],
)
def test_the_failure_an_agent_has_not_recorded_at_the_exec(
    queued: list[Effect],
    change: dict[str, object],
    result: GroupResult | None,
    inprocess: bool,
    expected: RecordFailure | None,
) -> None:
    """What the re-exec carries to the next image for a job it does not hand over: the
    failure the agent saw or its workers met and that is not in the job yet, in every
    state the exec may cut the agent off in."""
    facts = dataclasses.replace(WATCHING, **change)  # type: ignore[arg-type]
    found = unrecorded_at_exec(queued, facts, result, inprocess_restart=inprocess, now=7.0)
    assert found == expected
