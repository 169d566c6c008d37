"""torchft's Lighthouse messages in protobuf's wire format, encoded and decoded by hand.

The messages of ``torchft.LighthouseService`` (torchft 0.2.0's ``proto/torchft.proto``)::

    QuorumMember     replica_id=1 string, address=2 string, store_address=3 string,
                     step=4 int64, world_size=5 uint64, shrink_only=6 bool,
                     data=7 string (JSON text), commit_failures=8 int64
    Timestamp        seconds=1 int64, nanos=2 int32        (google.protobuf.Timestamp)
    Quorum           quorum_id=1 int64, participants=2 repeated QuorumMember, created=3 Timestamp
    LighthouseQuorumRequest     requester=1 QuorumMember
    LighthouseQuorumResponse    quorum=1 Quorum
    LighthouseHeartbeatRequest  replica_id=1 string
    LighthouseHeartbeatResponse (empty)

Only the wire format is needed (varints and length-delimited fields), so no protobuf
package is: grpcio's generic handlers carry bytes, and these functions turn them into
frozen data classes and back. Decoding follows proto3: unknown fields of any wire type are
skipped, a scalar given twice keeps the last, a singular message given twice is merged
(parsed from the concatenation of its parts), absent fields are their defaults.

Which side of the boundary: the daemon, facing every local process that can connect. So
every input is bounded before it is parsed: a request over :data:`MAX_MESSAGE_BYTES` (a
quorum, which only the Lighthouse writes, over :data:`MAX_RESPONSE_BYTES`), more
than :data:`MAX_PARTICIPANTS` members, a string over :data:`MAX_STRING_BYTES` or not
UTF-8, a varint longer than ten bytes, a field number 0, a group (wire types 3 and 4),
or a length past the end raise :class:`ProtoError` naming what was wrong. The encoders
refuse what the decoders would (an answer no Manager could read is a bug here).
Standard library only.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

__all__ = [
    "HEARTBEAT_RESPONSE",
    "MAX_MESSAGE_BYTES",
    "MAX_PARTICIPANTS",
    "MAX_RESPONSE_BYTES",
    "MAX_STRING_BYTES",
    "ProtoError",
    "Quorum",
    "QuorumMember",
    "Timestamp",
    "decode_heartbeat_request",
    "decode_member",
    "decode_quorum",
    "decode_quorum_request",
    "decode_quorum_response",
    "encode_heartbeat_request",
    "encode_member",
    "encode_quorum",
    "encode_quorum_request",
    "encode_quorum_response",
]

#: Largest message decoded or encoded (bytes): a request is a few hundred bytes.
MAX_MESSAGE_BYTES = 64 * 1024
#: Largest quorum (answer) encoded or decoded: 1,024 members of a few hundred bytes each fit,
#: and it is the default limit of the Managers' gRPC client (tonic's, 4 MiB).
MAX_RESPONSE_BYTES = 4 * 1024 * 1024
#: Most members one quorum holds.
MAX_PARTICIPANTS = 1024
#: Longest string field (bytes of UTF-8).
MAX_STRING_BYTES = 4096

_VARINT, _I64, _LEN, _SGROUP, _EGROUP, _I32 = 0, 1, 2, 3, 4, 5
_U64 = 1 << 64
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1


class ProtoError(ValueError):
    """Bytes that are not a valid, bounded message of the Lighthouse protocol."""


@dataclass(frozen=True, slots=True)
class QuorumMember:
    """One replica group as its Manager describes itself (and as a quorum lists it)."""

    replica_id: str = ""
    address: str = ""
    store_address: str = ""
    step: int = 0
    world_size: int = 0
    shrink_only: bool = False
    data: str = ""
    commit_failures: int = 0


@dataclass(frozen=True, slots=True)
class Timestamp:
    seconds: int = 0
    nanos: int = 0


@dataclass(frozen=True, slots=True)
class Quorum:
    quorum_id: int = 0
    participants: tuple[QuorumMember, ...] = ()
    created: Timestamp = field(default_factory=Timestamp)


# the wire


def _varint(value: int) -> bytes:
    if value < 0:
        value += _U64  # two's complement in ten bytes, as protobuf writes negative int64
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    for i in range(10):
        if pos + i >= len(buf):
            raise ProtoError("a varint runs past the end of the message")
        byte = buf[pos + i]
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            if value >= _U64:
                raise ProtoError("a varint is over 64 bits")
            return value, pos + i + 1
        shift += 7
    raise ProtoError("a varint is longer than ten bytes")


def _fields(buf: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """``(field number, wire type, value)`` of each field; skips nothing (the caller does)."""
    pos = 0
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        number, kind = key >> 3, key & 7
        if number == 0:
            raise ProtoError("field number 0")
        if kind == _VARINT:
            value, pos = _read_varint(buf, pos)
            yield number, kind, value
        elif kind == _LEN:
            size, pos = _read_varint(buf, pos)
            if size > len(buf) - pos:
                raise ProtoError(f"field {number}'s length {size} runs past the end")
            yield number, kind, buf[pos : pos + size]
            pos += size
        elif kind in (_I64, _I32):
            width = 8 if kind == _I64 else 4
            if pos + width > len(buf):
                raise ProtoError(f"field {number} runs past the end")
            yield number, kind, buf[pos : pos + width]
            pos += width
        elif kind in (_SGROUP, _EGROUP):
            raise ProtoError(f"field {number} is a group (wire type {kind}), not proto3")
        else:
            raise ProtoError(f"field {number} has wire type {kind}, which does not exist")


def _check_size(buf: bytes, what: str, limit: int = MAX_MESSAGE_BYTES) -> None:
    if len(buf) > limit:
        raise ProtoError(f"{what} of {len(buf)} bytes is over {limit} bytes")


def _want(kind: int, expected: int, number: int, what: str) -> None:
    if kind != expected:
        raise ProtoError(f"{what} field {number} has wire type {kind}, not {expected}")


def _text(raw: bytes, name: str) -> str:
    if len(raw) > MAX_STRING_BYTES:
        raise ProtoError(f"{name} is {len(raw)} bytes, over {MAX_STRING_BYTES}")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProtoError(f"{name} is not UTF-8") from exc


def _signed(value: int, bits: int = 64) -> int:
    value &= (1 << bits) - 1
    return value - (1 << bits) if value >= 1 << (bits - 1) else value


def _put_varint(out: bytearray, number: int, value: int) -> None:
    if value:
        out += _varint(number << 3 | _VARINT)
        out += _varint(value)


def _put_bytes(out: bytearray, number: int, raw: bytes, always: bool = False) -> None:
    if raw or always:
        out += _varint(number << 3 | _LEN)
        out += _varint(len(raw))
        out += raw


def _put_text(out: bytearray, number: int, text: str, name: str) -> None:
    raw = text.encode("utf-8")
    if len(raw) > MAX_STRING_BYTES:
        raise ProtoError(f"{name} is {len(raw)} bytes, over {MAX_STRING_BYTES}")
    _put_bytes(out, number, raw)


def _check_int64(value: int, name: str) -> None:
    if not _I64_MIN <= value <= _I64_MAX:
        raise ProtoError(f"{name} {value} is outside int64")


def _finish(out: bytearray, what: str, limit: int = MAX_MESSAGE_BYTES) -> bytes:
    raw = bytes(out)
    _check_size(raw, what, limit)
    return raw


# QuorumMember

_MEMBER_TEXT = {1: "replica_id", 2: "address", 3: "store_address", 7: "data"}


def encode_member(member: QuorumMember) -> bytes:
    out = bytearray()
    _put_text(out, 1, member.replica_id, "replica_id")
    _put_text(out, 2, member.address, "address")
    _put_text(out, 3, member.store_address, "store_address")
    _check_int64(member.step, "step")
    _put_varint(out, 4, member.step)
    if not 0 <= member.world_size < _U64:
        raise ProtoError(f"world_size {member.world_size} is outside uint64")
    _put_varint(out, 5, member.world_size)
    _put_varint(out, 6, int(member.shrink_only))
    _put_text(out, 7, member.data, "data")
    _check_int64(member.commit_failures, "commit_failures")
    _put_varint(out, 8, member.commit_failures)
    return _finish(out, "a QuorumMember")


def decode_member(buf: bytes) -> QuorumMember:
    _check_size(buf, "a QuorumMember")
    values: dict[str, object] = {}
    for number, kind, value in _fields(buf):
        if number in _MEMBER_TEXT:
            _want(kind, _LEN, number, "QuorumMember")
            assert isinstance(value, bytes)
            values[_MEMBER_TEXT[number]] = _text(value, _MEMBER_TEXT[number])
        elif number in (4, 5, 6, 8):
            _want(kind, _VARINT, number, "QuorumMember")
            assert isinstance(value, int)
            if number == 4:
                values["step"] = _signed(value)
            elif number == 5:
                values["world_size"] = value
            elif number == 6:
                values["shrink_only"] = value != 0
            else:
                values["commit_failures"] = _signed(value)
    return QuorumMember(**values)  # type: ignore[arg-type]


# Timestamp and Quorum


def _encode_timestamp(ts: Timestamp) -> bytes:
    _check_int64(ts.seconds, "created.seconds")
    if not -(1 << 31) <= ts.nanos < 1 << 31:
        raise ProtoError(f"created.nanos {ts.nanos} is outside int32")
    out = bytearray()
    _put_varint(out, 1, ts.seconds)
    _put_varint(out, 2, ts.nanos)
    return bytes(out)


def _decode_timestamp(buf: bytes) -> Timestamp:
    seconds = nanos = 0
    for number, kind, value in _fields(buf):
        if number in (1, 2):
            _want(kind, _VARINT, number, "Timestamp")
            assert isinstance(value, int)
            if number == 1:
                seconds = _signed(value)
            else:
                nanos = _signed(value, 32)  # int32 travels sign-extended; keep its low 32 bits
    return Timestamp(seconds, nanos)


def encode_quorum(quorum: Quorum) -> bytes:
    if len(quorum.participants) > MAX_PARTICIPANTS:
        raise ProtoError(
            f"a quorum of {len(quorum.participants)} members is over {MAX_PARTICIPANTS}"
        )
    out = bytearray()
    _check_int64(quorum.quorum_id, "quorum_id")
    _put_varint(out, 1, quorum.quorum_id)
    for member in quorum.participants:
        _put_bytes(out, 2, encode_member(member), always=True)
    _put_bytes(out, 3, _encode_timestamp(quorum.created), always=True)
    return _finish(out, "a Quorum", MAX_RESPONSE_BYTES)


def decode_quorum(buf: bytes) -> Quorum:
    _check_size(buf, "a Quorum", MAX_RESPONSE_BYTES)
    quorum_id = 0
    members: list[QuorumMember] = []
    created = b""
    for number, kind, value in _fields(buf):
        if number == 1:
            _want(kind, _VARINT, number, "Quorum")
            assert isinstance(value, int)
            quorum_id = _signed(value)
        elif number == 2:
            _want(kind, _LEN, number, "Quorum")
            if len(members) == MAX_PARTICIPANTS:
                raise ProtoError(f"a quorum of more than {MAX_PARTICIPANTS} members")
            assert isinstance(value, bytes)
            members.append(decode_member(value))
        elif number == 3:
            _want(kind, _LEN, number, "Quorum")
            assert isinstance(value, bytes)
            created += value  # a message given twice is merged
    return Quorum(quorum_id, tuple(members), _decode_timestamp(created))


# the service's requests and responses


def _single_message(
    buf: bytes, what: str, inner: str, limit: int = MAX_MESSAGE_BYTES
) -> bytes | None:
    """The bytes of field 1 (a message) of ``buf``, merged when given twice; None if absent."""
    _check_size(buf, what, limit)
    found: bytes | None = None
    for number, kind, value in _fields(buf):
        if number == 1:
            _want(kind, _LEN, number, what)
            assert isinstance(value, bytes)
            found = (found or b"") + value
            _check_size(found, inner, limit)
    return found


def encode_quorum_request(requester: QuorumMember) -> bytes:
    out = bytearray()
    _put_bytes(out, 1, encode_member(requester), always=True)
    return _finish(out, "a LighthouseQuorumRequest")


def decode_quorum_request(buf: bytes) -> QuorumMember:
    """The requester; a request without one is refused (torchft answers INVALID_ARGUMENT)."""
    raw = _single_message(buf, "LighthouseQuorumRequest", "its requester")
    if raw is None:
        raise ProtoError("the quorum request names no requester")
    return decode_member(raw)


def encode_quorum_response(quorum: Quorum) -> bytes:
    out = bytearray()
    _put_bytes(out, 1, encode_quorum(quorum), always=True)
    return _finish(out, "a LighthouseQuorumResponse", MAX_RESPONSE_BYTES)


def decode_quorum_response(buf: bytes) -> Quorum:
    raw = _single_message(buf, "LighthouseQuorumResponse", "its quorum", MAX_RESPONSE_BYTES)
    return decode_quorum(raw or b"")


def encode_heartbeat_request(replica_id: str) -> bytes:
    out = bytearray()
    _put_text(out, 1, replica_id, "replica_id")
    return _finish(out, "a LighthouseHeartbeatRequest")


def decode_heartbeat_request(buf: bytes) -> str:
    _check_size(buf, "a LighthouseHeartbeatRequest")
    replica_id = ""
    for number, kind, value in _fields(buf):
        if number == 1:
            _want(kind, _LEN, number, "LighthouseHeartbeatRequest")
            assert isinstance(value, bytes)
            replica_id = _text(value, "replica_id")
    return replica_id


#: The heartbeat's answer: an empty message.
HEARTBEAT_RESPONSE = b""
