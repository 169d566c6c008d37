"""The agent's machine under a seeded walk: the real :func:`elasticd.agent.machine.step`.

One seed drives an environment that answers the machine as the runner and the
world would: each phase gets the events that can happen in it (a round forms
or the join ends, the start succeeds or fails on either side, the workers end
or hang, the rendezvous changes, the barrier passes, the failure is recorded),
and at any moment the store may be lost, the agent cancelled or crashed. The
job's budget is kept as the job document keeps it. After every step:

* every failure of the job's own workers (an exit, a hang) is recorded exactly
  once (one ``RecordFailure``); nothing else is recorded: a store outage, a
  change of the rendezvous, a cancel, a node-side start failure;
* no effect fails the job but the job's own failures (its start, its user) or a
  join that timed out, or the agent's own crash;
* a job that ends here ends in ``DONE``, which nothing but a cancel or a crash
  moves again (and then only to stop and leave);
* an early restart is planned only while a restart is left.
"""

from __future__ import annotations

import random

from elasticd.agent import machine as m
from elasticd.agent.nodefail import Side
from elasticd.agent.progress import Hang
from elasticd.eventkinds import EventKind
from elasticd.rendezvous import Change, RoundInfo
from elasticd.supervise.process import GroupResult, WorkerExit
from tests.sim.outcome import Outcome

#: The kinds of failure a job may be failed with, and why each is the job's own.
OWN_FAILURES = {
    EventKind.WORKERS_SPAWN_FAILED,  # its program, cwd or user cannot start
    EventKind.RENDEZVOUS_FAILED,  # its join timed out (too few nodes came)
    EventKind.AGENT_ERROR,  # the agent itself raised
}


def _exit(rank: int, code: int, at: float) -> WorkerExit:
    return WorkerExit(local_rank=rank, pid=1000 + rank, exit_code=code, signal=None,
                      exited_at=at, error=None)  # fmt: skip


def _solo(round_: int) -> RoundInfo:
    return RoundInfo(round_, 0, 1, [], "127.0.0.1", 29_500, {"n0": 0})


def simulate_agent(seed: int, steps: int = 300) -> Outcome:
    rng = random.Random(f"agent-{seed}")
    state = m.AgentState(multi_node=rng.random() < 0.5, inprocess_restart=rng.random() < 0.2)
    max_restarts, restarts, round_ = rng.randint(0, 40), 0, 0
    trace: list[str] = []
    now, taken = 1_000.0, 0
    for i in range(steps):
        now += rng.uniform(0.01, 3.0)
        phase = state.phase
        roll = rng.random()
        event: m.Event
        # Weighted so that a walk lives long (the job's end is rare, as in a real job).
        if roll < 0.03:
            event = m.StoreLost(unavailable=rng.random() < 0.7, message="cut")
        elif roll < 0.033:
            event = m.Cancelled(leave_first=rng.random() < 0.5)
        elif roll < 0.035:
            event = m.Crashed("a bug")
        elif phase is m.Phase.FORMING:
            formed = m.RoundFormed(
                job_ended=rng.random() < 0.005,
                early_running=state.early is not None,
                early_confirmed=rng.random() < 0.7,
            )
            event = rng.choices(
                [
                    formed,
                    m.JoinEnded(closed=rng.random() < 0.5, message="timed out"),
                    m.HealthFailed(job_ended=restarts >= max_restarts),
                ],
                weights=[20, 0.1, 0.3],
            )[0]
            if isinstance(event, m.RoundFormed):
                round_ += 1
        elif phase is m.Phase.STARTING:
            event = rng.choices(
                [
                    m.WorkersStarted(),
                    m.StartFailed(Side.NODE, "EMFILE", "too many files", "EMFILE", at=now),
                    m.StartFailed(Side.JOB, "no such program", "ENOENT"),
                    m.RetryDue(),
                    m.RoundChanged(rng.choice(list(Change))),
                ],
                weights=[12, 3, 0.05, 2, 2],
            )[0]
        elif phase is m.Phase.RUNNING:
            failed = GroupResult(False, {0: _exit(0, 3, now)}, [_exit(0, 3, now)])
            ok = GroupResult(True, {0: _exit(0, 0, now)}, [])
            event = rng.choices(
                [
                    m.WorkersEnded(failed),
                    m.WorkersEnded(ok),
                    m.HangSeen(Hang(0, 30.0, False, now)),
                    m.RoundChanged(rng.choice(list(Change))),
                ],
                weights=[6, 0.2, 2, 4],
            )[0]
        elif phase is m.Phase.BARRIER:
            event = m.BarrierDone(rng.choice([None, *Change, *Change]))
        elif phase is m.Phase.RESTARTING:
            restarts_after = restarts + 1  # the job document charges the failure
            ended = restarts_after > max_restarts
            event = m.FailureRecorded(ended, restarts, max_restarts, True,
                                      _solo(round_ + 1) if rng.random() < 0.5 else None)  # fmt: skip
            restarts = min(restarts_after, max_restarts + 1)
        else:  # DONE: only a cancel or a crash is left; the walk ends
            break
        taken = i + 1
        before = state
        state, effects = m.step(state, event, now)
        names = [type(e).__name__ for e in effects]
        trace.append(f"{i:3d} {before.phase.value:>10} + {type(event).__name__}: "
                     f"{state.phase.value} {names}")  # fmt: skip
        problem = _check(before, event, state, effects, restarts, max_restarts)
        if problem is not None:
            trace.append(f"VIOLATION: {problem}")
            return Outcome(seed, f"seed {seed}: {problem}", trace, i + 1)
    return Outcome(seed, None, trace, taken)


def _check(
    before: m.AgentState,
    event: m.Event,
    after: m.AgentState,
    effects: tuple[m.Effect, ...],
    restarts: int,
    max_restarts: int,
) -> str | None:
    records = [e for e in effects if isinstance(e, m.RecordFailure)]
    own_failure = before.phase is m.Phase.RUNNING and (
        (isinstance(event, m.WorkersEnded) and not event.result.succeeded)
        or (isinstance(event, m.HangSeen) and not before.inprocess_restart)
    )
    if own_failure and len(records) != 1:
        return f"a failure of its workers was recorded {len(records)} times"
    if not own_failure and records:
        return f"{type(event).__name__} in {before.phase.value} was recorded as a failure"
    for effect in effects:
        if isinstance(effect, m.FailJob) and effect.kind not in OWN_FAILURES:
            return f"{type(event).__name__} failed the job ({effect.kind}): not its own failure"
    if before.phase is m.Phase.DONE and effects and not isinstance(event, m.Cancelled | m.Crashed):
        return f"{type(event).__name__} moved an agent that was done: {effects}"
    for effect in effects:
        if isinstance(effect, m.PlanEarlyRestart) and restarts > max_restarts:
            return "an early restart was planned with no restart left"
    if isinstance(event, m.FailureRecorded) and event.job_ended and after.early is not None:
        return "an early restart was planned for a job that ended"
    return None
