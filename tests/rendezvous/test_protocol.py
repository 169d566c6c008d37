"""The pure rendezvous protocol: scenarios step by step, and invariants under random schedules."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticd.errors import RendezvousError
from elasticd.rendezvous.protocol import (
    MAX_LOCAL_WORLD_SIZE,
    Action,
    Change,
    Kind,
    Next,
    NodeInfo,
    Settings,
    State,
    absorb,
    after_lost_write,
    decide_close,
    decide_exit,
    decide_join,
    holder_follows,
    sanitize,
    watch_reason,
)

FAR = 1e12


def info(name: str, round: int = 0) -> NodeInfo:
    return NodeInfo(
        addr=f"10.0.0.{ord(name[-1]) % 250}",
        role="default",
        local_world_size=2,
        port=29000 + ord(name[-1]),
        round=round,
    )


def present(names, round: int = 0, rounds: dict[str, int] | None = None) -> dict[str, NodeInfo]:
    """Announcements of ``names``, for ``round`` (or each node's round in ``rounds``)."""
    return {n: info(n, (rounds or {}).get(n, round)) for n in names}


def join(
    state: State,
    me: str,
    s: Settings,
    now: float,
    names,
    deadline: float = FAR,
    rounds: dict[str, int] | None = None,
):
    """Apply one node's join decisions until it must wait or is done.

    Every node in ``names`` has announced for the current round unless
    ``rounds`` says otherwise (a node still running an earlier one).
    """
    for _ in range(10):
        action = decide_join(state, me, s, now, present(names, state.round, rounds), deadline)
        if action.kind is not Kind.WRITE:
            return state, action
        assert action.state is not None
        state = action.state
    raise AssertionError("join did not settle")


def leave(state: State, me: str, s: Settings, for_good: bool = False) -> State:
    action = decide_exit(state, me, s, for_good=for_good)
    return action.state if action.kind is Kind.WRITE else state


def test_min_nodes_then_last_call_then_complete():
    """Two of 2..3 nodes join, the last call holds the round open, then it completes with ranks."""
    s = Settings(min_nodes=2, max_nodes=3, last_call_timeout=5)
    st_, act = join(State(), "a", s, 100, "a")
    assert act.kind is Kind.WAIT and not st_.complete
    st_, act = join(st_, "b", s, 101, "ab")
    assert act.kind is Kind.WAIT and act.until == 106  # deadline = min reached + last call
    st_, act = join(st_, "a", s, 106.5, "ab")
    assert act.kind is Kind.FINISH and st_.complete
    assert st_.participants == {"a": 0, "b": 1}
    assert st_.master() == (info("a").addr, info("a").port)


def test_one_write_places_every_announced_node():
    """The first node to write absorbs everyone who announced: one CAS, not one per node."""
    s = Settings(min_nodes=3, max_nodes=5, last_call_timeout=5)
    names = [f"n{i}" for i in range(5)]
    action = decide_join(State(), "n3", s, 0, present(names), FAR)
    assert action.kind is Kind.WRITE and action.state is not None
    assert action.state.complete and sorted(action.state.participants) == names
    assert sorted(action.state.participants.values()) == [0, 1, 2, 3, 4]


def test_max_nodes_completes_at_once_and_extra_node_is_a_spare():
    """Reaching max_nodes completes immediately; a further node waits in the redundancy list."""
    s = Settings(min_nodes=1, max_nodes=2, last_call_timeout=30)
    st_, _ = join(State(), "a", s, 0, "a")
    st_, act = join(st_, "b", s, 0, "ab")
    assert act.kind is Kind.FINISH and st_.complete
    st_, act = join(st_, "c", s, 0, "abc")
    assert act.kind is Kind.WAIT and st_.redundancy_list == {"c"}
    assert watch_reason(st_, "a", st_.round, frozenset("abc"), s) is None  # a spare is no reason


def test_arrival_triggers_rerendezvous_and_new_round_includes_everyone():
    """A node arriving at a complete, non-full round waits; participants re-form to include it."""
    s = Settings(min_nodes=1, max_nodes=3, last_call_timeout=5)
    st_, _ = join(State(), "a", s, 0, "ab")
    st_, _ = join(st_, "a", s, 6, "ab")
    assert st_.complete and st_.round == 0 and sorted(st_.participants) == ["a", "b"]
    st_, act = join(st_, "c", s, 7, "abc")
    assert st_.wait_list == {"c"} and act.kind is Kind.WAIT
    assert watch_reason(st_, "a", 0, frozenset("abc"), s) is Change.ARRIVAL
    st_ = leave(st_, "a", s)  # opens round 1 for everyone
    assert st_.round == 1 and not st_.complete and st_.wait_list == {"a", "b", "c"}
    assert watch_reason(st_, "b", 0, frozenset("abc"), s) is Change.NEW_ROUND
    assert leave(st_, "b", s) == st_  # already waiting for the open round: nothing to leave
    st_, act = join(st_, "c", s, 8, "abc")
    assert act.kind is Kind.FINISH and sorted(st_.participants) == ["a", "b", "c"]


def test_a_node_leaving_to_restart_opens_the_next_round_for_all_in_one_write():
    """The others are moved to the wait list; each is placed once it announces for the new
    round (after stopping its workers), never while it still runs the old one."""
    s = Settings(min_nodes=2, max_nodes=2)
    st_, _ = join(State(), "a", s, 0, "ab")
    assert st_.complete
    st_ = leave(st_, "a", s)
    assert (st_.round, st_.complete, st_.participants, st_.wait_list) == (1, False, {}, {"a", "b"})
    assert watch_reason(st_, "b", 0, frozenset("ab"), s) is Change.NEW_ROUND
    st_, act = join(st_, "a", s, 1, "ab", rounds={"b": 0})  # b still runs round 0
    assert st_.participants == {"a": 0} and st_.wait_list == {"b"} and act.kind is Kind.WAIT
    assert leave(st_, "b", s) == st_  # already waiting for the open round: nothing to leave
    st_, act = join(st_, "b", s, 2, "ab")  # b announced for round 1
    assert act.kind is Kind.FINISH and st_.round == 1 and st_.participants == {"a": 0, "b": 1}


def test_leaving_a_complete_round_for_good_re_forms_it_with_the_others():
    """The round's ranks are what its workers run with: it is never shrunk in place (the
    one left would run rank 1 of a world of 1); the next round opens, the others wait."""
    s = Settings(min_nodes=1, max_nodes=2)
    st_, _ = join(State(), "a", s, 0, "ab")
    st_, _ = join(st_, "a", s, 2, "ab")
    gone = leave(st_, "a", s, for_good=True)
    assert (gone.round, gone.complete, gone.participants) == (1, False, {})
    assert gone.wait_list == {"b"} and "a" not in gone.nodes


@pytest.mark.parametrize(
    ("members", "dead", "round_", "complete", "participants", "waiting"),
    [
        # A complete round that loses a participant re-forms: the others wait for round 1.
        ({"a": 0, "b": 1, "c": 2}, {"b"}, 1, False, {}, {"a", "c"}),
        # ... also when it loses rank 0, or all but one.
        ({"a": 0, "b": 1}, {"a"}, 1, False, {}, {"b"}),
        # ... and when it loses them all (the last one out opens the next round).
        ({"a": 0}, {"a"}, 1, False, {}, set()),
        # A dead waiting node leaves the complete round as it is.
        ({"a": 0, "b": 1}, {"w"}, 0, True, {"a": 0, "b": 1}, set()),
    ],
)
def test_sanitize_never_rewrites_a_complete_round_in_place(
    members, dead, round_, complete, participants, waiting
):
    """Issue 33's D1 as a table: sanitize's result for a complete round of ``members`` (and
    a waiting ``w``) when ``dead`` lose their leases."""
    nodes = {n: info(n) for n in [*members, "w"]}
    state = State(round=0, complete=True, participants=members, wait_list=frozenset({"w"}),
                  nodes=nodes)  # fmt: skip
    alive = frozenset(nodes) - dead
    out = sanitize(state, alive, Settings(min_nodes=1, max_nodes=3), now=5.0)
    assert (out.round, out.complete, out.participants) == (round_, complete, participants)
    assert out.wait_list == (waiting | ({"w"} if "w" in alive else set()))


@pytest.mark.parametrize(
    ("announced", "want"),
    [(0, Change.ARRIVAL), (1, Change.ARRIVAL), (None, None)],
    ids=["for round 0", "for round 1", "none"],
)
def test_an_arrival_announced_for_round_0_is_an_arrival(announced, want):
    """Issue 33's D2 as a table: a waiting node announced for the running round 0 (or
    later) is an arrival; one with no live announcement is not."""
    state = State(round=0, complete=True, participants={"a": 0}, wait_list=frozenset({"b"}),
                  nodes={"a": info("a"), "b": info("b")})  # fmt: skip
    s = Settings(min_nodes=1, max_nodes=2)
    alive = frozenset({"a", "b"})
    assert watch_reason(state, "a", 0, alive, s, lambda node: announced) is want


def test_spares_stay_spares_when_a_round_is_opened_for_all():
    """A hot spare waits while the last round's participants come back; it steps in for a lost one."""
    s = Settings(min_nodes=2, max_nodes=2)
    st_, _ = join(State(), "a", s, 0, "ab")
    st_, _ = join(st_, "s", s, 0, "abs")
    st_ = leave(st_, "a", s)
    assert st_.redundancy_list == {"s"} and st_.wait_list == {"a", "b"}
    waiting, act = join(st_, "s", s, 1, "abs", rounds={"b": 0})
    assert act.kind is Kind.WAIT and waiting.redundancy_list == {"s"}
    st_, act = join(st_, "a", s, 1, "abs", rounds={"b": 0})
    assert st_.participants == {"a": 0} and act.kind is Kind.WAIT
    st_, act = join(st_, "b", s, 2, "abs")
    assert act.kind is Kind.FINISH and st_.participants == {"a": 0, "b": 1}
    assert st_.redundancy_list == {"s"}  # completed without waiting for the spare
    # b is lost in round 1: the round re-forms, and the spare takes b's place in round 2.
    st_, _ = join(st_, "s", s, 3, "as")
    assert st_.round == 2 and "b" not in st_.members()
    assert st_.complete and st_.participants == {"a": 0, "s": 1}


def test_lost_node_is_removed_and_survivors_complete_without_last_call():
    """A participant whose lease expired is dropped; survivors re-form at once (no last call)."""
    s = Settings(min_nodes=2, max_nodes=3, last_call_timeout=30)
    st_, _ = join(State(), "a", s, 0, "abc")
    assert st_.complete
    survivors = frozenset("ab")
    assert watch_reason(st_, "a", 0, survivors, s) is Change.LOSS
    st_, act = join(st_, "a", s, 1, "ab")  # sanitizes c away: round 0 re-forms as round 1
    assert "c" not in st_.members() and st_.round == 1
    assert act.kind is Kind.FINISH and st_.participants == {"a": 0, "b": 1}


def test_spare_replaces_lost_participant():
    """When a participant is lost, the hot spare steps into the wait list and the next round."""
    s = Settings(min_nodes=2, max_nodes=2)
    st_, _ = join(State(), "a", s, 0, "ab")
    st_, _ = join(st_, "s", s, 0, "abs")
    assert st_.redundancy_list == {"s"}
    live = frozenset("as")
    st_, act = join(st_, "s", s, 1, live)
    assert st_.round == 1 and "b" not in st_.members()  # the round re-formed
    assert st_.participants == {"a": 0, "s": 1} and not st_.redundancy_list
    assert watch_reason(st_, "a", 0, live, s) is Change.NEW_ROUND


def test_fenced_node_and_closed_rendezvous():
    """A node removed from the round is fenced; a closed rendezvous refuses joins forever."""
    s = Settings(min_nodes=1, max_nodes=2)
    st_, _ = join(State(), "a", s, 0, "ab")
    gone = replace(st_, participants={"b": st_.participants["b"]})
    assert watch_reason(gone, "a", 0, frozenset("ab"), s) is Change.FENCED
    assert watch_reason(st_, "a", 0, frozenset("b"), s) is Change.FENCED  # own lease lost
    closed = decide_close(st_).state
    assert closed is not None
    assert watch_reason(closed, "b", 0, frozenset("ab"), s) is Change.CLOSED
    assert decide_join(closed, "c", s, 0, present("abc"), FAR).kind is Kind.CLOSED
    assert decide_close(closed).kind is Kind.FINISH


def test_join_times_out_and_malformed_documents_are_errors():
    """Too few nodes by the join deadline is a TIMEOUT; a bad document is a RendezvousError."""
    s = Settings(min_nodes=2, max_nodes=2)
    st_, _ = join(State(), "a", s, 0, "a")
    assert decide_join(st_, "a", s, 50, present("a"), 10).kind is Kind.TIMEOUT
    for raw in (b"not json", b"{}", b'{"round": "x"}', b"[]"):
        with pytest.raises(RendezvousError):
            State.decode(raw)
    assert State.decode(st_.encode()) == st_


def test_settings_validate():
    """min_nodes must be positive and not above max_nodes."""
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
        st.sampled_from(["announce", "join", "exit", "die", "revive", "close", "tick"]),
        st.sampled_from("abcde"),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops, st.integers(1, 3), st.integers(0, 2))
