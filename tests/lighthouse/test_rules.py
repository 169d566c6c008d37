"""The quorum decision as tables (torchft's rules, with the safety checks on every quorum),
and a seeded exploration of its invariants."""

from __future__ import annotations

import random

import pytest

from elasticd.lighthouse.proto import QuorumMember
from elasticd.lighthouse.rules import (
    MAX_QUORUM_ID,
    NewQuorum,
    Pending,
    Settings,
    State,
    Wait,
    decide,
    healthy_replicas,
)

S = Settings(min_replicas=2, join_timeout=10.0, heartbeat_timeout=5.0)
NOW = 100.0


def state(
    asking: str,
    beating: str = "",
    *,
    previous: str | None = None,
    quorum_id: int = 4,
    joined: float = NOW,
    seen: float = NOW,
    shrink: str = "",
    failures: str = "",
) -> State:
    """Replicas are letters: ``asking`` have a pending request, ``beating`` only beat."""
    pending = {
        r: Pending(
            QuorumMember(r, shrink_only=r in shrink, commit_failures=int(r in failures)), joined
        )
        for r in asking
    }
    last_seen = dict.fromkeys(asking + beating, seen)
    return State(quorum_id, tuple(previous) if previous is not None else None, pending, last_seen)


def members(decision: object) -> str:
    assert isinstance(decision, NewQuorum), decision
    return "".join(m.replica_id for m in decision.participants)


@pytest.mark.parametrize(
    ("st", "expected", "quorum_id"),
    [
        # everyone healthy asks: a quorum at once, the id rises (new membership)
        (state("abc"), "abc", 5),
        # same members as before: the same id again
        (state("abc", previous="abc"), "abc", 4),
        # fast quorum: every previous member asks, a healthy straggler is not waited for
        (state("ab", "c", previous="ab"), "ab", 4),
        # fast quorum may grow
        (state("abc", previous="ab"), "abc", 5),
        # a member reports commit failures: the id rises though the members stay
        (state("ab", previous="ab", failures="a"), "ab", 5),
        # stragglers waited for until the join timeout; then the quorum forms without them
        (state("ab", "c", previous="abc", joined=NOW - 10.0), "ab", 5),
        # a stale replica is neither a candidate nor counted in the majority
        (
            State(
                4,
                ("abc"),
                {r: Pending(QuorumMember(r), NOW) for r in "abc"},
                {"a": NOW, "b": NOW, "c": NOW - 5.0},
            ),
            "ab",
            5,
        ),
        # shrink_only: only previous members; c is left out
        (state("abc", previous="ab", shrink="a"), "ab", 4),
    ],
)
def test_quorums_that_form(st: State, expected: str, quorum_id: int) -> None:
    decision = decide(st, NOW, S)
    assert members(decision) == expected
    assert isinstance(decision, NewQuorum) and decision.quorum_id == quorum_id


@pytest.mark.parametrize(
    ("st", "until", "why"),
    [
        # one asks of min_replicas 2: only a new request helps
        (state("a"), None, "min_replicas"),
        # a fast quorum of one is refused too (torchft would give it)
        (state("a", previous="a"), None, "min_replicas"),
        # two of four healthy is no majority; decide again when a heartbeat goes stale
        (state("ab", "cd", previous="ab"), NOW + 5.0, "not a majority"),
        # a majority but a healthy straggler: wait for it until the join timeout
        (state("ab", "c", previous="abc"), NOW + 5.0, "stragglers"),
        (state("ab", "c", previous="abc", seen=NOW + 20), NOW + 10.0, "stragglers"),
        # shrink_only leaves one candidate: below min_replicas
        (state("ab", previous="a", shrink="b"), None, "min_replicas"),
        # the id cannot rise past int64
        (state("ab", quorum_id=MAX_QUORUM_ID), None, "maximum"),
    ],
)
def test_decisions_that_wait(st: State, until: float | None, why: str) -> None:
    decision = decide(st, NOW, S)
    assert isinstance(decision, Wait), decision
    assert decision.until == until
    assert why in decision.reason


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="min_replicas"):
        Settings(min_replicas=0)
    with pytest.raises(ValueError, match="heartbeat_timeout"):
        Settings(heartbeat_timeout=0)


def test_health_is_strictly_younger_than_the_timeout() -> None:
    assert healthy_replicas({"a": 95.0, "b": 95.1}, NOW, 5.0) == {"b"}


def explore(seed: int, steps: int = 300) -> list[str]:
    """Drive decide with random requests, heartbeats, deaths and time, as a leader would
    apply it; check the invariants after every step. Returns the trace."""
    rng = random.Random(seed)
    settings = Settings(
        min_replicas=rng.randint(1, 3),
        join_timeout=rng.choice([0.0, 1.0, 3.0]),
        heartbeat_timeout=rng.choice([1.0, 2.0]),
    )
    replicas = [f"r{i}" for i in range(rng.randint(1, 6))]
    alive = set(replicas)
    now = 0.0
    quorum_id, previous = 0, None
    pending: dict[str, Pending] = {}
    last_seen: dict[str, float] = {}
    memberships: dict[int, tuple[str, ...]] = {}
    trace: list[str] = [f"seed {seed} {settings} {replicas}"]
    for step in range(steps):
        roll = rng.random()
        if roll < 0.4:
            r = rng.choice(sorted(alive) or replicas)
            if r in alive:
                member = QuorumMember(
                    r, shrink_only=rng.random() < 0.05, commit_failures=int(rng.random() < 0.05)
                )
                pending[r] = Pending(member, now)
                last_seen[r] = now
                trace.append(f"{step}: {r} asks")
        elif roll < 0.7:
            for r in alive:
                last_seen[r] = now
        elif roll < 0.75 and alive:
            r = rng.choice(sorted(alive))
            alive.discard(r)
            trace.append(f"{step}: {r} dies")
        elif roll < 0.8:
            r = rng.choice(replicas)
            alive.add(r)
        else:
            now += rng.choice([0.1, 0.5, 1.0, 2.5])
        healthy = healthy_replicas(last_seen, now, settings.heartbeat_timeout)
        decision = decide(State(quorum_id, previous, dict(pending), dict(last_seen)), now, settings)
        if isinstance(decision, Wait):
            assert decision.until is None or decision.until > now, trace
            continue
        ids = tuple(m.replica_id for m in decision.participants)
        trace.append(f"{step}: quorum {decision.quorum_id} {ids} ({decision.reason})")
        assert decision.quorum_id >= quorum_id, trace
        assert len(ids) >= settings.min_replicas, trace
        assert len(ids) * 2 > len(healthy), trace
        assert set(ids) <= healthy and set(ids) <= set(pending), trace
        assert list(ids) == sorted(set(ids)), trace
        assert memberships.setdefault(decision.quorum_id, ids) == ids, trace
        quorum_id, previous = decision.quorum_id, ids
        for r in ids:
            del pending[r]
        pending = {r: Pending(p.member, now) for r, p in pending.items()}  # they rejoin
    return trace


@pytest.mark.parametrize("seed", range(200))
def test_exploration_keeps_the_invariants(seed: int) -> None:
    """Ids never go back, one membership per id, never below min_replicas or a majority."""
    explore(seed)


def test_exploration_forms_quorums() -> None:
    """The sweep is not vacuous: most seeds form several quorums."""
    formed = [sum("quorum" in line for line in explore(seed)) for seed in range(50)]
    assert sum(n > 2 for n in formed) > 25
