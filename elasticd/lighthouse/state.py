"""The Lighthouse's documents in the cluster store, and the leader's view of them (pure).

Under ``jobs/<job>/lighthouse/`` (:func:`elasticd.keys.lighthouse_prefix`)::

    leader        the node that decides, bound to its lease (created if absent)
    quorum        the quorum document: the last quorum, written by compare-and-set only
    nodes/<node>  one node's record of its local Managers, bound to its lease, put by it

A node's record (:class:`NodeRecord`) holds, per replica id, a **beat counter** (raised
by one in a write when the replica sent a heartbeat or a quorum request since the last
one: a node writes at most every ``heartbeat_timeout / 5`` for heartbeats, at once for a
request) and its **pending request**, if any, with a **ticket**: a number the node
raises with every request, so that one replica's requests are told apart.

The quorum document (:class:`QuorumDoc`) holds the quorum id, its members with the
ticket each was granted on (the nodes answer exactly the requests a quorum granted), and
``granted``: the latest ticket granted to every replica still in a record, so that a new
leader never grants a request twice (a node deletes what was granted only after it saw
the quorum). The id is stored, so it never goes back across leaders and restarts.

Liveness is judged by the leader alone, on its monotonic clock: a replica was seen when
the leader saw its counter change (:func:`observe`), never by another node's clock. A
leader that just took over has seen every replica once, now: a dead one stays healthy
for at most one heartbeat timeout.

Everything read from the store is untrusted (anyone with store credentials may write it):
documents are bounded (:data:`MAX_DOC_BYTES`) and validated field by field; a record
that does not validate, or names another node than its key, is ignored; a quorum
document that does not validate counts as absent, its id floor kept by the caller.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from elasticd.lighthouse.proto import MAX_PARTICIPANTS, MAX_STRING_BYTES, QuorumMember
from elasticd.lighthouse.rules import MAX_QUORUM_ID, Pending, State
from elasticd.models import NODE_NAME_PATTERN

__all__ = [
    "MAX_DOC_BYTES",
    "Grant",
    "NodeRecord",
    "QuorumDoc",
    "Seen",
    "StoredMember",
    "decode_doc",
    "decode_record",
    "encode",
    "new_doc",
    "observe",
]

#: Largest record or quorum document read or written (bytes; the store's limit is larger).
MAX_DOC_BYTES = 512 * 1024
#: Most grants a quorum document remembers (replicas still in some record).
MAX_GRANTS = 4 * MAX_PARTICIPANTS
#: Tickets and counters stay exact in every JSON reader.
MAX_COUNT = (1 << 53) - 1

_Text = Annotated[str, Field(max_length=MAX_STRING_BYTES)]
_Replica = Annotated[str, Field(min_length=1, max_length=MAX_STRING_BYTES)]
_Node = Annotated[str, Field(pattern=NODE_NAME_PATTERN)]
_Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
_Int64 = Annotated[int, Field(ge=-(1 << 63), le=(1 << 63) - 1)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, frozen=True, extra="forbid")


class StoredMember(_Strict):
    """A :class:`~elasticd.lighthouse.proto.QuorumMember` as the store holds it."""

    replica_id: _Replica
    address: _Text = ""
    store_address: _Text = ""
    step: _Int64 = 0
    world_size: Annotated[int, Field(ge=0, le=(1 << 64) - 1)] = 0
    shrink_only: bool = False
    data: _Text = ""
    commit_failures: _Int64 = 0

    @classmethod
    def of(cls, m: QuorumMember) -> StoredMember:
        return cls(
            replica_id=m.replica_id,
            address=m.address,
            store_address=m.store_address,
            step=m.step,
            world_size=m.world_size,
            shrink_only=m.shrink_only,
            data=m.data,
            commit_failures=m.commit_failures,
        )

    def member(self) -> QuorumMember:
        return QuorumMember(
            self.replica_id,
            self.address,
            self.store_address,
            self.step,
            self.world_size,
            self.shrink_only,
            self.data,
            self.commit_failures,
        )


class PendingRequest(_Strict):
    ticket: Annotated[int, Field(ge=1, le=MAX_COUNT)]
    member: StoredMember


class NodeRecord(_Strict):
    v: Literal[1] = 1
    node: _Node
    beats: dict[_Replica, _Count] = Field(default_factory=dict, max_length=MAX_PARTICIPANTS)
    pending: dict[_Replica, PendingRequest] = Field(
        default_factory=dict, max_length=MAX_PARTICIPANTS
    )


class Grant(_Strict):
    node: _Node
    ticket: Annotated[int, Field(ge=1, le=MAX_COUNT)]


class Participant(_Strict):
    member: StoredMember
    node: _Node
    ticket: Annotated[int, Field(ge=1, le=MAX_COUNT)]


class QuorumDoc(_Strict):
    v: Literal[1] = 1
    quorum_id: Annotated[int, Field(ge=0, le=MAX_QUORUM_ID)]
    created: tuple[_Int64, Annotated[int, Field(ge=0, le=999_999_999)]] = (0, 0)
    participants: list[Participant] = Field(default_factory=list, max_length=MAX_PARTICIPANTS)
    granted: dict[_Replica, Grant] = Field(default_factory=dict, max_length=MAX_GRANTS)
    #: The node whose leader wrote it (shown to operators; never trusted for anything).
    leader: _Node | None = None

    def members(self) -> tuple[str, ...]:
        return tuple(p.member.replica_id for p in self.participants)


def encode(doc: NodeRecord | QuorumDoc) -> bytes:
    raw = doc.model_dump_json().encode()
    if len(raw) > MAX_DOC_BYTES:
        raise ValueError(f"a Lighthouse document of {len(raw)} bytes is over {MAX_DOC_BYTES}")
    return raw


def _parse(model: type[NodeRecord] | type[QuorumDoc], raw: bytes) -> NodeRecord | QuorumDoc | str:
    if len(raw) > MAX_DOC_BYTES:
        return f"it is {len(raw)} bytes, over {MAX_DOC_BYTES}"
    try:
        return model.model_validate_json(raw)  # strict, and from JSON: a tuple is an array
    except ValidationError as exc:
        return f"it does not validate ({str(exc).splitlines()[0][:200]})"


def decode_record(raw: bytes, node: str) -> NodeRecord | str:
    """The record stored under ``nodes/<node>``, or why it is ignored."""
    parsed = _parse(NodeRecord, raw)
    if isinstance(parsed, str):
        return parsed
    assert isinstance(parsed, NodeRecord)
    if parsed.node != node:
        return f"it names node {parsed.node!r}, not its key's {node!r}"
    for replica, pending in parsed.pending.items():
        if pending.member.replica_id != replica:
            return f"its pending request under {replica[:80]!r} is another replica's"
    return parsed


def decode_doc(raw: bytes) -> QuorumDoc | str:
    """The quorum document, or why it counts as absent."""
    parsed = _parse(QuorumDoc, raw)
    if isinstance(parsed, str):
        return parsed
    assert isinstance(parsed, QuorumDoc)
    ids = parsed.members()
    if len(set(ids)) != len(ids) or list(ids) != sorted(ids):
        return "its members are not distinct and sorted"
    return parsed


@dataclass
class Seen:
    """The leader's memory of the records (its own clock): kept only while it leads."""

    #: replica -> the (node, counter) last seen, and when it was (leader's monotonic time).
    beats: dict[str, tuple[str, int]] = field(default_factory=dict)
    last_seen: dict[str, float] = field(default_factory=dict)
    #: (replica, node, ticket) -> when the leader first saw that request.
    joined: dict[tuple[str, str, int], float] = field(default_factory=dict)