def test_invariants_hold_under_any_schedule(schedule, min_nodes, extra):
    """Ranks unique and contiguous, ≤ max participants, closed stays closed, one list per node."""
    s = Settings(min_nodes=min_nodes, max_nodes=min_nodes + extra, last_call_timeout=2)
    state, now = State(), 0.0
    announced: dict[str, int] = {}  # node -> the round it announced for
    for op, node in schedule:
        now += 1
        if op == "die":
            announced.pop(node, None)
            continue
        if op in ("announce", "revive"):
            announced[node] = state.round
            continue
        if node not in announced:
            continue
        alive = present(announced, rounds=announced)
        if op == "join":
            announced[node] = max(announced[node], state.round)  # as the executor re-announces
            alive = present(announced, rounds=announced)
            action: Action = decide_join(state, node, s, now, alive, FAR)
        elif op == "exit":
            action = decide_exit(state, node, s)
        elif op == "close":
            action = decide_close(state)
        else:
            action = decide_join(state, node, s, now + 10, alive, FAR)
        if action.kind is Kind.WRITE:
            assert action.state is not None
            check_invariants(state, action.state, s)
            state = action.state


def absorb_one_at_a_time(state: State, present_, s: Settings, now: float) -> State:
    """The reference model of ``absorb``: torch's join op applied to each newcomer in turn."""
    for node in sorted(present_):
        if node in state.members() and not (node in state.wait_list and not state.complete):
            continue
        nodes = {**state.nodes, node: present_[node]}
        state = replace(state, wait_list=state.wait_list - {node}, nodes=nodes)
        n = len(state.participants)
        if state.complete:
            if n < s.max_nodes:
                state = replace(state, wait_list=state.wait_list | {node})
            else:
                state = replace(state, redundancy_list=state.redundancy_list | {node})
            continue
        state = replace(
            state,
            participants={**state.participants, node: 0},
            redundancy_list=state.redundancy_list - {node},
        )
        if len(state.participants) == s.min_nodes and state.deadline is None:
            state = replace(state, deadline=now + s.last_call_timeout)
        if len(state.participants) >= s.max_nodes:
            ranks = {n: r for r, n in enumerate(sorted(state.participants))}
            state = replace(state, complete=True, deadline=None, participants=ranks)
    return state


