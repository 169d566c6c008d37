"""The agent as a state machine: ``step(state, event, now) -> (state, effects)``, pure.

The runner (:class:`elasticd.agent.agent.JobAgent`) awaits what can happen
next (the round forming, the workers' start, their result, a hang, a change
of the rendezvous, the exit barrier, the store coming back), turns it into an
:data:`Event`, and carries out the :data:`Effect` s that :func:`step` returns,
in order. Every decision of the agent is made here, in one place (the runner
keeps one bound of its own: early workers unconfirmed for ``fence_after`` are
stopped before the round forms, as a node that loses the store). The table is
in ``docs/design.md`` ("The agent's state table") and, row by row, in
``tests/agent/test_machine.py``.

======================  =============================  ==============  =====================
phase                   event                          next phase      restart spent
======================  =============================  ==============  =====================
FORMING                 UserRefused                    DONE            no (FAILED, given back)
FORMING                 HealthFailed                   FORMING | DONE  yes (at once)
FORMING                 RoundFormed (job ended)        DONE            no
FORMING                 RoundFormed (early confirmed)  RUNNING         (when it formed)
FORMING                 RoundFormed                    STARTING        (when it formed)
FORMING                 JoinEnded (closed / timeout)   DONE            no
STARTING                WorkersStarted                 RUNNING         no
STARTING                StartFailed (job's side)       DONE            no (job FAILED)
STARTING                StartFailed (node's side)      STARTING|DONE   no (retry, give back)
STARTING                RetryDue                       STARTING        no
STARTING                RoundChanged                   FORMING | DONE  no
RUNNING                 WorkersEnded (all exited 0)    BARRIER         no
RUNNING                 WorkersEnded (a failure)       RESTARTING      yes (lazily)
RUNNING                 HangSeen (in-process restart)  RUNNING         no
RUNNING                 HangSeen                       RESTARTING      yes (lazily)
RUNNING                 RoundChanged (closed)          DONE            no
RUNNING                 RoundChanged (other, a fence)  FORMING         no
BARRIER                 BarrierDone (passed, closed)   DONE            no
BARRIER                 BarrierDone (a peer changed)   FORMING         no
RESTARTING              FailureRecorded                FORMING         (early restart: budget)
RESTARTING              FailureRecorded (job ended)    DONE            (charged: no restart left)
any but DONE            StoreLost                      FORMING         no
any                     Cancelled                      DONE            no
any                     Crashed                        DONE            no
======================  =============================  ==============  =====================

"Lazily": the failure is recorded in the job document and charged when the
next round forms, only if every participant came back
(:func:`elasticd.agent.edits.settle_failure`). The early restart (a job no
other node can join starts its workers while the store forms its round) is
decided on :class:`FailureRecorded`, with the budget: only while a restart is
left. A pair not in the table is a no-op (no effect, the state unchanged):
the runner never produces one, and the table test asserts each.

Which side of the boundary: the daemon; pure, no IO.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from elasticd.agent.nodefail import GiveBack, RetrySettings, Side, decide_retry
from elasticd.agent.progress import Hang
from elasticd.eventkinds import EventKind
from elasticd.models import EventSource, Job
from elasticd.rendezvous import Change, RoundInfo
from elasticd.states import WorkerState
from elasticd.supervise.process import GroupResult

__all__ = ["AgentState", "Effect", "Event", "Phase", "step"]


class Phase(enum.StrEnum):
    """Where the agent is in a job's life on this node."""

    FORMING = "forming"
    """Health checks, then the rendezvous: the next round is being formed."""
    STARTING = "starting"
    """The round formed: the workers are being started (a node-side failure is retried)."""
    RUNNING = "running"
    """The workers run: their result, a hang or a rendezvous change ends the attempt."""
    BARRIER = "barrier"
    """Every worker exited 0: waiting for the round's other nodes at the exit barrier."""
    RESTARTING = "restarting"
    """A failure (or a hang) stopped the group: its record is being written."""
    DONE = "done"
    """The job is over for this node."""


@dataclass(frozen=True)
class AgentState:
    """What the agent's decisions depend on (the runner holds the rest: processes, views)."""

    phase: Phase = Phase.FORMING
    inprocess_restart: bool = False
    """The job restarts failed ranks in-process (a hang kills only the stuck rank)."""
    multi_node: bool = False
    """Another node may take part (``max_nodes > 1``): a failed health check leaves."""
    retry: RetrySettings = RetrySettings()
    """How a start the node cannot make is retried (:mod:`elasticd.agent.nodefail`)."""
    first_start_failure: float | None = None
    """Monotonic time of the first node-side start failure of this round in a row."""
    start_tries: int = 0
    """Node-side start failures of this round in a row."""
    early: RoundInfo | None = None
    """The round of an early restart (known here before the store forms it)."""
    early_restart_count: int = 0
    """The restart count the early round will carry once its failure is charged."""


