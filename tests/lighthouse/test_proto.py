"""torchft's Lighthouse messages: encodings checked byte by byte, round trips, hostile bytes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticd.lighthouse import proto
from elasticd.lighthouse.proto import ProtoError, Quorum, QuorumMember, Timestamp


def test_a_member_encodes_as_protobuf_does() -> None:
    """Field by field: tags, varints, strings; defaults are left out (proto3)."""
    member = QuorumMember("r", "a", "s", step=300, world_size=2, shrink_only=True, data="{}")
    assert proto.encode_member(member) == (
        b"\x0a\x01r\x12\x01a\x1a\x01s\x20\xac\x02\x28\x02\x30\x01\x3a\x02{}"
    )
    assert proto.encode_member(QuorumMember()) == b""


def test_negative_int64_takes_ten_bytes() -> None:
    """An int64 of -1 is ten bytes of two's complement, and reads back as -1."""
    raw = proto.encode_member(QuorumMember("r", step=-1))
    assert raw == b"\x0a\x01r\x20" + b"\xff" * 9 + b"\x01"
    assert proto.decode_member(raw).step == -1


def test_a_quorum_response_round_trips_with_its_timestamp() -> None:
    quorum = Quorum(
        7, (QuorumMember("a", commit_failures=2), QuorumMember("b")), Timestamp(1_700_000_000, 5)
    )
    raw = proto.encode_quorum_response(quorum)
    assert proto.decode_quorum_response(raw) == quorum


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        # unknown fields of every wire type are skipped
        (
            b"\x0a\x03\x0a\x01r"
            + b"\x48\x05"
            + b"\x51"
            + b"\0" * 8
            + b"\x5d\0\0\0\0"
            + b"\x62\x00",
            QuorumMember("r"),
        ),
        # unknown fields inside the member too
        (b"\x0a\x05\x0a\x01r\x78\x01", QuorumMember("r")),
        # a scalar given twice keeps the last
        (b"\x0a\x05\x0a\x01r\x20\x01" + b"\x0a\x02\x20\x02", QuorumMember("r", step=2)),
    ],
)
def test_decoding_follows_proto3(raw: bytes, expected: QuorumMember) -> None:
    """Unknown fields skipped; a singular message given twice is merged."""
    assert proto.decode_quorum_request(raw) == expected


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (b"", "names no requester"),
        (b"\x0a\x05\x0a\x01r", "past the end"),
        (b"\x0a\x02\x20\xff", "past the end"),
        (b"\x0a\x0b\x20" + b"\xff" * 10, "longer than ten bytes"),
        (b"\x0a\x0b\x20" + b"\xff" * 9 + b"\x7f", "over 64 bits"),
        (b"\x02\x00", "field number 0"),
        (b"\x0b\x0c", "group"),
        (b"\x0e", "wire type 6"),
        (b"\x0a\x02\x08\x01", "wire type 0, not 2"),
        (b"\x0a\x03\x0a\x01\xff", "not UTF-8"),
        (b"\x0a\x84\x20\x0a\x81\x20" + b"r" * 4097, "over 4096"),
        (b"\x0a" + b"\x80" * 3 + b"\x04" + b"\0" * (64 * 1024), "over 65536 bytes"),
    ],
)
def test_hostile_requests_are_refused_with_the_reason(raw: bytes, why: str) -> None:
    """Truncated, overlong, oversized, non-UTF-8 or non-proto3 bytes: a ProtoError saying so."""
    with pytest.raises(ProtoError, match=why):
        proto.decode_quorum_request(raw)


def test_a_quorum_over_the_member_bound_is_refused_both_ways() -> None:
    """More than MAX_PARTICIPANTS members: neither encoded nor decoded."""
    many = Quorum(1, tuple(QuorumMember() for _ in range(proto.MAX_PARTICIPANTS + 1)))
    with pytest.raises(ProtoError, match="over 1024"):
        proto.encode_quorum(many)
    raw = b"\x12\x00" * (proto.MAX_PARTICIPANTS + 1)
    with pytest.raises(ProtoError, match="more than 1024"):
        proto.decode_quorum(raw)


def test_the_encoders_refuse_what_no_reader_accepts() -> None:
    with pytest.raises(ProtoError, match="over 4096"):
        proto.encode_heartbeat_request("x" * 4097)
    with pytest.raises(ProtoError, match="outside int64"):
        proto.encode_member(QuorumMember("r", step=1 << 63))
    with pytest.raises(ProtoError, match="outside uint64"):
        proto.encode_member(QuorumMember("r", world_size=-1))


def test_a_heartbeat_round_trips() -> None:
    assert proto.decode_heartbeat_request(proto.encode_heartbeat_request("g0:uuid")) == "g0:uuid"
    assert proto.decode_heartbeat_request(b"") == ""


_text = st.text(max_size=40)
_int64 = st.integers(-(1 << 63), (1 << 63) - 1)
_members = st.builds(
    QuorumMember,
    replica_id=_text,
    address=_text,
    store_address=_text,
    step=_int64,
    world_size=st.integers(0, (1 << 64) - 1),
    shrink_only=st.booleans(),
    data=_text,
    commit_failures=_int64,
)


@settings(max_examples=200, deadline=None)
@given(
    st.builds(
        Quorum,
        quorum_id=_int64,
        participants=st.lists(_members, max_size=5).map(tuple),
        created=st.builds(Timestamp, _int64, st.integers(-(1 << 31), (1 << 31) - 1)),
    )
)
def test_any_quorum_round_trips(quorum: Quorum) -> None:
    assert proto.decode_quorum_response(proto.encode_quorum_response(quorum)) == quorum


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_any_bytes_decode_or_raise_a_proto_error(raw: bytes) -> None:
    """Whatever a local process sends: a value or a ProtoError, never another exception."""
    for decode in (
        proto.decode_quorum_request,
        proto.decode_heartbeat_request,
        proto.decode_quorum,
    ):
        try:
            decode(raw)
        except ProtoError:
            pass


def test_a_full_quorum_of_real_sized_members_is_answered() -> None:
    """1,024 members of a Manager's usual size are over a request's 64 KiB bound but within
    an answer's."""
    member = QuorumMember(
        "group7:5f0c2b9e-8d1e-4c3a-9a55-0b8e2f1c7d64",
        "http://localhost:29512",
        "localhost:29500/torchft/12/0",
        step=1234,
        world_size=8,
        data="{}",
    )
    quorum = Quorum(3, (member,) * proto.MAX_PARTICIPANTS, Timestamp(1, 2))
    raw = proto.encode_quorum_response(quorum)
    assert len(raw) > proto.MAX_MESSAGE_BYTES
    assert proto.decode_quorum_response(raw) == quorum