members = st.sets(st.sampled_from("abcdefgh"))


@settings(max_examples=300, deadline=None)
@given(
    members,
    members,
    members,
    members,
    st.booleans(),
    st.integers(1, 4),
    st.integers(0, 3),
    st.sampled_from([None, 1.0]),
)
def test_absorb_in_one_pass_equals_placing_one_node_at_a_time(
    participants, wait, spare, announced, complete, min_nodes, extra, deadline
):
    s = Settings(min_nodes=min_nodes, max_nodes=min_nodes + extra, last_call_timeout=2)
    wait, spare = wait - participants, spare - participants - wait
    participants = set(list(sorted(participants))[: s.max_nodes])
    state = State(
        complete=complete and len(participants) >= min_nodes,
        deadline=deadline,
        participants={n: r for r, n in enumerate(sorted(participants))},
        wait_list=frozenset(wait),
        redundancy_list=frozenset(spare),
        nodes=present(participants | wait | spare),
    )
    expected = absorb_one_at_a_time(state, present(announced), s, 5.0)
    assert absorb(state, present(announced), s, 5.0) == expected


def test_completed_round_views_are_computed_once():
    s = Settings(min_nodes=2, max_nodes=2)
    state = absorb(State(), present("ab"), s, 0.0)
    assert state.complete
    assert state.slots() == state.slots() and state.slots() is not state.slots()
    assert state.master() == (info("a").addr, info("a").port)
    assert State.decode(state.encode()).slots() == state.slots()


