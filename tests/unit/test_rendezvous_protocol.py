"""The pure rendezvous protocol: scenarios step by step, and invariants under random schedules."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from elasticd.rendezvous.protocol import (
    Action,
    Change,
    Kind,
    NodeInfo,
    Settings,
    State,
    decide_close,
    decide_exit,
    decide_join,
    watch_reason,
)

FAR = 1e12


def info(name: str) -> NodeInfo:
    return NodeInfo(
        addr=f"10.0.0.{ord(name[-1]) % 250}",
        role="default",
        local_world_size=2,
        port=29000 + ord(name[-1]),
    )


def join_until_blocked(state: State, me: str, s: Settings, now: float, alive: frozenset[str]):
    """Apply a node's join decisions until it must wait or is done."""
    for _ in range(10):
        action = decide_join(state, me, info(me), s, now, alive, FAR)
        if action.kind is not Kind.WRITE:
            return state, action
        assert action.state is not None
        state = action.state
    raise AssertionError("join did not settle")


def test_min_nodes_then_last_call_then_complete():
    """Two of 2..3 nodes join, the last call holds the round open, then it completes with ranks."""
    s = Settings(min_nodes=2, max_nodes=3, last_call_timeout=5)
    alive = frozenset({"a", "b"})
    st_, act = join_until_blocked(State(), "a", s, 100, alive)
    assert act.kind is Kind.WAIT and not st_.complete
    st_, act = join_until_blocked(st_, "b", s, 101, alive)
    assert act.kind is Kind.WAIT and act.until == 106  # deadline = min reached + last call
    st_, act = join_until_blocked(st_, "a", s, 106.5, alive)
    assert act.kind is Kind.FINISH and st_.complete
    assert st_.participants == {"a": 0, "b": 1}
    assert st_.master() == (info("a").addr, info("a").port)


def test_max_nodes_completes_at_once_and_extra_node_is_a_spare():
    """Reaching max_nodes completes immediately; a further node waits in the redundancy list."""
    s = Settings(min_nodes=1, max_nodes=2, last_call_timeout=30)
    alive = frozenset("abc")
    st_, _ = join_until_blocked(State(), "a", s, 0, alive)
    st_, act = join_until_blocked(st_, "b", s, 0, alive)
    assert act.kind is Kind.FINISH and st_.complete
    st_, act = join_until_blocked(st_, "c", s, 0, alive)
    assert act.kind is Kind.WAIT and st_.redundancy_list == {"c"}
    assert watch_reason(st_, "a", st_.round, alive, s) is None  # a spare is no reason to restart


def test_arrival_triggers_rerendezvous_and_new_round_includes_everyone():
    """A node arriving at a complete, non-full round waits; participants re-form to include it."""
    s = Settings(min_nodes=1, max_nodes=3, last_call_timeout=5)
    alive = frozenset("abc")
    st_, _ = join_until_blocked(State(), "a", s, 0, frozenset("ab"))
    st_, _ = join_until_blocked(st_, "b", s, 0, frozenset("ab"))
    st_, _ = join_until_blocked(st_, "a", s, 6, frozenset("ab"))
    assert st_.complete and st_.round == 0
    st_, act = join_until_blocked(st_, "c", s, 7, alive)
    assert st_.wait_list == {"c"} and act.kind is Kind.WAIT
    assert watch_reason(st_, "a", 0, alive, s) is Change.ARRIVAL
    for node in "ab":
        st_ = decide_exit(st_, node, s).state
    assert st_.round == 1 and not st_.complete
    for node in "cab":
        st_, act = join_until_blocked(st_, node, s, 8, alive)
    assert act.kind is Kind.FINISH and sorted(st_.participants) == ["a", "b", "c"]


def test_lost_node_is_removed_and_survivors_complete_without_last_call():
    """A participant whose lease expired is dropped; survivors re-form at once (no last call)."""
    s = Settings(min_nodes=2, max_nodes=3, last_call_timeout=30)
    alive = frozenset("abc")
    st_ = State()
    for node in "abc":
        st_, _ = join_until_blocked(st_, node, s, 0, alive)
    assert st_.complete
    survivors = frozenset("ab")
    assert watch_reason(st_, "a", 0, survivors, s) is Change.LOSS
    for node in "ab":
        st_, _ = join_until_blocked(st_, node, s, 1, survivors)  # sanitize happens here
        st_ = decide_exit(st_, node, s).state
    assert st_.round == 1 and "c" not in st_.members()
    st_, act = join_until_blocked(st_, "a", s, 2, survivors)
    st_, act = join_until_blocked(st_, "b", s, 2, survivors)
    assert act.kind is Kind.FINISH and st_.participants == {"a": 0, "b": 1}