@dataclass(frozen=True)
class View:
    """What :func:`observe` makes of the records: the decision's state, and for each
    pending replica the (node, ticket) a quorum would grant."""

    state: State
    tickets: Mapping[str, tuple[str, int]]


def observe(
    seen: Seen,
    records: Mapping[str, NodeRecord],
    doc: QuorumDoc | None,
    floor: int,
    now: float,
) -> View:
    """Update ``seen`` from the records at ``now`` and build the decision's state.

    ``floor``: the highest quorum id the caller has seen (the stored id, or more when the
    stored document was lost or damaged): the next quorum's id is never below it.
    Deterministic: records are read in node order, so a replica that two records name
    (one moving, or a hostile writer) is taken from the first.
    """
    granted = dict(doc.granted) if doc is not None else {}
    present: set[str] = set()
    pending: dict[str, Pending] = {}
    tickets: dict[str, tuple[str, int]] = {}
    live_requests: set[tuple[str, str, int]] = set()
    for node in sorted(records):
        record = records[node]
        for replica, count in record.beats.items():
            present.add(replica)
            if seen.beats.get(replica) != (node, count):
                seen.beats[replica] = (node, count)
                seen.last_seen[replica] = now
        for replica, request in record.pending.items():
            present.add(replica)
            seen.last_seen.setdefault(replica, now)
            grant = granted.get(replica)
            if grant is not None and grant.node == node and request.ticket <= grant.ticket:
                continue  # granted already; the node deletes it once it has seen the quorum
            if replica in pending:
                continue
            key = (replica, node, request.ticket)
            live_requests.add(key)
            joined = seen.joined.setdefault(key, now)
            pending[replica] = Pending(request.member.member(), joined)
            tickets[replica] = (node, request.ticket)
    for gone in set(seen.beats) - present:
        del seen.beats[gone]
    for gone in set(seen.last_seen) - present:
        del seen.last_seen[gone]
    for stale in set(seen.joined) - live_requests:
        del seen.joined[stale]
    quorum_id = max(floor, doc.quorum_id if doc is not None else 0)
    previous = doc.members() if doc is not None and doc.participants else None
    state = State(quorum_id, previous, pending, dict(seen.last_seen))
    return View(state, tickets)


def new_doc(
    quorum_id: int,
    members: tuple[QuorumMember, ...],
    view: View,
    old: QuorumDoc | None,
    records: Mapping[str, NodeRecord],
    created: tuple[int, int],
    leader: str,
) -> QuorumDoc:
    """The document of a new quorum: its members with their tickets, and ``granted``
    carried over for every replica still in a record."""
    present = {r for rec in records.values() for r in (*rec.beats, *rec.pending)}
    granted = {r: g for r, g in (old.granted if old else {}).items() if r in present}
    if len(granted) + len(members) > MAX_GRANTS:  # the oldest grants go first
        keep = sorted(granted, key=lambda r: granted[r].ticket)[-(MAX_GRANTS - len(members)) :]
        granted = {r: granted[r] for r in keep}
    participants = []
    for m in members:
        node, ticket = view.tickets[m.replica_id]
        participants.append(Participant(member=StoredMember.of(m), node=node, ticket=ticket))
        granted[m.replica_id] = Grant(node=node, ticket=ticket)
    return QuorumDoc(
        quorum_id=quorum_id,
        created=created,
        participants=participants,
        granted=granted,
        leader=leader,
    )


def after_grant(seen: Seen, doc: QuorumDoc, now: float) -> None:
    """A quorum went out: the requests it left waiting count as joined now (torchft's
    waiters rejoin after every quorum that does not name them, so the join timeout
    starts over for the next one)."""
    granted = {(p.member.replica_id, p.node, p.ticket) for p in doc.participants}
    for key in seen.joined:
        if key not in granted:
            seen.joined[key] = now