@pytest.mark.parametrize(
    ("announced", "expected"),
    [
        ({"c": 0}, None),  # c was left in the wait list by the dissolve and died: not an arrival
        ({}, None),  # no live announcement at all
        ({"c": 1}, Change.ARRIVAL),  # c announced for this round: a real (late) arrival
        ({"c": 2}, Change.ARRIVAL),
    ],
)
def test_only_a_node_that_announced_for_this_round_is_an_arrival(announced, expected):
    """One node loss costs one re-formation: a stale wait-list entry never triggers another."""
    s = Settings(min_nodes=2, max_nodes=4)
    info = NodeInfo(addr="h", role="default", local_world_size=1, port=1, round=1)
    state = State(
        round=1,
        complete=True,
        participants={"a": 0, "b": 1},
        wait_list=frozenset({"c"}),
        nodes={"a": info, "b": info},
    )
    alive = frozenset("abc")  # c's lease has not expired yet
    reason = watch_reason(state, "a", 1, alive, s, announced.get)
    assert reason is expected
    # Without announcement rounds (old callers) every waiting node counts.
    assert watch_reason(state, "a", 1, alive, s) is Change.ARRIVAL


@pytest.mark.parametrize(
    ("c_heads_for", "now", "expected", "until"),
    [
        # c died in round 0 (its lease lives on): it never said it is leaving round 0.
        (0, 100.1, Kind.WAIT, 100.25),  # within ack_timeout of the round's opening: wait
        (0, 100.25, Kind.WRITE, None),  # then presumed dead: complete without it
        (0, 103.0, Kind.WRITE, None),
        # c said it heads for round 1 (it is stopping its workers): wait for it, up to
        # the last call, as for any straggler.
        (1, 100.25, Kind.WAIT, 101.0),
        (1, 100.9, Kind.WAIT, 101.0),
        (1, 101.0, Kind.WRITE, None),  # the last call is over
    ],
)
def test_a_waiting_node_that_never_said_it_is_leaving_is_presumed_dead(
    c_heads_for, now, expected, until
):
    """A node that died keeps its presence key until its lease expires; the re-rendezvous
    does not wait out the last call for it unless it said it is on its way."""
    s = Settings(min_nodes=2, max_nodes=4, last_call_timeout=1.0, ack_timeout=0.25)
    st_, _ = join(State(), "a", s, 0, "abc")
    st_, _ = join(st_, "a", s, 1.5, "abc")
    assert st_.complete and st_.participants == {"a": 0, "b": 1, "c": 2}
    st_ = decide_exit(st_, "a", s, now=100.0).state  # a's workers failed: round 1 opens
    assert st_ is not None and st_.opened_at == 100.0 and st_.wait_list == {"a", "b", "c"}
    seen = {"a": info("a", 1), "b": info("b", 1), "c": replace(info("c", 0), seen=c_heads_for)}
    st_ = decide_join(st_, "a", s, 100.0, seen, FAR).state  # a and b placed, c not
    assert st_ is not None and st_.participants == {"a": 0, "b": 0} and st_.wait_list == {"c"}
    action = decide_join(st_, "a", s, now, seen, FAR)
    assert action.kind is expected
    if expected is Kind.WAIT:
        assert action.until == until
    else:
        assert action.state is not None and action.state.complete
        assert action.state.participants == {"a": 0, "b": 1}