# -- events --------------------------------------------------------------------------


@dataclass(frozen=True)
class HealthFailed:
    """A health check failed before a (re)start; one restart was spent at once."""

    job_ended: bool
    """Spending it ended the job (the budget was spent)."""


@dataclass(frozen=True)
class RoundFormed:
    """The rendezvous formed a round (and settled the last round's failure)."""

    job_ended: bool
    """The job is over (cancelled, failed or succeeded elsewhere) by then."""
    early_running: bool = False
    """Workers of an early restart run."""
    early_confirmed: bool = False
    """The round (and its restart count) is the one the early workers were started for."""


@dataclass(frozen=True)
class JoinEnded:
    """The join ended without a round: the rendezvous closed, or the join timed out."""

    closed: bool
    message: str = ""


@dataclass(frozen=True)
class WorkersStarted:
    """Every worker of the attempt was spawned."""


@dataclass(frozen=True)
class StartFailed:
    """The workers could not be started."""

    side: Side
    message: str
    """What is said of it (the job's reason, or the event's)."""
    error: str = ""
    """The error itself (the job's root cause)."""
    cause: str = ""
    """A short name of the cause (``EMFILE``, ``cgroup``), for a node-side failure."""
    at: float = 0.0
    """When it failed, on the runner's monotonic clock (the retries are timed on it)."""


@dataclass(frozen=True)
class UserRefused:
    """The job's user (or its token file) could not be decided before anything of it ran."""

    side: Side
    message: str
    error: str = ""
    cause: str = ""


@dataclass(frozen=True)
class RetryDue:
    """The wait before retrying a start the node could not make is over."""


@dataclass(frozen=True)
class WorkersEnded:
    """The attempt's result: every worker exited, or one failed (torchrun's rule)."""

    result: GroupResult


@dataclass(frozen=True)
class HangSeen:
    """A worker's heartbeat is overdue."""

    hang: Hang


@dataclass(frozen=True)
class RoundChanged:
    """The rendezvous changed under the round (closed, a new round, an arrival, a loss),
    or this node fenced itself (:attr:`Change.FENCED`: the store lost for its lease)."""

    change: Change


@dataclass(frozen=True)
class BarrierDone:
    """The exit barrier ended: passed or timed out (``None``), or the rendezvous changed."""

    change: Change | None


@dataclass(frozen=True)
class FailureRecorded:
    """The round's failure is in the job document; what the job looks like now."""

    job_ended: bool
    restart_count: int
    max_restarts: int
    recorded_here: bool
    """The job's pending failure is the one of the round that just failed."""
    solo: RoundInfo | None
    """The next round, when no other node can join (known here); None otherwise."""

    @classmethod
    def of(cls, job: Job, failed_round: int, solo: RoundInfo | None) -> FailureRecorded:
        """The event, from the job document the failure of ``failed_round`` was written to."""
        pending = job.pending_failure
        here = pending is not None and pending.round == failed_round
        return cls(job.state.is_terminal, job.restart_count, job.max_restarts, here, solo)


@dataclass(frozen=True)
class StoreLost:
    """A store call failed while forming or running."""

    unavailable: bool
    """The store is out of reach (an outage), not an answer it gave (a lapsed lease)."""
    message: str = ""


@dataclass(frozen=True)
class Cancelled:
    """The daemon is stopping, or the fleet's plan took this node from the job."""

    leave_first: bool
    """Taken by the plan: leave the rendezvous before stopping the workers."""


@dataclass(frozen=True)
class Crashed:
    """The agent itself raised (a bug): stop everything, fail the job."""

    message: str


Event = (
    UserRefused
    | HealthFailed
    | RetryDue
    | RoundFormed
    | JoinEnded
    | WorkersStarted
    | StartFailed
    | WorkersEnded
    | HangSeen
    | RoundChanged
    | BarrierDone
    | FailureRecorded
    | StoreLost
    | Cancelled
    | Crashed
)

# -- effects -------------------------------------------------------------------------


@dataclass(frozen=True)
class BeginRecovery:
    """Start the recovery timeline (a no-op while one is in progress)."""

    cause: str
    detected_at: float


