"""The agent's state table (elasticd.agent.machine.step): every (phase, event) pair.

Each row: the state, the event, ``now`` -> the next state and the effects, in
order. A pair not in the table is asserted a no-op (the state unchanged, no
effect): the runner never produces it. Where each row is exercised on real
workers is listed in docs/design.md ("The agent's state table").
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from elasticd.agent.machine import (
    AgentState,
    BarrierDone,
    BeginRecovery,
    CancelEarly,
    Cancelled,
    CloseRendezvous,
    Crashed,
    DropEarly,
    Effect,
    Event,
    FailJob,
    FailureRecorded,
    FinishClosed,
    GiveBackJob,
    HangSeen,
    HealthFailed,
    JoinEnded,
    LeaveRendezvous,
    Phase,
    PlanEarlyRestart,
    RecordFailure,
    RecoveryStopped,
    Reform,
    ReleaseGroup,
    ReportHang,
    RetryDue,
    RetryStart,
    RoundChanged,
    RoundFormed,
    Running,
    SayLeaving,
    SayLeft,
    SetState,
    StartFailed,
    StartWorkers,
    StopForOutage,
    StopWorkers,
    StoreLost,
    Succeed,
    UserRefused,
    WaitAtBarrier,
    WaitForStore,
    WorkersEnded,
    WorkersStarted,
    step,
)
from elasticd.agent.nodefail import RetrySettings, Side
from elasticd.agent.progress import Hang
from elasticd.eventkinds import EventKind
from elasticd.rendezvous import Change, RoundInfo
from elasticd.rendezvous.ranks import NodeSlot
from elasticd.states import WorkerState
from elasticd.supervise.process import GroupResult, WorkerExit

NOW = 1000.0
STOPPED, INIT, FAILED = WorkerState.STOPPED, WorkerState.INIT, WorkerState.FAILED


def exit_(rank: int, code: int) -> WorkerExit:
    return WorkerExit(rank, 100 + rank, code, None, 10.0 + rank, None)


OK = GroupResult(succeeded=True, exits={0: exit_(0, 0), 1: exit_(1, 0)}, failures=())
CRASH = GroupResult(
    succeeded=False, exits={0: exit_(0, 3), 1: exit_(1, 3)}, failures=(exit_(1, 3), exit_(0, 3))
)
HANG = Hang(local_rank=0, silent_for=5.0, never_pinged=False, deadline=1.0)
SOLO = RoundInfo(
    round=4,
    group_rank=0,
    group_world_size=1,
    nodes=[NodeSlot(0, "default", 2)],
    master_addr="127.0.0.1",
    master_port=29500,
    participants={"n0": 0},
)
RETRY = RetrySettings(grace=10.0, first_delay=0.25, max_delay=5.0)


def at(phase: Phase, **fields: object) -> AgentState:
    return replace(AgentState(phase=phase, retry=RETRY), **fields)  # type: ignore[arg-type]


def recorded(**fields: object) -> FailureRecorded:
    base = {
        "job_ended": False,
        "restart_count": 1,
        "max_restarts": 3,
        "recorded_here": True,
        "solo": SOLO,
    }
    return FailureRecorded(**{**base, **fields})  # type: ignore[arg-type]


F, S, R, B, RS, D = (
    Phase.FORMING,
    Phase.STARTING,
    Phase.RUNNING,
    Phase.BARRIER,
    Phase.RESTARTING,
    Phase.DONE,
)
EARLY = {"early": SOLO, "early_restart_count": 2}
LEAVE_AND_STOP = (CancelEarly(), StopWorkers(STOPPED), LeaveRendezvous())
CRASHED = (
    CancelEarly(),
    SetState(WorkerState.UNKNOWN, unless_ended=True),
    StopWorkers(FAILED),
    FailJob(EventKind.AGENT_ERROR, "boom"),
)

#: (state, event) -> (next state, effects). ``now`` is NOW throughout.
TABLE: list[tuple[AgentState, Event, AgentState, tuple[Effect, ...]]] = [
    # -- FORMING: the user, health checks, the rendezvous
    (
        at(F),
        UserRefused(Side.JOB, "cannot run", "no such user"),
        at(D),
        (
            SetState(FAILED),
            FailJob(EventKind.WORKERS_SPAWN_FAILED, "cannot run", error="no such user"),
        ),
    ),
    (
        at(F),
        UserRefused(Side.NODE, "cannot run", "disk full", "ENOSPC"),
        at(D),
        (GiveBackJob(0.0, "disk full", "ENOSPC"),),
    ),
    (at(F), HealthFailed(job_ended=True), at(D), (CloseRendezvous(quiet=True), FinishClosed())),
    (
        at(F, multi_node=True),
        HealthFailed(False),
        at(D, multi_node=True),
        (LeaveRendezvous(), SayLeft()),
    ),
    (at(F, **EARLY), HealthFailed(False), at(F, early_restart_count=2), ()),  # check again
    (
        at(F, **EARLY),
        JoinEnded(closed=True),
        at(D, early_restart_count=2),
        (DropEarly(), FinishClosed()),
    ),
    (
        at(F),
        JoinEnded(False, "timed out"),
        at(D),
        (DropEarly(), FailJob(EventKind.RENDEZVOUS_FAILED, "timed out", source="rendezvous")),
    ),
    (at(F), RoundFormed(job_ended=True), at(D), (DropEarly(), CloseRendezvous(), FinishClosed())),
    (
        at(F, **EARLY),
        RoundFormed(False, True, True),
        at(R, early_restart_count=2),
        (Running(early=True),),
    ),
    (
        at(F, **EARLY),
        RoundFormed(False, True, False),
        at(S, early_restart_count=2),
        (DropEarly(), StartWorkers()),
    ),
    (at(F, start_tries=2, first_start_failure=1.0), RoundFormed(False), at(S), (StartWorkers(),)),
    # -- STARTING: the spawn, a failed start (whose side), its retries
    (at(S), WorkersStarted(), at(R), (Running(early=False),)),
    (
        at(S),
        StartFailed(Side.JOB, "could not start", "no such file"),
        at(D),
        (
            SetState(FAILED),
            FailJob(
                EventKind.WORKERS_SPAWN_FAILED,
                "could not start",
                error="no such file",
                in_attempt=True,
            ),
        ),
    ),
    (
        at(S),
        StartFailed(Side.NODE, "", "too many files", "EMFILE", at=50.0),
        at(S, first_start_failure=50.0, start_tries=1),
        (RetryStart(0.25, 1, "too many files", "EMFILE"),),
    ),
    (
        at(S, first_start_failure=50.0, start_tries=3),
        StartFailed(Side.NODE, "", "too many files", "EMFILE", at=59.5),
        at(S, first_start_failure=50.0, start_tries=4),
        (RetryStart(0.5, 4, "too many files", "EMFILE"),),  # the last wait ends at the grace
    ),
    (
        at(S, first_start_failure=50.0, start_tries=5),
        StartFailed(Side.NODE, "", "too many files", "EMFILE", at=60.0),
        at(D, first_start_failure=50.0, start_tries=5),
        (GiveBackJob(10.0, "too many files", "EMFILE"),),
    ),
    (at(S, start_tries=1), RetryDue(), at(S, start_tries=1), (StartWorkers(),)),
    (at(S), RoundChanged(Change.CLOSED), at(D), (FinishClosed(),)),
    (at(S), RoundChanged(Change.NEW_ROUND), at(F), ()),
    # -- RUNNING: the result, a hang, a rendezvous change (a fence is one)
    (at(R), WorkersEnded(OK), at(B), (ReleaseGroup(), WaitAtBarrier())),
    (
        at(R),
        WorkersEnded(CRASH),
        at(RS),
        (
            BeginRecovery("worker failure", 10.0),  # from the first worker's exit
            SayLeaving(),
            StopWorkers(STOPPED),
            RecordFailure(CRASH, NOW),
        ),
    ),
    (
        at(R, inprocess_restart=True),
        HangSeen(HANG),
        at(R, inprocess_restart=True),
        (ReportHang(HANG, kill=True),),
    ),
    (
        at(R),
        HangSeen(HANG),
        at(RS),
        (
            SayLeaving(),
            SetState(WorkerState.UNHEALTHY),
            ReportHang(HANG),
            BeginRecovery("hang", NOW),
            StopWorkers(STOPPED),
            RecordFailure(HANG, NOW),
        ),
    ),
    (
        at(R),
        RoundChanged(Change.CLOSED),
        at(D),
        (BeginRecovery(Change.CLOSED.value, NOW), StopWorkers(STOPPED), FinishClosed()),
    ),
    *[
        (
            at(R),
            RoundChanged(change),
            at(F),
            (BeginRecovery(change.value, NOW), SayLeaving(), StopWorkers(STOPPED), Reform(change)),
        )
        for change in (Change.NEW_ROUND, Change.FENCED, Change.ARRIVAL, Change.LOSS)
    ],
    # -- BARRIER: every worker exited 0, the peers awaited
    (at(B), BarrierDone(None), at(D), (Succeed(),)),
    (at(B), BarrierDone(Change.CLOSED), at(D), (Succeed(),)),
    (
        at(B),
        BarrierDone(Change.ARRIVAL),
        at(F),
        (
            BeginRecovery(Change.ARRIVAL.value, NOW),
            SetState(STOPPED),
            RecoveryStopped(),
            Reform(Change.ARRIVAL),
        ),
    ),
    # -- RESTARTING: the failure recorded; the early restart, only with budget left
    (at(RS, multi_node=True), recorded(solo=None), at(F, multi_node=True), (SetState(INIT),)),
    (
        at(RS),
        recorded(),
        at(F, **{**EARLY, "early_restart_count": 2}),
        (SetState(INIT), PlanEarlyRestart(SOLO, 2)),
    ),
    (at(RS), recorded(restart_count=3), at(F), (SetState(INIT),)),  # the budget is spent
    (at(RS), recorded(job_ended=True), at(D), (CloseRendezvous(), FinishClosed())),
    (at(RS), recorded(recorded_here=False), at(F), (SetState(INIT),)),  # another round's
    # -- any phase but DONE: the store lost; any phase: a cancel, a crash
    *[
        (
            at(phase, **EARLY),
            StoreLost(True, "refused"),
            at(F, early_restart_count=2),
            (CancelEarly(), StopForOutage(), WaitForStore(True, "refused")),
        )
        for phase in (F, S, R, B, RS)
    ],
    (
        at(R),
        StoreLost(False, "lease"),
        at(F),
        (CancelEarly(), StopForOutage(), WaitForStore(False, "lease")),
    ),
    *[
        (at(phase, **EARLY), Cancelled(False), at(D, early_restart_count=2), LEAVE_AND_STOP)
        for phase in Phase
    ],
    (
        at(R),
        Cancelled(leave_first=True),
        at(D),
        (CancelEarly(), LeaveRendezvous(), *LEAVE_AND_STOP[1:]),
    ),
    *[(at(phase), Crashed("boom"), at(D), CRASHED) for phase in Phase],
]


@pytest.mark.parametrize(("state", "event", "expected", "effects"), TABLE)
def test_step(
    state: AgentState, event: Event, expected: AgentState, effects: tuple[Effect, ...]
) -> None:
    assert step(state, event, NOW) == (expected, effects)


#: One event of each kind, for the pairs the table does not list.
EVERY_EVENT: list[Event] = [
    UserRefused(Side.JOB, "m", "e"),
    HealthFailed(False),
    RetryDue(),
    RoundFormed(False),
    JoinEnded(True),
    WorkersStarted(),
    StartFailed(Side.NODE, "m", "e", "EMFILE", at=1.0),
    WorkersEnded(CRASH),
    HangSeen(HANG),
    RoundChanged(Change.LOSS),
    BarrierDone(None),
    recorded(),
    StoreLost(True),
    Cancelled(False),
    Crashed("boom"),
]


def test_every_kind_of_event_is_listed() -> None:
    """A new event kind must come with its rows (and a place in EVERY_EVENT)."""
    assert {type(e) for e in EVERY_EVENT} == set(Event.__args__)  # type: ignore[attr-defined]


LISTED = {(state.phase, type(event)) for state, event, _, _ in TABLE}
UNLISTED = [
    (phase, event) for phase in Phase for event in EVERY_EVENT if (phase, type(event)) not in LISTED
]


@pytest.mark.parametrize(("phase", "event"), UNLISTED)
def test_a_pair_not_in_the_table_is_a_no_op(phase: Phase, event: Event) -> None:
    """The runner never produces these: the state stays, nothing is done."""
    state = at(phase, **EARLY)
    assert step(state, event, NOW) == (state, ())


def test_the_table_and_the_no_ops_cover_every_pair() -> None:
    pairs = {(phase, type(e)) for phase in Phase for e in EVERY_EVENT}
    assert LISTED | {(p, type(e)) for p, e in UNLISTED} == pairs
    assert (Phase.DONE, StoreLost) not in LISTED  # the job is over here: nothing to stop