def test_heading_for_round_trips_and_never_falls_below_the_round():
    node = replace(info("a", 3), seen=1)
    assert node.heading_for == 3
    back = NodeInfo.from_json(replace(info("a", 3), seen=5).to_json())
    assert back.heading_for == 5 and back.round == 3
    state = State(round=2, opened_at=12.5)
    assert State.decode(state.encode()).opened_at == 12.5
    assert State.decode(State(round=2).encode()).opened_at is None


@pytest.mark.parametrize(
    ("seen_at", "now", "expected"),
    [
        (None, 100.1, Kind.WRITE),  # the opener's clock alone: 99.0 + 0.25 has passed
        (100.0, 100.1, Kind.WAIT),  # this node saw the round open at 100.0: not yet
        (100.0, 100.25, Kind.WRITE),
        (98.0, 99.3, Kind.WRITE),  # seen before the opener's time: the later one counts
    ],
)
def test_presumption_counts_from_when_this_node_saw_the_round_open(seen_at, now, expected):
    """An opener whose clock runs behind cannot make live nodes look dead at once."""
    s = Settings(min_nodes=2, max_nodes=4, last_call_timeout=5.0, ack_timeout=0.25)
    st_, _ = join(State(), "a", s, 0, "abc")
    st_, _ = join(st_, "a", s, 5.5, "abc")
    st_ = decide_exit(st_, "a", s, now=99.0).state  # the opener's clock is 1 s behind
    seen = {"a": info("a", 1), "b": info("b", 1), "c": info("c", 0)}
    st_ = decide_join(st_, "a", s, 99.0, seen, FAR).state
    assert st_ is not None and st_.wait_list == {"c"}
    assert decide_join(st_, "a", s, now, seen, FAR, seen_at).kind is expected


