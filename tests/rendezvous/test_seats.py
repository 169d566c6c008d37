"""The pure functions a large job joins by (issue 16): seats, the head, and a node's next look."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elasticd.errors import RendezvousError
from elasticd.rendezvous.protocol import (
    ROSTER_INLINE,
    Absorber,
    Head,
    Look,
    NodeInfo,
    Seat,
    State,
    look,
    seats,
    skip_exit,
)
from elasticd.rendezvous.ranks import NodeSlot, assign_ranks, ranks_from


def complete_round(shape: list[tuple[str, int]], round_: int = 3) -> State:
    """A complete round whose node ``n{i}`` has role and local world size ``shape[i]``."""
    names = [f"n{i:03}" for i in range(len(shape))]
    nodes = {
        name: NodeInfo("10.0.0.1", role, lws, 29500 + i, round=round_, seen=round_)
        for i, (name, (role, lws)) in enumerate(zip(names, shape, strict=True))
    }
    return State(
        round=round_,
        complete=True,
        participants={name: i for i, name in enumerate(names)},
        nodes=nodes,
    )


@given(
    st.lists(
        st.tuples(st.sampled_from(["trainer", "evaluator"]), st.integers(1, 8)),
        min_size=1,
        max_size=40,
    )
)
def test_every_seat_gives_the_ranks_assign_ranks_gives_that_node(shape):
    """The completer's one pass gives each node the ranks it would compute from the node list."""
    state = complete_round(shape)
    slots = state.slots()
    for node, seat in seats(state).items():
        expected = assign_ranks(slots, state.participants[node])
        got = ranks_from(
            base_rank=seat.base_rank,
            world_size=seat.world_size,
            base_role_rank=seat.base_role_rank,
            role_world_size=seat.role_world_size,
            local_world_size=seat.local_world_size,
            group_rank=seat.group_rank,
            group_world_size=seat.group_world_size,
            role=seat.role,
        )
        assert got == expected
        assert (seat.master_addr, seat.master_port) == state.master()
        assert Seat.decode(seat.encode()) == seat


def test_seat_is_constant_size_and_names_peers_only_in_small_rounds():
    """A seat of a large round does not grow with the round; a small one carries the roster."""
    small = seats(complete_round([("default", 1)] * ROSTER_INLINE))
    large = seats(complete_round([("default", 1)] * 1000))
    assert small["n000"].participants is not None
    assert len(small["n000"].participants) == ROSTER_INLINE
    assert large["n999"].participants is None
    assert len(large["n999"].encode()) < 300


def test_only_a_complete_round_has_seats():
    """An open round has no ranks yet."""
    with pytest.raises(RendezvousError):
        seats(State(participants={"a": 0}, nodes={"a": NodeInfo("h", "r", 1, 1)}))


@pytest.mark.parametrize(
    "raw",
    [
        b"not json",
        b"{}",
        json.dumps({"round": 1, "group_rank": 5, "group_world_size": 2}).encode(),
        Seat(1, 0, 1, "h", 1, "r", 1, 0, 1, 0, 1).encode().replace(b'"lws": 1', b'"lws": 0'),
        Seat(1, 2, 2, "h", 1, "r", 1, 0, 1, 0, 1).encode(),  # group rank out of bounds
    ],
)
def test_a_malformed_seat_is_an_error_not_a_crash(raw):
    """Store contents are untrusted: a bad seat raises RendezvousError."""
    with pytest.raises(RendezvousError):
        Seat.decode(raw)


def test_head_round_trips_and_anything_malformed_reads_as_absent():
    """The head says round, status, deadline and first participant; garbage is no head."""
    state = State(round=2, deadline=7.5, participants={"b": 0, "a": 0})
    head = Head.of(state)
    assert head == Head(round=2, complete=False, closed=False, deadline=7.5, first="a")
    assert Head.decode(head.encode()) == head
    assert Head.decode(None) is None
    assert Head.decode(b"3") is None  # the old form (a bare round number) is read as no head
    assert Head.decode(b"{") is None


def test_the_document_keeps_nodes_as_rows_and_still_reads_the_old_form():
    """Ten thousand nodes fit under the 1 MiB value limit; documents written before still load."""
    state = complete_round([("default", 1)] * 10_000)
    raw = state.encode()
    assert len(raw) < 1024 * 1024
    assert State.decode(raw) == state
    old = json.loads(raw)
    old["nodes"] = {k: NodeInfo.from_json(v).to_json() for k, v in old["nodes"].items()}
    assert State.decode(json.dumps(old).encode()) == state


