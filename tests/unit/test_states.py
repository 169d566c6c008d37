"""Worker-group and job state machines: allowed moves, refused moves, terminal finality."""

import itertools

import pytest

from elasticd.errors import InvalidTransition
from elasticd.states import (
    JOB_TERMINAL,
    WORKERS_TERMINAL,
    JobState,
    WorkerState,
    job_transition,
    worker_transition,
)


def test_worker_happy_path_and_restart_cycle():
    """INIT→HEALTHY→STOPPED→INIT→HEALTHY→SUCCEEDED is the restart-then-succeed path."""
    s = WorkerState.INIT
    for target in ("HEALTHY", "STOPPED", "INIT", "HEALTHY", "UNHEALTHY", "HEALTHY", "SUCCEEDED"):
        s = worker_transition(s, WorkerState(target))
    assert s is WorkerState.SUCCEEDED


@pytest.mark.parametrize(
    ("terminal", "target"), list(itertools.product(WORKERS_TERMINAL, WorkerState))
)
def test_worker_terminal_states_are_final(terminal, target):
    """No move leaves SUCCEEDED or FAILED, not even to UNKNOWN."""
    with pytest.raises(InvalidTransition):
        worker_transition(terminal, target)


@pytest.mark.parametrize(
    ("src", "dst"),
    [("INIT", "SUCCEEDED"), ("STOPPED", "HEALTHY"), ("INIT", "UNHEALTHY"), ("UNKNOWN", "HEALTHY")],
)
def test_worker_illegal_moves_are_refused(src, dst):
    """Skipping a step (e.g. STOPPED straight to HEALTHY without INIT) is refused."""
    with pytest.raises(InvalidTransition, match=f"{src} to {dst}"):
        worker_transition(WorkerState(src), WorkerState(dst))


def test_any_live_worker_state_may_fall_to_unknown():
    """An internal error can mark any non-terminal group UNKNOWN."""
    for s in set(WorkerState) - WORKERS_TERMINAL:
        assert worker_transition(s, WorkerState.UNKNOWN) is WorkerState.UNKNOWN


def test_job_paths():
    """PENDING→RUNNING⇄RESTARTING→terminal; terminal states are final."""
    s = JobState.PENDING
    for target in ("RUNNING", "RESTARTING", "RUNNING", "SUCCEEDED"):
        s = job_transition(s, JobState(target))
    for terminal, target in itertools.product(JOB_TERMINAL, JobState):
        with pytest.raises(InvalidTransition):
            job_transition(terminal, target)
    with pytest.raises(InvalidTransition):
        job_transition(JobState.PENDING, JobState.SUCCEEDED)