@pytest.mark.parametrize(
    ("winner", "expected"),
    [
        (State(round=2, complete=True, participants={"a": 0, "b": 1}), Next.DONE),
        (State(round=2, complete=False, participants={"a": 0, "b": 1}), Next.LIGHT),
        (State(round=2, complete=True, participants={"b": 0}), Next.LIST),
        (State(round=2, complete=False, participants={"b": 0}), Next.LIST),
        (State(round=2, complete=True, closed=True, participants={"a": 0}), Next.LIST),
        (State(round=2, closed=True, participants={"a": 0}), Next.LIST),
    ],
    ids=["done", "placed-open", "left-out", "not-placed", "closed-complete", "closed-open"],
)
def test_a_lost_write_reads_no_listing_when_the_winner_answers(winner: State, expected: Next):
    """After losing a CAS, node a is done, waits in its open round, or lists again."""
    assert after_lost_write(winner, "a") is expected


@pytest.mark.parametrize(
    ("action", "wait_list", "large", "follows"),
    [
        (Action(Kind.WAIT, presence=False), frozenset({"c"}), False, True),
        (Action(Kind.WAIT, presence=False), frozenset(), True, True),
        (Action(Kind.WAIT, presence=False), frozenset(), False, False),
        (Action(Kind.WAIT, presence=True), frozenset({"c"}), True, False),
        (Action(Kind.FINISH), frozenset({"c"}), True, False),
    ],
    ids=[
        "waits-for-last-round",
        "large-first-round",
        "small-nothing-awaited",
        "presence",
        "finish",
    ],
)
def test_the_holder_keeps_the_role_only_to_place_awaited_arrivals(
    action: Action, wait_list: frozenset[str], large: bool, follows: bool
):
    """The absorber's holder follows arrivals inside an open round, else lets the role go."""
    state = State(round=1, participants={"a": 0}, wait_list=wait_list)
    assert holder_follows(action, state, large=large) is follows