@pytest.mark.parametrize(
    ("head", "seat_round", "expected"),
    [
        (None, None, 0),  # a new job, a new node: nothing to leave
        (None, 2, None),  # seated once, but no head: read the document
        (Head(round=0), None, 0),  # the first round is open: announce for it
        (Head(round=3, complete=True), None, 4),  # never seated: wait for the next round
        (Head(round=3, complete=True), 3, None),  # a participant: it must open the next round
        (Head(round=4), 3, 4),  # round 4 was opened for all: it is in the wait list
        (Head(round=4, complete=True), 3, 5),  # round 4 formed without it: arrive for 5
        (Head(round=3, closed=True), 3, None),  # closed: the document says so
    ],
)
def test_when_a_node_may_leave_without_reading_the_document(head, seat_round, expected):
    """Leaving reads the document only when this node may sit in the complete round."""
    assert skip_exit(head, seat_round) == expected


NOW, JOIN_BY, GRACE = 100.0, 700.0, 1.0
HELD = Absorber(holder="n007", until=NOW + 10)
FREE = Absorber()


@pytest.mark.parametrize(
    ("head", "absorber", "me", "my_round", "tried", "patient_until", "expected"),
    [
        (Head(closed=True), FREE, "a", 0, False, None, (Look.CLOSED, None)),
        (Head(round=2, complete=True), HELD, "a", 2, True, None, (Look.SEAT, None)),
        (Head(round=3), HELD, "a", 2, True, None, (Look.REANNOUNCE, None)),
        (Head(round=2, complete=True), FREE, "a", 3, False, None, (Look.TAKE, None)),
        (Head(), FREE, "a", 0, False, None, (Look.TAKE, None)),
        (Head(), FREE, "a", 0, True, None, (Look.WAIT, JOIN_BY)),  # lost the race: wait
        (Head(), FREE, "a", 0, False, NOW + 5, (Look.WAIT, NOW + 5)),  # the crowd: patience
        (Head(), FREE, "a", 0, False, NOW - 1, (Look.TAKE, None)),  # patience spent
        (Head(), HELD, "a", 0, False, None, (Look.WAIT, NOW + 10 + GRACE)),
        # A hold past its time, plus the grace: displace the stuck holder.
        (Head(), Absorber("n007", NOW - GRACE - 0.1), "a", 0, True, None, (Look.WAIT, JOIN_BY)),
        (Head(), Absorber("n007", NOW - GRACE - 0.1), "a", 0, False, None, (Look.TAKE, None)),
        # The last call: its first participant completes at the deadline, the others after.
        (Head(deadline=NOW + 2, first="a"), HELD, "a", 0, True, None, (Look.WAIT, NOW + 2)),
        (Head(deadline=NOW + 2, first="a"), HELD, "b", 0, True, None, (Look.WAIT, NOW + 3)),
        (Head(deadline=NOW, first="a"), HELD, "a", 0, True, None, (Look.DECIDE, None)),
    ],
)
def test_a_joining_nodes_next_look(head, absorber, me, my_round, tried, patient_until, expected):
    """What a node of a large job does from the head and the absorber role alone."""
    got = look(head, absorber, me, my_round, NOW, JOIN_BY, GRACE, tried, patient_until)
    assert got == expected


def test_past_the_join_deadline_a_node_decides_on_the_document():
    """The join timeout is decided where it always was: on the document."""
    assert look(Head(), HELD, "a", 0, NOW, NOW - 1, GRACE, True) == (Look.DECIDE, None)


def test_slots_agree_with_seats_on_the_node_list():
    """The node list a small round still carries and the seats describe the same round."""
    state = complete_round([("default", 2), ("default", 3)])
    assert state.slots() == [NodeSlot(0, "default", 2), NodeSlot(1, "default", 3)]
    assert [s.base_rank for s in seats(state).values()] == [0, 2]


def test_a_hold_counts_until_its_overdue_margin_has_passed_too():
    """Large jobs give a holder whose renewal queues a whole hold more before displacing it."""
    late = Absorber("n007", NOW - GRACE - 0.1)
    assert look(Head(), late, "a", 0, NOW, JOIN_BY, GRACE, False, None, 15.0) == (
        Look.WAIT,
        late.until + 15.0,
    )
