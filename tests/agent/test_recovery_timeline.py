"""The recovery timeline (elasticd.agent.recovery): pure marks in, phases out."""

from __future__ import annotations

from elasticd.agent.recovery import RecoveryTimeline


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