@pytest.mark.parametrize(
    "node",
    [
        {"addr": "h", "role": "default", "lws": MAX_LOCAL_WORLD_SIZE + 1, "port": 1},
        {"addr": "h", "role": "default", "lws": 0, "port": 1},
        {"addr": "h", "role": "default", "lws": 1, "port": 70000},
        {"addr": "h" * 300, "role": "default", "lws": 1, "port": 1},
    ],
)
def test_a_rendezvous_document_cannot_ask_for_unbounded_workers(node: dict[str, object]) -> None:
    """The round document is store data anyone with store access can write: its join infos
    are bounded before anything is started from them (the agent also refuses a round that
    gives this node another number of workers than the job's nproc_per_node)."""
    doc = (
        b'{"round": 0, "complete": true, "closed": false, "deadline": null,'
        b' "participants": {"a": 0}, "wait_list": [], "redundancy_list": [], "nodes": {"a": '
        + __import__("json").dumps(node).encode()
        + b"}}"
    )
    with pytest.raises(RendezvousError, match="malformed"):
        State.decode(doc)


def _valid(state: State, s: Settings) -> str | None:
    p, w, r = set(state.participants), set(state.wait_list), set(state.redundancy_list)
    if p & w or p & r or w & r:
        return "the lists overlap"
    if len(p) > s.max_nodes:
        return "more participants than max_nodes"
    if state.complete and sorted(state.participants.values()) != list(range(len(p))):
        return "ranks not 0..n-1"
    if state.complete and not s.min_nodes <= len(p) <= s.max_nodes:
        return "a complete round outside min..max"
    if not (p | w | r) <= set(state.nodes):
        return "a member without join info"
    return None


def test_every_join_and_exit_decision_keeps_the_document_valid():
    """20,000 seeded valid documents, live sets, announcements and clocks: every write
    ``decide_join`` or ``decide_exit`` asks for is a valid document, never goes back a
    round, and never rewrites a complete round in place (issue 33's D1 class)."""
    import random

    rng = random.Random(33)
    for _ in range(20_000):
        names = [f"n{i}" for i in range(rng.randint(1, 6))]
        mx = rng.randint(1, len(names))
        s = Settings(min_nodes=rng.randint(1, mx), max_nodes=mx, last_call_timeout=1.0)
        rnd, complete = rng.randint(0, 3), rng.random() < 0.5
        members = rng.sample(names, len(names))
        k = rng.randint(s.min_nodes, mx) if complete else rng.randint(0, mx - 1)
        parts, rest = members[:k], members[k:]
        wait = [x for x in rest if rng.random() < 0.4]
        spare = [x for x in rest if x not in wait and rng.random() < 0.3]
        state = State(
            round=rnd,
            complete=complete,
            participants={p: i for i, p in enumerate(sorted(parts))} if complete
            else dict.fromkeys(parts, 0),
            wait_list=frozenset(wait),
            redundancy_list=frozenset(spare),
            nodes={x: info(x, rnd) for x in parts + wait + spare},
            deadline=100.0 if not complete and k >= s.min_nodes and rng.random() < 0.7 else None,
            opened_at=rng.choice([None, 99.0]),
        )  # fmt: skip
        present = {x: info(x, max(0, rnd + rng.choice([0, 0, -1, 1]))) for x in names
                   if rng.random() < 0.8}  # fmt: skip
        me = rng.choice(names)
        present.setdefault(me, info(me, rnd))
        now = rng.choice([99.5, 100.5, 200.0])
        actions = [decide_join(state, me, s, now, present, FAR, rng.choice([None, 99.0]))]
        actions += [decide_exit(state, me, s, for_good=g, now=now) for g in (False, True)]
        for action in actions:
            if action.kind is not Kind.WRITE:
                continue
            new = action.state
            assert new is not None
            assert _valid(new, s) is None, (_valid(new, s), state, me, action)
            assert new.round >= state.round
            if state.complete and new.round == state.round and new.complete:
                assert new.participants == state.participants, (state, action)
