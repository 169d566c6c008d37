"""What the agent does next: a pure function of how an attempt ended.

The agent loop (:class:`elasticd.agent.agent.JobAgent`) runs an attempt and
waits, without polling, for the first of: the group's result (every worker
exited, or one failed), a hang (a heartbeat overdue), or a change of the
rendezvous (a node waiting to join, a participant lost, a fence, the job
closed). :func:`decide_attempt` maps that outcome to a :class:`Plan`, and
:func:`decide_after_barrier` maps the exit barrier's end (a successful group
waits there for its peers) to the next one; the loop only applies plans.
The table of cases is in ``tests/unit/test_agent_decide.py``.

============================  ==============================  ==============
outcome                       step                            restart spent
============================  ==============================  ==============
every worker exited 0         BARRIER, then SUCCEED           no
  ... a peer changed meanwhile  REFORM_AFTER_BARRIER            no
a worker failed               RESTART_FAILED                  yes (lazily)
a hang, in-process restart    KILL_HUNG_RANK (monitor on)     no
a hang                        RESTART_HUNG                    yes (lazily)
rendezvous closed             CLOSE                           no
any other rendezvous change   REFORM                          no
============================  ==============================  ==============

"Lazily": the failure is recorded in the job document and charged when the
next round forms, only if every participant came back (see
:func:`elasticd.agent.agent.settle_failure`).

Which side of the boundary: the daemon; pure, no IO.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from elasticd.agent.progress import Hang
from elasticd.rendezvous import Change
from elasticd.supervise.process import GroupResult

__all__ = ["Outcome", "Plan", "Step", "decide_after_barrier", "decide_attempt"]

#: How an attempt ended: the group's result, a hang, or a rendezvous change.
Outcome = GroupResult | Change | Hang


class Step(enum.StrEnum):
    """The next step of the agent loop."""

    KILL_HUNG_RANK = "kill_hung_rank"
    """In-process restart: kill only the stuck rank; the others carry on (monitor again)."""
    RESTART_HUNG = "restart_hung"
    """UNHEALTHY, the stuck worker's stacks, stop the group, record the failure, re-form."""
    RESTART_FAILED = "restart_failed"
    """Stop the survivors, record the round's failure (charged at the next round), re-form."""
    REFORM = "reform"
    """Stop the workers and re-form the group: a membership change, no restart spent."""
    CLOSE = "close"
    """Stop the workers and finish: the job ended (cancelled, or decided elsewhere)."""
    BARRIER = "barrier"
    """Every worker exited 0: release the attempt, wait for the peers at the exit barrier."""
    SUCCEED = "succeed"
    """The barrier passed (or timed out, or closed): the job SUCCEEDED."""
    REFORM_AFTER_BARRIER = "reform_after_barrier"
    """A peer changed the rendezvous while this node waited: re-form (workers already gone)."""


@dataclass(frozen=True)
class Plan:
    """A decision: the step, and what goes with it."""

    step: Step
    recovery_cause: str | None = None
    """The cause a recovery timeline starts with (``None``: no recovery starts)."""
    say_leaving: bool = False
    """Tell the other nodes first that this node heads for the next round."""

    @property
    def ends_agent(self) -> bool:
        """The job is over for this node once the step is applied."""
        return self.step in (Step.CLOSE, Step.SUCCEED)


def decide_attempt(outcome: Outcome, *, inprocess_restart: bool) -> Plan:
    """The plan for how the attempt ended (see the module's table)."""
    if isinstance(outcome, Hang):
        if inprocess_restart:
            return Plan(Step.KILL_HUNG_RANK)
        # The hang path says "leaving" and starts the recovery itself, in its own order
        # (the state goes UNHEALTHY and the stacks are taken before the stop).
        return Plan(Step.RESTART_HUNG, recovery_cause="hang", say_leaving=True)
    if isinstance(outcome, Change):
        if outcome is Change.CLOSED:
            return Plan(Step.CLOSE, recovery_cause=outcome.value)
        return Plan(Step.REFORM, recovery_cause=outcome.value, say_leaving=True)
    if outcome.succeeded:
        return Plan(Step.BARRIER)
    return Plan(Step.RESTART_FAILED, recovery_cause="worker failure", say_leaving=True)


def decide_after_barrier(change: Change | None) -> Plan:
    """The plan once the exit barrier ended: passed (``None``), closed, or a peer changed."""
    if change is None or change is Change.CLOSED:
        return Plan(Step.SUCCEED)
    return Plan(Step.REFORM_AFTER_BARRIER, recovery_cause=change.value)
