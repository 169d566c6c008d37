"""The agent's decision table (elasticd.agent.decide): every way an attempt ends, and the plan.

Where each step is exercised on real workers:

* BARRIER, SUCCEED: tests/integration/test_jobs_api.py::test_crash_once_restarts_the_group_and_succeeds,
  tests/e2e/test_multinode.py (every multi-node job that ends passes the exit barrier);
* RESTART_FAILED: test_jobs_api.py::test_crash_once_restarts_the_group_and_succeeds and
  ::test_budget_spent_fails_with_root_cause, test_multinode.py::test_worker_crash_restarts_every_node_and_spends_one_restart;
* RESTART_HUNG: tests/integration/test_hangs_and_health.py::test_hung_worker_is_detected_dumped_and_restarted;
  KILL_HUNG_RANK: ::test_inprocess_job_has_only_the_hung_rank_killed;
* REFORM: test_multinode.py::test_node_loss_survivors_reform_without_hanging, ::test_node_arrival_grows_the_job_without_spending_a_restart,
  ::test_hot_spare_replaces_a_lost_node, tests/e2e/test_store_hiccups.py (a fence);
* CLOSE: test_jobs_api.py::test_cancel_stops_workers, test_multinode.py::test_cancel_on_any_daemon_stops_every_node;
* REFORM_AFTER_BARRIER: this table only (a peer must change the round in the moments a
  finished node waits at the barrier).
"""

from __future__ import annotations

import pytest

from elasticd.agent.decide import Plan, Step, decide_after_barrier, decide_attempt
from elasticd.agent.progress import Hang
from elasticd.rendezvous import Change
from elasticd.supervise.process import GroupResult, WorkerExit


def exit_(rank: int, code: int) -> WorkerExit:
    return WorkerExit(rank, 100 + rank, code, None, 10.0 + rank, None)


OK = GroupResult(succeeded=True, exits={0: exit_(0, 0), 1: exit_(1, 0)}, failures=())
FAILED = GroupResult(succeeded=False, exits={1: exit_(1, 3)}, failures=(exit_(1, 3),))
HANG = Hang(local_rank=0, silent_for=5.0, never_pinged=False, deadline=1.0)

ATTEMPT_TABLE = [
    # outcome, in-process restart, expected plan
    (OK, False, Plan(Step.BARRIER)),
    (OK, True, Plan(Step.BARRIER)),
    (FAILED, False, Plan(Step.RESTART_FAILED, "worker failure", say_leaving=True)),
    (FAILED, True, Plan(Step.RESTART_FAILED, "worker failure", say_leaving=True)),
    (HANG, False, Plan(Step.RESTART_HUNG, "hang", say_leaving=True)),
    (HANG, True, Plan(Step.KILL_HUNG_RANK)),
    (Change.CLOSED, False, Plan(Step.CLOSE, Change.CLOSED.value)),
    (Change.NEW_ROUND, False, Plan(Step.REFORM, Change.NEW_ROUND.value, say_leaving=True)),
    (Change.FENCED, False, Plan(Step.REFORM, Change.FENCED.value, say_leaving=True)),
    (Change.ARRIVAL, True, Plan(Step.REFORM, Change.ARRIVAL.value, say_leaving=True)),
    (Change.LOSS, False, Plan(Step.REFORM, Change.LOSS.value, say_leaving=True)),
]


@pytest.mark.parametrize(("outcome", "inprocess", "plan"), ATTEMPT_TABLE)
def test_an_attempt_outcome_decides_the_next_step(outcome, inprocess, plan) -> None:
    assert decide_attempt(outcome, inprocess_restart=inprocess) == plan


def test_every_change_is_in_the_table() -> None:
    assert {o for o, _, _ in ATTEMPT_TABLE if isinstance(o, Change)} == set(Change)


@pytest.mark.parametrize(
    ("change", "plan"),
    [
        (None, Plan(Step.SUCCEED)),
        (Change.CLOSED, Plan(Step.SUCCEED)),
        (Change.ARRIVAL, Plan(Step.REFORM_AFTER_BARRIER, Change.ARRIVAL.value)),
        (Change.LOSS, Plan(Step.REFORM_AFTER_BARRIER, Change.LOSS.value)),
        (Change.NEW_ROUND, Plan(Step.REFORM_AFTER_BARRIER, Change.NEW_ROUND.value)),
        (Change.FENCED, Plan(Step.REFORM_AFTER_BARRIER, Change.FENCED.value)),
    ],
)
def test_the_exit_barrier_ends_in_success_or_a_reformation(change, plan) -> None:
    assert decide_after_barrier(change) == plan


@pytest.mark.parametrize(
    ("plan", "ends"),
    [(Plan(s), s in (Step.CLOSE, Step.SUCCEED)) for s in Step],
)
def test_only_close_and_succeed_end_the_agent(plan, ends) -> None:
    assert plan.ends_agent is ends