@dataclass(frozen=True)
class SayLeaving:
    """Tell the other nodes (in the background) that this node heads for the next round."""


@dataclass(frozen=True)
class StopWorkers:
    """Stop the workers (and the "leaving" write), then move the group to ``target``."""

    target: WorkerState | None


@dataclass(frozen=True)
class StopForOutage:
    """The store is lost: stop what runs, back to INIT (nothing when nothing ran)."""


@dataclass(frozen=True)
class DropEarly:
    """Stop workers started early, before the store confirmed their round (no state)."""


@dataclass(frozen=True)
class SetState:
    """Move the local worker group to ``target``."""

    target: WorkerState
    unless_ended: bool = False
    """Not when the group already ended (SUCCEEDED, FAILED, STOPPED)."""


@dataclass(frozen=True)
class ReportHang:
    """The ``worker.hang`` event and the stuck worker's stacks."""

    hang: Hang
    kill: bool = False
    """Then SIGKILL only that rank (in-process restart)."""


@dataclass(frozen=True)
class RecordFailure:
    """Record the round's failure in the job document (charged when the next round forms)."""

    cause: GroupResult | Hang
    at: float


@dataclass(frozen=True)
class PlanEarlyRestart:
    """The next round's workers start while the store forms it: an early restart.

    For a job that no other node can join (``max_nodes = 1``) the next round
    is known locally (:meth:`Rendezvous.solo_round`) and so is the restart
    count it will carry (the failure is charged when the round forms). The
    failure is recorded first (as for any restart); then the workers are
    started with them while the store forms the round (with the same master
    port) and charges it. When the store's answer differs (the job ended,
    another node took the round, the document changed) the early workers are
    stopped before they count and the round's own are started
    (:class:`RoundFormed` with ``early_confirmed`` False): the store stays the
    authority.
    """

    round: RoundInfo
    restart_count: int


@dataclass(frozen=True)
class StartWorkers:
    """Spawn the round's workers (their result comes as WorkersStarted or StartFailed)."""


@dataclass(frozen=True)
class Running:
    """The workers run as the round's: HEALTHY, the job RUNNING, the recovery's end."""

    early: bool


@dataclass(frozen=True)
class ReleaseGroup:
    """Every worker exited 0: end what is left of the attempt (its strays), quietly."""


@dataclass(frozen=True)
class WaitAtBarrier:
    """Wait for the round's other nodes at the exit barrier (BarrierDone follows)."""


@dataclass(frozen=True)
class RecoveryStopped:
    """The stop phase of the recovery timeline ends now."""


@dataclass(frozen=True)
class Reform:
    """A membership change: say so, the job RESTARTING, the group INIT (no restart spent)."""

    change: Change


@dataclass(frozen=True)
class Succeed:
    """The group SUCCEEDED, the job SUCCEEDED (for its round), the rendezvous closed."""


@dataclass(frozen=True)
class CloseRendezvous:
    """Close the rendezvous for every node (the job ended)."""

    quiet: bool = False
    """A store error is ignored (else it is the store lost, as any)."""


@dataclass(frozen=True)
class FinishClosed:
    """The job ended: the group's last state from the job's, ``agent.finished``."""


@dataclass(frozen=True)
class FailJob:
    """The job cannot go on: the event, the job FAILED, the rendezvous closed."""

    kind: EventKind
    reason: str
    source: EventSource = "agent"
    error: str | None = None
    """The message of the job's root cause, naming this node (a start that failed)."""
    in_attempt: bool = False
    """It happened in an attempt (the event and the root cause name it)."""


@dataclass(frozen=True)
class RetryStart:
    """Say ``workers.spawn_retry`` and try the start again after ``delay`` (or a change)."""

    delay: float
    tries: int
    error: str
    cause: str


@dataclass(frozen=True)
class GiveBackJob:
    """Stop trying: give the job back to the scheduler (no restart spent)."""

    waited: float
    error: str
    cause: str


@dataclass(frozen=True)
class LeaveRendezvous:
    """Leave the rendezvous (bounded), so the other nodes re-form at once."""


@dataclass(frozen=True)
class SayLeft:
    """``agent.finished``: this node left the job (its health check failed)."""


@dataclass(frozen=True)
class CancelEarly:
    """Cancel the store work of an early restart (the store is the authority)."""


@dataclass(frozen=True)
class WaitForStore:
    """``store.lost`` (once per outage), then wait until the store answers."""

    outage: bool
    """False: the store answered (a lapsed lease): a short pause, no event."""
    message: str = ""