def test_spare_replaces_lost_participant():
    """When a participant is lost, the hot spare steps into the wait list and the next round."""
    s = Settings(min_nodes=2, max_nodes=2)
    st_ = State()
    for node in "abs":
        st_, _ = join_until_blocked(st_, node, s, 0, frozenset("abs"))
    assert st_.redundancy_list == {"s"}
    live = frozenset("as")
    st_, act = join_until_blocked(st_, "s", s, 1, live)
    assert st_.wait_list == {"s"} and "b" not in st_.members()
    assert watch_reason(st_, "a", 0, live, s) is Change.ARRIVAL


def test_fenced_node_and_closed_rendezvous():
    """A node removed from the round is fenced; a closed rendezvous refuses joins forever."""
    s = Settings(min_nodes=1, max_nodes=2)
    st_, _ = join_until_blocked(State(), "a", s, 0, frozenset("ab"))
    st_, _ = join_until_blocked(st_, "b", s, 0, frozenset("ab"))
    gone = decide_exit(st_, "a", s).state
    assert watch_reason(gone, "a", 0, frozenset("ab"), s) is Change.FENCED
    closed = decide_close(st_).state
    assert watch_reason(closed, "b", 0, frozenset("ab"), s) is Change.CLOSED
    assert decide_join(closed, "c", info("c"), s, 0, frozenset("abc"), FAR).kind is Kind.CLOSED
    assert decide_close(closed).kind is Kind.FINISH


def test_join_times_out_and_malformed_documents_are_errors():
    """Too few nodes by the join deadline is a TIMEOUT; a bad document is a RendezvousError."""
    import pytest

    from elasticd.errors import RendezvousError

    s = Settings(min_nodes=2, max_nodes=2)
    st_, _ = join_until_blocked(State(), "a", s, 0, frozenset("a"))
    assert decide_join(st_, "a", info("a"), s, 50, frozenset("a"), 10).kind is Kind.TIMEOUT
    for raw in (b"not json", b"{}", b'{"round": "x"}', b"[]"):
        with pytest.raises(RendezvousError):
            State.decode(raw)
    assert State.decode(st_.encode()) == st_


def test_settings_validate():
    """min_nodes must be positive and not above max_nodes."""
    import pytest

    with pytest.raises(ValueError, match="min_nodes"):
        Settings(min_nodes=0, max_nodes=1)
    with pytest.raises(ValueError, match="max_nodes"):
        Settings(min_nodes=3, max_nodes=2)


def check_invariants(before: State, after: State, s: Settings) -> None:
    assert len(after.participants) <= s.max_nodes
    if before.closed:
        assert after.closed, "a closed rendezvous never reopens"
    lists = [set(after.participants), set(after.wait_list), set(after.redundancy_list)]
    for i in range(3):
        for j in range(i + 1, 3):
            assert not lists[i] & lists[j], "a node is in at most one list"
    if after.complete:
        ranks = list(after.participants.values())
        assert len(set(ranks)) == len(ranks), "ranks are unique"
    if after.complete and not before.complete:  # the moment ranks are assigned
        assert sorted(after.participants.values()) == list(range(len(after.participants)))
        assert len(after.participants) >= s.min_nodes
    assert after.round >= before.round


ops = st.lists(
    st.tuples(
        st.sampled_from(["join", "exit", "die", "revive", "close", "tick"]),
        st.sampled_from("abcde"),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops, st.integers(1, 3), st.integers(0, 2))
def test_invariants_hold_under_any_schedule(schedule, min_nodes, extra):
    """Ranks unique and contiguous, ≤ max participants, closed stays closed, one list per node."""
    s = Settings(min_nodes=min_nodes, max_nodes=min_nodes + extra, last_call_timeout=2)
    state, now, alive = State(), 0.0, set("abcde")
    for op, node in schedule:
        now += 1
        if op == "die":
            alive.discard(node)
            continue
        if op == "revive":
            alive.add(node)
            continue
        if node not in alive:
            continue
        if op == "join":
            action: Action = decide_join(state, node, info(node), s, now, frozenset(alive), FAR)
        elif op == "exit":
            action = decide_exit(state, node, s)
        elif op == "close":
            action = decide_close(state)
        else:
            action = decide_join(state, node, info(node), s, now + 10, frozenset(alive), FAR)
        if action.kind is Kind.WRITE:
            assert action.state is not None
            check_invariants(state, action.state, s)
            state = action.state
