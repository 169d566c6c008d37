"""The recovery timeline (elasticd.agent.recovery): pure marks in, phases out."""

from __future__ import annotations

import pytest

from elasticd.agent.edits import merge_first_progress
from elasticd.agent.recovery import FirstProgress, RecoveryTimeline
from elasticd.models import Job, JobSpec, Recovery
from elasticd.states import JobState


def test_a_recovery_is_split_into_stop_rendezvous_and_spawn() -> None:
    t = RecoveryTimeline()
    assert t.begin("worker failure", 100.0)
    assert not t.begin("a later cause", 100.5)  # one recovery at a time: the clock keeps
    stop = t.stopped(100.2)
    assert stop is not None and abs(stop - 0.2) < 1e-9
    r = t.finish(3, rendezvous_done=100.7, spawned=100.75)
    assert r is not None
    assert (r.round, r.cause, r.detected_at, r.spawned_at) == (3, "worker failure", 100.0, 100.75)
    assert abs(r.stop_s - 0.2) < 1e-9 and abs(r.rendezvous_s - 0.5) < 1e-9
    assert abs(r.spawn_s - 0.05) < 1e-9 and abs(r.total_s - 0.75) < 1e-9
    assert not t.active and t.finish(4, rendezvous_done=1, spawned=2) is None


def test_the_stop_phase_is_reported_once_and_only_during_a_recovery() -> None:
    t = RecoveryTimeline()
    assert t.stopped(5.0) is None  # nothing in progress
    t.begin("hang", 10.0)
    assert t.stopped(11.0) == 1.0
    assert t.stopped(12.0) is None


def test_without_a_stop_mark_the_rendezvous_phase_counts_from_detection() -> None:
    """A successful group that re-forms after its barrier has no workers left to stop."""
    t = RecoveryTimeline()
    t.begin("a node is waiting to join", 0.0)
    r = t.finish(1, rendezvous_done=0.3, spawned=0.4)
    assert r is not None and r.stop_s == 0.0 and abs(r.rendezvous_s - 0.3) < 1e-9


def test_the_first_progress_is_timed_from_the_spawn_and_crosses_json() -> None:
    """Spawn to first ping, never negative; what crosses the re-exec reads back the same."""
    pending = FirstProgress(round=3, spawned_at=100.0)
    assert pending.seconds(104.5) == 4.5
    assert pending.seconds(99.0) == 0.0  # a file older than the spawn
    assert FirstProgress.from_json(pending.to_json()) == pending


def _job(last: Recovery | None, state: JobState = JobState.RUNNING) -> Job:
    spec = JobSpec(entrypoint="x")
    return Job(id="j", spec=spec, state=state, max_restarts=0, created_at=0.0, last_recovery=last)


@pytest.mark.parametrize(
    ("last", "state", "seconds", "expected"),
    [
        (None, JobState.RUNNING, 2.0, None),  # no recovery recorded: nothing to fill
        (Recovery(round=2, cause="c", detected_at=0.0), JobState.RUNNING, 2.0, None),  # stale
        (Recovery(round=3, cause="c", detected_at=0.0), JobState.RUNNING, 2.0, 2.0),
        # Several nodes: the job's figure is the slowest node's.
        (Recovery(round=3, cause="c", detected_at=0, first_progress_s=5), JobState.RUNNING, 2, 5),
        (Recovery(round=3, cause="c", detected_at=0, first_progress_s=1), JobState.RUNNING, 2, 2),
        (Recovery(round=3, cause="c", detected_at=0.0), JobState.CANCELLED, 2.0, None),  # final
    ],
)
def test_the_first_progress_folds_into_the_jobs_last_recovery_of_its_round(
    last: Recovery | None, state: JobState, seconds: float, expected: float | None
) -> None:
    edit = merge_first_progress(3, seconds)(_job(last, state))
    got = edit["last_recovery"].first_progress_s if "last_recovery" in edit else None
    assert got == expected