Effect = (
    BeginRecovery
    | SayLeaving
    | StopWorkers
    | DropEarly
    | StopForOutage
    | SetState
    | ReportHang
    | RecordFailure
    | PlanEarlyRestart
    | StartWorkers
    | Running
    | ReleaseGroup
    | WaitAtBarrier
    | RecoveryStopped
    | Reform
    | Succeed
    | CloseRendezvous
    | FinishClosed
    | FailJob
    | RetryStart
    | GiveBackJob
    | LeaveRendezvous
    | SayLeft
    | CancelEarly
    | WaitForStore
)

Step = tuple[AgentState, tuple[Effect, ...]]

#: What a recovery started by a rendezvous change is called (its timeline's cause).
WORKER_FAILURE = "worker failure"
HANG = "hang"


def step(state: AgentState, event: Event, now: float) -> Step:
    """The next state and what to do, in order (see the module's table).

    ``now`` is wall time, for the recovery timeline (a failed start carries its
    own time on the runner's monotonic clock, which its retries are timed on).
    """
    match event:
        case Cancelled(leave_first=first):
            # Stop the workers (shielded), leave so the others re-form at once. Taken by the
            # plan, the node leaves first: its peers see the change before their workers
            # notice ours stopping, so nothing of it is charged as a failure.
            effects: tuple[Effect, ...] = (CancelEarly(),)
            if first:
                effects += (LeaveRendezvous(),)
            return _done(state), (*effects, StopWorkers(WorkerState.STOPPED), LeaveRendezvous())
        case Crashed(message=message):
            return _done(state), (
                CancelEarly(),
                SetState(WorkerState.UNKNOWN, unless_ended=True),  # half-applied
                StopWorkers(WorkerState.FAILED),
                FailJob(EventKind.AGENT_ERROR, message),
            )
        case StoreLost(unavailable=outage, message=message) if state.phase is not Phase.DONE:
            # Nothing can be decided or recorded: stop the workers (the others re-form
            # without us), wait until the store answers, then go again.
            forming = replace(state, phase=Phase.FORMING, early=None)
            return forming, (
                CancelEarly(),
                StopForOutage(),
                WaitForStore(outage=outage, message=message),
            )
    match state.phase:
        case Phase.DONE:
            return state, ()  # the job is over here: nothing but a cancel moves it again
        case Phase.FORMING:
            return _forming(state, event)
        case Phase.STARTING:
            return _starting(state, event)
        case Phase.RUNNING:
            return _running(state, event, now)
        case Phase.BARRIER:
            return _barrier(state, event, now)
        case Phase.RESTARTING:
            return _restarting(state, event)
    return state, ()  # pragma: no cover - every phase is matched above


def _done(state: AgentState) -> AgentState:
    return replace(state, phase=Phase.DONE, early=None)


def _forming(state: AgentState, event: Event) -> Step:
    match event:
        case UserRefused(side=Side.NODE, error=error, cause=cause):
            return _done(state), (GiveBackJob(0.0, error, cause),)
        case UserRefused(message=message, error=error):
            return _done(state), (
                SetState(WorkerState.FAILED),
                FailJob(EventKind.WORKERS_SPAWN_FAILED, message, error=error),
            )
        case HealthFailed(job_ended=True):
            return _done(state), (CloseRendezvous(quiet=True), FinishClosed())
        case HealthFailed() if state.multi_node:
            # A spare, or the remaining nodes, carry on without this node.
            return _done(state), (LeaveRendezvous(), SayLeft())
        case HealthFailed():
            return replace(state, early=None), ()  # a single node: check again
        case JoinEnded(closed=True):
            return _done(state), (DropEarly(), FinishClosed())
        case JoinEnded(message=message):
            return _done(state), (
                DropEarly(),
                FailJob(EventKind.RENDEZVOUS_FAILED, message, source="rendezvous"),
            )
        case RoundFormed(job_ended=True):
            return _done(state), (DropEarly(), CloseRendezvous(), FinishClosed())
        case RoundFormed(early_running=True, early_confirmed=True):
            running = replace(state, phase=Phase.RUNNING, early=None)
            return running, (Running(early=True),)
        case RoundFormed(early_running=early):
            # Guessed wrong (another node took the round, the document changed): the early
            # workers never ran as this round's; the round's own start.
            starting = replace(
                state, phase=Phase.STARTING, early=None, first_start_failure=None, start_tries=0
            )
            return starting, ((DropEarly(),) if early else ()) + (StartWorkers(),)
    return state, ()


