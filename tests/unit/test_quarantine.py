"""The quarantine policy as tables: what trips it, what a TTL and an undrain do (issue 37)."""

from __future__ import annotations

import pytest

from elasticd.node.quarantine import (
    Fleet,
    HealthEntry,
    NodeHealth,
    Policy,
    decode_health,
    drained,
    expired,
    in_force,
    note,
    release_due,
    undrained,
)

T = 1_700_000_000.0


def _entry(kind: str = "first_failure", at: float = T, job: str = "j", round_: int = 0):
    return HealthEntry(kind=kind, at=at, job=job, round=round_, message="m")  # type: ignore[arg-type]


def _noted(entries: list[HealthEntry], policy: Policy, now: float = T) -> NodeHealth:
    health = NodeHealth(node="n1")
    for e in entries:
        health = note(health, e, policy, now)
    return health


@pytest.mark.parametrize(
    ("entries", "policy", "quarantined"),
    [
        ([_entry(round_=r) for r in range(2)], Policy(), False),  # under the threshold
        # Three rounds of one job, first failures alone: that job's own bug, not the node.
        ([_entry(round_=r) for r in range(3)], Policy(), False),
        ([_entry(round_=0), _entry(round_=1), _entry(job="other")], Policy(), True),
        ([_entry(job=f"j{r}") for r in range(3)], Policy(), True),  # across jobs
        ([_entry("hardware", round_=r) for r in range(3)], Policy(), True),
        ([_entry(round_=0), _entry("hardware", round_=0), _entry(round_=1)], Policy(), False),
        ([_entry(at=T - 4000), _entry(round_=1), _entry(round_=2)], Policy(), False),  # window
        ([_entry("health_check", round_=None)], Policy(), True),  # at once
        ([_entry("health_check", round_=None)], Policy(auto=False), False),
        ([_entry(round_=r) for r in range(3)], Policy(auto=False), False),
        ([_entry(round_=r) for r in range(4)] + [_entry(job="k")], Policy(threshold=5), True),
    ],
)
def test_the_policy_trips_on_a_health_check_or_n_failures_in_the_window(
    entries: list[HealthEntry], policy: Policy, quarantined: bool
) -> None:
    """A failed health check at once; N attributed failures (one per job round) in the window."""
    health = _noted(entries, policy)
    assert in_force(health.quarantine, T) is quarantined
    if quarantined:
        assert health.quarantine is not None and health.quarantine.by == "policy"


def test_a_ttl_ends_a_quarantine_and_an_undrain_forgives() -> None:
    """An automatic quarantine ends at its TTL; an admin's drain holds until undrained."""
    health = _noted([_entry("health_check")], Policy(ttl=60.0))
    assert in_force(health.quarantine, T + 59) and not in_force(health.quarantine, T + 60)
    drain = drained(NodeHealth(node="n1"), "bad DIMM", "alice", T)
    assert in_force(drain.quarantine, T + 10**6)
    released = undrained(drain, "replaced", "alice", T + 5)
    assert released.quarantine is None and released.entries == []
    assert released.released is not None and released.released.reason == "replaced"


@pytest.mark.parametrize(
    ("health", "now", "due", "ends"),
    [
        (NodeHealth(node="n1"), T, None, False),  # nothing to end
        (drained(NodeHealth(node="n1"), "DIMM", "alice", T), T + 10**6, None, False),  # an admin's
        (_noted([_entry("health_check")], Policy(ttl=60.0)), T + 20, 40.0, False),
        (_noted([_entry("health_check")], Policy(ttl=60.0)), T + 60, 0.0, True),  # at its end
        (_noted([_entry("health_check")], Policy(ttl=60.0)), T + 3600, 0.0, True),
    ],
)
def test_a_quarantine_ends_by_itself_only_at_its_ttl(
    health: NodeHealth, now: float, due: float | None, ends: bool
) -> None:
    """The node's own daemon waits ``release_due`` for the end, then records it (by the
    policy, its failures forgiven); an admin's drain never ends by itself."""
    assert release_due(health, now) == due
    after = expired(health, now)
    assert (after.quarantine is None and after.released is not None) is ends
    if ends:
        assert after.released is not None and after.released.by == "policy"
        assert after.entries == []
    else:
        assert after == health


@pytest.mark.parametrize(
    "raw",
    [None, b"not json", b'{"node": "n2", "quarantine": {"reason": "x", "since": 1, "by": "a"}}'],
)
def test_a_missing_malformed_or_misnamed_record_is_a_clean_one(raw: bytes | None) -> None:
    """What a store writer put under another node's key counts as no quarantine."""
    assert decode_health("n1", raw) == NodeHealth(node="n1")


def test_a_key_that_names_no_node_is_a_clean_record_not_an_error() -> None:
    """A hand-written ``health/`` key with a name no node may have decodes (no exception)."""
    health = decode_health("no such\nnode<img>", b'{"node": "x"}')
    assert health.quarantine is None and health.entries == []


@pytest.mark.parametrize(
    ("fleet", "policy", "quarantined"),
    [
        (Fleet(nodes=3, quarantined=0), Policy(), True),  # at least one node, however small
        (Fleet(nodes=3, quarantined=1), Policy(), False),  # one of three is the bound
        (Fleet(nodes=100, quarantined=9), Policy(), True),
        (Fleet(nodes=100, quarantined=10), Policy(), False),  # 10 % by default
        (Fleet(nodes=100, quarantined=10), Policy(max_fraction=0.5), True),
    ],
)
def test_the_policy_quarantines_no_more_than_its_share_of_the_fleet(
    fleet: Fleet, policy: Policy, quarantined: bool
) -> None:
    """Any user's job can fail the way a bad node does (a SIGBUS it raised itself), so what
    the policy alone takes out of the fleet is bounded; the failure is still counted."""
    health = NodeHealth(node="n1")
    for r in range(3):
        health = note(health, _entry("hardware", round_=r), policy, T, fleet)
    assert (health.quarantine is not None) is quarantined
    assert len(health.entries) == 3