def _starting(state: AgentState, event: Event) -> Step:
    match event:
        case WorkersStarted():
            return replace(state, phase=Phase.RUNNING), (Running(early=False),)
        case RetryDue():
            return state, (StartWorkers(),)
        case StartFailed(side=Side.JOB, message=message, error=error):
            return _done(state), (
                SetState(WorkerState.FAILED),
                FailJob(EventKind.WORKERS_SPAWN_FAILED, message, error=error, in_attempt=True),
            )
        case StartFailed(error=error, cause=cause, at=at):
            first = at if state.first_start_failure is None else state.first_start_failure
            tries = state.start_tries + 1
            decision = decide_retry(first, tries, at, state.retry)
            if isinstance(decision, GiveBack):
                return _done(state), (GiveBackJob(decision.waited, error, cause),)
            retrying = replace(state, first_start_failure=first, start_tries=tries)
            return retrying, (RetryStart(decision.delay, tries, error, cause),)
        case RoundChanged(change=Change.CLOSED):
            return _done(state), (FinishClosed(),)
        case RoundChanged():
            return replace(state, phase=Phase.FORMING), ()  # formed again with whoever is there
    return state, ()


def _running(state: AgentState, event: Event, now: float) -> Step:
    match event:
        case WorkersEnded(result=result) if result.succeeded:
            return replace(state, phase=Phase.BARRIER), (ReleaseGroup(), WaitAtBarrier())
        case WorkersEnded(result=result):
            detected = min((f.exited_at for f in result.failures), default=now)
            return replace(state, phase=Phase.RESTARTING), (
                BeginRecovery(WORKER_FAILURE, detected),
                SayLeaving(),
                StopWorkers(WorkerState.STOPPED),  # the survivors
                RecordFailure(result, now),
            )
        case HangSeen(hang=hang) if state.inprocess_restart:
            # Kill only the stuck rank; its death is reported to the others, which carry
            # on without it (the wrapper's hard_timeout backstop).
            return state, (ReportHang(hang, kill=True),)
        case HangSeen(hang=hang):
            # Its own order: "leaving", UNHEALTHY and the stacks before the stop.
            return replace(state, phase=Phase.RESTARTING), (
                SayLeaving(),
                SetState(WorkerState.UNHEALTHY),
                ReportHang(hang),
                BeginRecovery(HANG, now),
                StopWorkers(WorkerState.STOPPED),
                RecordFailure(hang, now),
            )
        case RoundChanged(change=Change.CLOSED):
            return _done(state), (
                BeginRecovery(Change.CLOSED.value, now),
                StopWorkers(WorkerState.STOPPED),
                FinishClosed(),
            )
        case RoundChanged(change=change):
            return replace(state, phase=Phase.FORMING), (
                BeginRecovery(change.value, now),
                SayLeaving(),
                StopWorkers(WorkerState.STOPPED),
                Reform(change),
            )
    return state, ()


def _barrier(state: AgentState, event: Event, now: float) -> Step:
    match event:
        case BarrierDone(change=None) | BarrierDone(change=Change.CLOSED):
            return _done(state), (Succeed(),)
        case BarrierDone(change=Change() as change):
            # A peer changed the rendezvous while this node waited: its workers are gone.
            return replace(state, phase=Phase.FORMING), (
                BeginRecovery(change.value, now),
                SetState(WorkerState.STOPPED),
                RecoveryStopped(),
                Reform(change),
            )
    return state, ()


def _restarting(state: AgentState, event: Event) -> Step:
    match event:
        case FailureRecorded(job_ended=True):
            # The failure ended the job (no restart left, charged at once; or it ended
            # meanwhile): no round to form (issue 41: it formed one, then saw the end).
            return _done(state), (CloseRendezvous(), FinishClosed())
        case FailureRecorded() as rec:
            forming = replace(state, phase=Phase.FORMING, early=None)
            effects: tuple[Effect, ...] = (SetState(WorkerState.INIT),)
            if (
                rec.solo is not None
                and not rec.job_ended
                and rec.restart_count < rec.max_restarts  # the budget: a restart is left
                and rec.recorded_here
            ):
                # The failure is charged when the round forms: one more than now.
                count = rec.restart_count + 1
                forming = replace(forming, early=rec.solo, early_restart_count=count)
                effects += (PlanEarlyRestart(rec.solo, count),)
            return forming, effects
    return state, ()
