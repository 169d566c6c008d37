"""The dynamic rendezvous protocol, as pure decisions over a JSON state document.

Semantics follow torch.distributed.elastic's dynamic rendezvous: a job's
nodes gather in numbered **rounds**; a round completes with between
``min_nodes`` and ``max_nodes`` **participants** (ranks assigned on
completion, sorted by node name); a node arriving at a complete round waits
in the **wait list** (which makes the participants re-rendezvous to include
it), or, when the round is full, in the **redundancy list** as a hot spare;
the **last call** holds a round open for stragglers once ``min_nodes`` have
joined; the rendezvous can be **closed** for good when the job ends.

Deliberate differences from torch:

* **Liveness comes from store leases, not heartbeats inside the document.**
  Each node announces itself with a lease-bound *presence* key holding its
  join info; a node whose key is gone is dead and is removed by whichever
  node decides next ("sanitize"). Heartbeats in the shared document would
  make every node CAS the same key every few seconds and wake every watcher;
  leases expire inside the store, and the expiry itself wakes the watchers,
  so a lost node is noticed at once.
* **Joining is batched.** A node never writes only itself into the
  document: whoever writes next *absorbs* every announced node that is in no
  list yet, in one compare-and-set. A thousand nodes arriving together cost
  a handful of writes, not a thousand racing ones, so each node makes a
  constant number of store requests.
* **Leaving is batched too.** The first participant of a complete round to
  leave it (to rejoin after a failure or for an arrival) opens the next
  round for all of them in one write (:func:`dissolve`); the others find
  the new round number, stop their workers and announce again. In torch
  each node leaves by its own write to the shared document.
* **Announcements name their round** (:attr:`NodeInfo.round`): a node is
  placed only on an announcement made for the current round, so a node that
  still runs the last round is never pulled into the next.
* **A re-rendezvous completes as soon as every live candidate has joined**
  (round > 0): the last call exists for stragglers, and after a failure the
  live set is known, so waiting out the last call would only delay recovery.
* **A node says it is on its way** (:attr:`NodeInfo.seen`): the moment a
  node decides to leave a running round (its workers failed, or it saw a
  new round open), before it stops its workers, it rewrites its
  announcement with the round it is heading for. A node that died keeps its
  presence key until its lease expires, but it never says this: once a
  re-rendezvous has been open for ``ack_timeout`` (:attr:`State.opened_at`),
  the waiting nodes that have not said so are presumed dead and the round
  completes without them instead of waiting out the last call. A live node
  that was too slow to say it joins the round after (one more re-formation:
  the price of a wrong guess, where torch always pays the last call).

Every function here is pure: ``decide_*(state, me, settings, now, alive)``
returns an :class:`Action`; the handler applies it with compare-and-set and
watches the key instead of sleeping. ``now`` is wall-clock seconds, shared
by the nodes of a cluster (as torch's ``datetime.utcnow`` is).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from functools import cached_property
from typing import Any

from elasticd.errors import RendezvousError
from elasticd.rendezvous.ranks import NodeSlot

#: The most workers one node may run for one job (a bound on what the store may ask).
MAX_LOCAL_WORLD_SIZE = 1024


@dataclass(frozen=True)
class Settings:
    """Rendezvous settings of one job."""

    min_nodes: int
    max_nodes: int
    join_timeout: float = 600.0
    last_call_timeout: float = 1.0
    #: How long a re-rendezvous waits for a waiting node to say it is on its way
    #: before it presumes the node dead (see :attr:`NodeInfo.seen`).
    ack_timeout: float = 0.25

    def __post_init__(self) -> None:
        if self.min_nodes < 1:
            raise ValueError(f"min_nodes ({self.min_nodes}) must be at least 1")
        if self.max_nodes < self.min_nodes:
            raise ValueError(
                f"max_nodes ({self.max_nodes}) must be at least min_nodes ({self.min_nodes})"
            )


@dataclass(frozen=True)
class NodeInfo:
    """What a node tells the others when it joins."""

    addr: str
    role: str
    local_world_size: int
    port: int  # a port free on this node when it joined; used if it becomes group rank 0
    #: The round this announcement is for. A node is placed in a round only on
    #: an announcement for that round (or a later one), made once its workers of
    #: the previous round are stopped: nobody can pull a node that still runs
    #: the old round into the new one, or dial the port it announced for the last.
    round: int = 0
    #: The latest round this node has said it is heading for (it may still be
    #: stopping its workers of an earlier one); never less than :attr:`round`.
    seen: int = 0

    @property
    def heading_for(self) -> int:
        return max(self.round, self.seen)

    def to_json(self) -> dict[str, Any]:
        return {
            "addr": self.addr,
            "role": self.role,
            "lws": self.local_world_size,
            "port": self.port,
            "round": self.round,
            "seen": self.heading_for,
        }

    def to_row(self) -> list[Any]:
        """The compact form the document keeps (a 10,000-node document must fit in 1 MiB)."""
        return [
            self.addr,
            self.role,
            self.local_world_size,
            self.port,
            self.round,
            self.heading_for,
        ]

    @staticmethod
    def from_json(raw: Any) -> NodeInfo:
        """From :meth:`to_json` (a presence key) or :meth:`to_row` (the document)."""
        if isinstance(raw, list):
            addr, role, lws, port, round_, seen = raw
            raw = {"addr": addr, "role": role, "lws": lws, "port": port, "round": round_}
            raw["seen"] = seen
        info = NodeInfo(
            addr=str(raw["addr"]),
            role=str(raw["role"]),
            local_world_size=int(raw["lws"]),
            port=int(raw["port"]),
            round=int(raw.get("round", 0)),
            seen=int(raw.get("seen", 0)),
        )
        # Store contents are untrusted: bounds before anything is started from them.
        if not 1 <= info.local_world_size <= MAX_LOCAL_WORLD_SIZE:
            raise ValueError(f"local world size {info.local_world_size} out of bounds")
        if not 0 < info.port < 65536 or len(info.addr) > 255 or len(info.role) > 255:
            raise ValueError("port, address or role out of bounds")
        return info


@dataclass(frozen=True)
class State:
    """The rendezvous document of one job (stored as JSON, written only by CAS)."""

    round: int = 0
    complete: bool = False
    closed: bool = False
    deadline: float | None = None
    participants: dict[str, int] = field(default_factory=dict)
    wait_list: frozenset[str] = frozenset()
    redundancy_list: frozenset[str] = frozenset()
    nodes: dict[str, NodeInfo] = field(default_factory=dict)
    #: When :func:`dissolve` opened this round (None: not known; no node is presumed dead).
    opened_at: float | None = None

    def encode(self) -> bytes:
        return json.dumps(
            {
                "round": self.round,
                "complete": self.complete,
                "closed": self.closed,
                "deadline": self.deadline,
                "participants": self.participants,
                "wait_list": sorted(self.wait_list),
                "redundancy_list": sorted(self.redundancy_list),
                "nodes": {k: v.to_row() for k, v in sorted(self.nodes.items())},
                "opened_at": self.opened_at,
            },
            sort_keys=True,
            separators=(",", ":"),
        ).encode()

    @staticmethod
    def decode(raw: bytes) -> State:
        """Parse a stored document; anything malformed is a RendezvousError, never a crash."""
        try:
            doc = json.loads(raw)
            state = State(
                round=int(doc["round"]),
                complete=bool(doc["complete"]),
                closed=bool(doc["closed"]),
                deadline=None if doc.get("deadline") is None else float(doc["deadline"]),
                participants={str(k): int(v) for k, v in doc["participants"].items()},
                wait_list=frozenset(str(n) for n in doc["wait_list"]),
                redundancy_list=frozenset(str(n) for n in doc["redundancy_list"]),
                nodes={str(k): NodeInfo.from_json(v) for k, v in doc["nodes"].items()},
                opened_at=None if doc.get("opened_at") is None else float(doc["opened_at"]),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise RendezvousError(f"the rendezvous document is malformed: {exc}") from None
        return state

    # derived views

    def members(self) -> frozenset[str]:
        return frozenset(self.participants) | self.wait_list | self.redundancy_list

    def master(self) -> tuple[str, int] | None:
        """Group rank 0's advertise address and port, once the round is complete."""
        if not self.complete:
            return None
        return self._master

    @cached_property
    def _master(self) -> tuple[str, int] | None:
        for node, rank in self.participants.items():
            if rank == 0:
                info = self.nodes[node]
                return info.addr, info.port
        return None  # pragma: no cover - a complete round always has rank 0

    def slots(self) -> list[NodeSlot]:
        """Every participant's (group rank, role, local world size), by group rank."""
        return list(self._slots)

    @cached_property
    def _slots(self) -> tuple[NodeSlot, ...]:
        # Computed once per decoded document: a process simulating many nodes
        # shares one State per version (see ``handler.decode_state``).
        return tuple(
            NodeSlot(rank, self.nodes[node].role, self.nodes[node].local_world_size)
            for node, rank in sorted(self.participants.items(), key=lambda kv: kv[1])
        )


class Kind(Enum):
    """What the executor must do next."""

    WRITE = "write"  # CAS the new state, then decide again
    WAIT = "wait"  # watch the document until it changes (or until `until`)
    FINISH = "finish"  # this node is a participant of a complete round
    CLOSED = "closed"  # the rendezvous is closed: the job is over
    TIMEOUT = "timeout"  # the join did not complete in time


@dataclass(frozen=True)
class Action:
    kind: Kind
    state: State | None = None  # the state to write (WRITE)
    until: float | None = None  # wall time to wake up at if nothing changes (WAIT)
    why: str = ""
    #: WAIT: also wake when a node's presence changes (a death is what we wait for).
    #: False only inside an open round, where the next writer is another joiner.
    presence: bool = True


# state edits (pure: each returns a new State)


def _without(state: State, node: str, now: float | None = None) -> State:
    """Remove ``node`` from every list.

    A complete round that loses a participant is never rewritten in place: its
    ranks and world size are what its workers run with, so a round shrunk in
    place would hand the next node to finish it a world below ``min_nodes``,
    a gap in the ranks, or no rank 0. It re-forms instead, as :func:`dissolve`
    opens the next round: the participants left wait for it, and each is
    placed once it announces for it (its workers of this round stopped).
    ``now`` is the new round's :attr:`State.opened_at` (None: not known).
    """
    participants = dict(state.participants)
    was_participant = participants.pop(node, None) is not None
    nodes = {k: v for k, v in state.nodes.items() if k != node}
    new = replace(
        state,
        participants=participants,
        wait_list=state.wait_list - {node},
        redundancy_list=state.redundancy_list - {node},
        nodes=nodes,
    )
    if was_participant and new.complete:
        return dissolve(new, now)
    return new


def sanitize(
    state: State, alive: frozenset[str], settings: Settings, now: float | None = None
) -> State:
    """Drop every member whose keep-alive lease is gone (a complete round that loses a
    participant re-forms: :func:`_without`)."""
    for node in sorted(state.members() - alive):
        state = _without(state, node, now)
    if not state.complete and len(state.participants) < settings.min_nodes:
        state = replace(state, deadline=None)
    return state


def _ranked(participants: Mapping[str, int]) -> dict[str, int]:
    """Group ranks on completion: by node name."""
    return {node: rank for rank, node in enumerate(sorted(participants))}


def _complete(state: State) -> State:
    return replace(state, complete=True, deadline=None, participants=_ranked(state.participants))


def needs_placing(state: State, node: str) -> bool:
    """Is ``node`` in no list, or waiting for an open round to take it in?

    The nodes :func:`absorb` places (it applies the same rule to the
    document as it changes under its hands).
    """
    return node not in state.members() or (node in state.wait_list and not state.complete)


class Next(Enum):
    """How the join loop reads the rendezvous before it decides again."""

    LIGHT = "light"  # the state key alone, and a wait while placed (the cheap step)
    LIST = "list"  # the state and every presence key (a snapshot)
    REUSE = "reuse"  # the view in hand: what this node just wrote, or what its watch saw
    DONE = "done"  # the round this node is in is complete: the join is over


def after_lost_write(winner: State, node: str) -> Next:
    """The join lost a compare-and-set to ``winner``: how it goes on, without a listing
    where the winner's document already answers.

    DONE when the winner completed a round with ``node`` in it; LIGHT when it
    placed ``node`` in a round still open (wait there, then read the key alone);
    LIST otherwise.
    """
    if winner.closed or node not in winner.participants:
        return Next.LIST
    return Next.DONE if winner.complete else Next.LIGHT


def holder_follows(action: Action, state: State, *, large: bool) -> bool:
    """Does the absorber's holder, told to wait, keep the role and follow the arrivals?

    Inside an open round that waits for the last round's participants (or, in a
    large job, for the first round's arrivals) the holder places them from its
    watch's events rather than handing the role, and a listing, to each in turn.
    """
    return action.kind is Kind.WAIT and not action.presence and (bool(state.wait_list) or large)


def absorb(state: State, present: Mapping[str, NodeInfo], settings: Settings, now: float) -> State:
    """Place every announced node that is in no list yet, in name order, in one edit.

    Each node goes where torch's join op would put it: into an open round as a
    participant (the ``min_nodes``-th starts the last call, the ``max_nodes``-th
    completes the round), or, once the round is complete, into the wait list
    while there is room and into the redundancy list after that. While a round
    is open, nodes waiting from the last round join it too. A node whose
    announcement is for an earlier round is left where it is until it
    announces again (it may still be running that round). One pass over
    mutable copies: a thousand newcomers cost O(n), not a thousand copies of
    the document.
    """
    members = state.members()
    participants = dict(state.participants)
    wait_list = set(state.wait_list)
    redundancy_list = set(state.redundancy_list)
    nodes: dict[str, NodeInfo] | None = None
    complete, deadline = state.complete, state.deadline
    for node in sorted(present):
        if node in members and not (node in wait_list and not complete):
            continue
        if present[node].round < state.round:
            continue  # announced for an earlier round: it will announce again
        if nodes is None:
            nodes = dict(state.nodes)
        nodes[node] = present[node]
        wait_list.discard(node)
        if complete:
            (wait_list if len(participants) < settings.max_nodes else redundancy_list).add(node)
            continue
        participants[node] = 0
        redundancy_list.discard(node)
        if len(participants) == settings.min_nodes and deadline is None:
            deadline = now + settings.last_call_timeout
        if len(participants) >= settings.max_nodes:
            participants = _ranked(participants)
            complete, deadline = True, None
    if nodes is None:
        return state
    return replace(
        state,
        complete=complete,
        deadline=deadline,
        participants=participants,
        wait_list=frozenset(wait_list),
        redundancy_list=frozenset(redundancy_list),
        nodes=nodes,
    )


def _presume_at(state: State, settings: Settings, seen_at: float | None) -> float | None:
    """From when a waiting node that never said it is coming may be presumed dead.

    ``ack_timeout`` after the round opened, as the opener's clock says
    (:attr:`State.opened_at`) or as this node saw it (``seen_at``, its own
    clock), whichever is later: an opener whose clock runs behind cannot make
    live nodes look dead.
    """
    if state.opened_at is None:
        return None
    start = state.opened_at if seen_at is None else max(state.opened_at, seen_at)
    return start + settings.ack_timeout


def _presumed_dead(
    state: State,
    node: str,
    present: Mapping[str, NodeInfo],
    settings: Settings,
    now: float,
    seen_at: float | None = None,
) -> bool:
    """Has a waiting node failed to say it is on its way within ``ack_timeout``?"""
    info = present.get(node)
    presume_at = _presume_at(state, settings, seen_at)
    return (
        info is not None
        and info.heading_for < state.round
        and presume_at is not None
        and now >= presume_at
    )


def _everyone_joined(
    state: State,
    me: str,
    present: Mapping[str, NodeInfo],
    settings: Settings,
    now: float,
    seen_at: float | None = None,
) -> bool:
    """After a failure the live set is known: no straggler is worth a last call.

    Everyone has joined when every live node is placed (hot spares stay
    spares: they are not waited for) and no node waits to be taken in,
    except those presumed dead: nodes that never said they are on their way
    to this round (a node that died keeps its presence key until its lease
    expires).
    """
    if state.round == 0 or not (frozenset(present) | {me}) <= state.members():
        return False
    return all(
        _presumed_dead(state, node, present, settings, now, seen_at) for node in state.wait_list
    )


def next_look(
    state: State, settings: Settings, now: float, seen_at: float | None = None
) -> float | None:
    """When a participant of an open round looks again if nothing changes.

    At the last call's deadline; in a re-rendezvous also once the nodes that
    have not said they are on their way may be presumed dead.
    """
    if state.deadline is None:
        return None
    presume_at = _presume_at(state, settings, seen_at)
    if state.round > 0 and presume_at is not None and state.wait_list and now < presume_at:
        return min(state.deadline, presume_at)
    return state.deadline


# decisions


def decide_join(
    state: State,
    me: str,
    settings: Settings,
    now: float,
    present: Mapping[str, NodeInfo],
    join_deadline: float,
    seen_at: float | None = None,
) -> Action:
    """One step of joining the next complete round.

    ``present`` maps every node with a live presence key (``me`` included,
    once announced) to its join info. ``seen_at`` is when this node first saw
    the current round open, by its own clock (see :func:`_presume_at`).
    """
    alive = frozenset(present)
    clean = sanitize(state, alive | {me}, settings, now)
    if clean != state:
        return Action(Kind.WRITE, absorb(clean, present, settings, now), why="removed dead nodes")
    if state.closed:
        return Action(Kind.CLOSED, why="the rendezvous is closed")
    n = len(state.participants)
    if me in state.redundancy_list:
        # Nodes in the wait list of an open round are the last round's
        # participants coming back: a spare takes the place of a lost one only.
        waiting = len(state.wait_list) if not state.complete else 0
        if n + waiting >= settings.max_nodes:
            return Action(Kind.WAIT, why="hot spare: the round is full")
        new = replace(
            state,
            redundancy_list=state.redundancy_list - {me},
            wait_list=state.wait_list | {me},
        )
        return Action(Kind.WRITE, new, why="a participant is gone: the spare steps in")
    if state.complete and me in state.participants:
        return Action(Kind.FINISH)
    if now > join_deadline:
        return Action(Kind.TIMEOUT, why=f"fewer than {settings.min_nodes} nodes joined in time")
    new = absorb(state, present, settings, now)
    if new != state:
        return Action(Kind.WRITE, new, why="placing every announced node (this one included)")
    if state.complete:
        return Action(Kind.WAIT, why="waiting for the next round")
    if me in state.participants:
        if n >= settings.min_nodes and (
            (state.deadline is not None and now >= state.deadline)
            or _everyone_joined(state, me, present, settings, now, seen_at)
        ):
            return Action(Kind.WRITE, _complete(state), why=f"completing the round with {n} nodes")
        until = (
            next_look(state, settings, now, seen_at) if n >= settings.min_nodes else join_deadline
        )
        return Action(
            Kind.WAIT,
            until=min(until or join_deadline, join_deadline),
            presence=False,
            why="in the open round, waiting for it to complete",
        )
    return Action(Kind.WAIT, why="announced; waiting to be placed")  # pragma: no cover


def dissolve(state: State, now: float | None = None) -> State:
    """Open the next round for every participant of a complete one, in one write.

    The participants, the leaving one included, move to the wait list of the
    new round: each is placed once it announces for that round, i.e. once it
    has stopped its workers (the others notice the new round number first).
    Nodes already waiting stay waiting, and hot spares stay spares: they
    count the wait list as taken places, so a spare steps in only for a
    participant that is lost, not for one that is on its way back. Without
    this, each of N nodes would leave by its own compare-and-set on the one
    document: O(N) contended writes, each waking every watcher (measured: 300
    nodes took 35 s to re-form in-process). ``now`` is recorded as the round's
    :attr:`State.opened_at`, from which waiting nodes that never say they are
    on their way are presumed dead.
    """
    return replace(
        state,
        round=state.round + 1,
        complete=False,
        deadline=None,
        participants={},
        wait_list=frozenset(state.participants) | state.wait_list,
        opened_at=now,
    )


def decide_exit(
    state: State,
    me: str,
    settings: Settings,
    *,
    for_good: bool = False,
    now: float | None = None,
) -> Action:
    """Leave the current round, to join the next one or (``for_good``) for good.

    A participant of a complete round leaving to rejoin opens the next round
    for everyone (:func:`dissolve`). A node already waiting for an open round
    has nothing to leave.
    """
    if me not in state.members():
        return Action(Kind.FINISH)
    if not for_good:
        if state.complete and me in state.participants:
            return Action(Kind.WRITE, dissolve(state, now), why="opening the next round")
        if not state.complete and me in state.wait_list:
            return Action(Kind.FINISH)
    new = _without(state, me, now)
    if not new.complete and len(new.participants) < settings.min_nodes:
        new = replace(new, deadline=None)
    return Action(Kind.WRITE, new, why="leaving the rendezvous")


def decide_close(state: State) -> Action:
    if state.closed:
        return Action(Kind.FINISH)
    return Action(Kind.WRITE, replace(state, closed=True), why="closing the rendezvous")


def decide_reopen(state: State) -> Action:
    """A rendezvous closed in error (its job still runs: see
    :meth:`~elasticd.rendezvous.handler.StoreRendezvous.next_round`) opens again as it
    was: the same round, its participants, its workers; nothing of the job restarts (a
    node at the exit barrier, its workers done, does not run them again)."""
    if not state.closed:
        return Action(Kind.FINISH)
    return Action(Kind.WRITE, replace(state, closed=False), why="opening the rendezvous again")


def _at_least(value: int | None, floor: int) -> bool:
    """``value`` is known and at least ``floor`` (0 is a round like any other: never
    ``(value or -1) >= floor``, which reads an announcement for round 0 as none)."""
    return value is not None and value >= floor


class Change(Enum):
    """Why a running node must re-rendezvous (``None`` from :func:`watch_reason`: it need not)."""

    CLOSED = "the rendezvous was closed"
    NEW_ROUND = "the other nodes moved to a new round"
    FENCED = "this node is no longer a participant of the round"
    ARRIVAL = "a node is waiting to join"
    LOSS = "a participant's lease expired"


def watch_reason(
    state: State,
    me: str,
    my_round: int,
    alive: frozenset[str],
    settings: Settings,
    announced: Callable[[str], int | None] | None = None,
) -> Change | None:
    """While workers run: does anything in the shared state call for a new round?

    ``announced(node)`` is the round a node's live announcement is for (None:
    none). Only a waiting node that announced for this round is an arrival:
    a node left in the wait list by :func:`dissolve` that never announced
    again (it died, and its lease has not expired yet) is not, so a node
    loss costs one re-formation, not two or three. Without ``announced``
    every waiting node counts.
    """
    if state.closed:
        return Change.CLOSED
    if state.round != my_round:
        return Change.NEW_ROUND
    if me not in state.participants or me not in alive:
        return Change.FENCED
    if len(state.participants) < settings.max_nodes and any(
        announced is None or _at_least(announced(node), state.round)
        for node in state.wait_list
        if node in alive
    ):
        return Change.ARRIVAL
    if not frozenset(state.participants) <= alive:
        return Change.LOSS
    return None


# What a node reads instead of the document (issue 16). The document holds
# every node: reading it costs O(N) bytes, and N nodes reading it cost
# O(N²). So the node that completes a round writes each participant's own
# *seat* (what it needs to start its workers, O(1) bytes) under a key of its
# own, and a small *head* (the round's number and status) that every node
# waits on. Only the few nodes that write the document read it.


@dataclass(frozen=True)
class Seat:
    """One participant's share of a complete round: all its agent needs, O(1) bytes.

    The worker ranks are computed once for every node by the node that
    completes the round (:func:`seats`), as torch's rank 0 does since
    pytorch/pytorch#124982, instead of by each node from the whole node list.
    """

    round: int
    group_rank: int
    group_world_size: int
    master_addr: str
    master_port: int
    role: str
    local_world_size: int
    #: Global rank of this node's local rank 0, and the job's world size.
    base_rank: int
    world_size: int
    #: Role rank of this node's local rank 0, and the role's world size.
    base_role_rank: int
    role_world_size: int
    #: Every participant's group rank, for rounds small enough to carry it
    #: (at most :data:`ROSTER_INLINE` nodes); otherwise read from the roster key.
    participants: dict[str, int] | None = None

    def encode(self) -> bytes:
        doc: dict[str, Any] = {
            "round": self.round,
            "group_rank": self.group_rank,
            "group_world_size": self.group_world_size,
            "master": [self.master_addr, self.master_port],
            "role": self.role,
            "lws": self.local_world_size,
            "base_rank": self.base_rank,
            "world_size": self.world_size,
            "base_role_rank": self.base_role_rank,
            "role_world_size": self.role_world_size,
        }
        if self.participants is not None:
            doc["participants"] = self.participants
        return json.dumps(doc, sort_keys=True).encode()

    @staticmethod
    def decode(raw: bytes) -> Seat:
        """Parse a stored seat; anything malformed is a RendezvousError."""
        try:
            doc = json.loads(raw)
            roster = doc.get("participants")
            seat = Seat(
                round=int(doc["round"]),
                group_rank=int(doc["group_rank"]),
                group_world_size=int(doc["group_world_size"]),
                master_addr=str(doc["master"][0]),
                master_port=int(doc["master"][1]),
                role=str(doc["role"]),
                local_world_size=int(doc["lws"]),
                base_rank=int(doc["base_rank"]),
                world_size=int(doc["world_size"]),
                base_role_rank=int(doc["base_role_rank"]),
                role_world_size=int(doc["role_world_size"]),
                participants=None
                if roster is None
                else {str(k): int(v) for k, v in roster.items()},
            )
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
            raise RendezvousError(f"a rendezvous seat is malformed: {exc}") from None
        if not 1 <= seat.local_world_size <= MAX_LOCAL_WORLD_SIZE:
            raise RendezvousError(f"local world size {seat.local_world_size} out of bounds")
        if not 0 <= seat.group_rank < seat.group_world_size:
            raise RendezvousError("a rendezvous seat's group rank is out of bounds")
        return seat


#: Rounds of at most this many participants carry the roster in every seat.
ROSTER_INLINE = 64


def seats(state: State) -> dict[str, Seat]:
    """Every participant's seat in a complete round, in one O(N) pass.

    The same ranks as :func:`elasticd.rendezvous.ranks.assign_ranks` gives
    each node (global ranks contiguous by group rank, role ranks contiguous
    per role), computed with running sums instead of once per node.
    """
    master = state.master()
    if master is None:
        raise RendezvousError("only a complete round has seats")
    ordered = sorted(state.participants.items(), key=lambda kv: kv[1])
    world_size = sum(state.nodes[node].local_world_size for node, _ in ordered)
    role_sizes: dict[str, int] = {}
    for node, _ in ordered:
        info = state.nodes[node]
        role_sizes[info.role] = role_sizes.get(info.role, 0) + info.local_world_size
    roster = dict(state.participants) if len(ordered) <= ROSTER_INLINE else None
    base, role_base = 0, dict.fromkeys(role_sizes, 0)
    out: dict[str, Seat] = {}
    for node, rank in ordered:
        info = state.nodes[node]
        out[node] = Seat(
            round=state.round,
            group_rank=rank,
            group_world_size=len(ordered),
            master_addr=master[0],
            master_port=master[1],
            role=info.role,
            local_world_size=info.local_world_size,
            base_rank=base,
            world_size=world_size,
            base_role_rank=role_base[info.role],
            role_world_size=role_sizes[info.role],
            participants=roster,
        )
        base += info.local_world_size
        role_base[info.role] += info.local_world_size
    return out


@dataclass(frozen=True)
class Head:
    """The round's number and status, written after every change nodes wait for.

    Written (``signal/done``) after the document's compare-and-set that made
    the change, and after the seats of a completed round: a node that reads a
    complete head finds its seat written. It may lag the document, never lead it,
    and it never goes back: heads are written by compare-and-set, each only over
    a head of an older version of the document (:meth:`supersedes`). Written with
    a plain put, two writers' heads could land out of order, and a head showing
    a complete round could hide the closure written just before it from every
    node that follows the head alone, for ever.
    """

    round: int = 0
    complete: bool = False
    closed: bool = False
    deadline: float | None = None
    #: The participant (by name) who completes an open round at its deadline.
    first: str | None = None
    #: The version of the document this head shows (0: not known, from an older daemon).
    version: int = 0

    @staticmethod
    def of(state: State, version: int = 0) -> Head:
        return Head(
            round=state.round,
            complete=state.complete,
            closed=state.closed,
            deadline=state.deadline,
            first=min(state.participants) if state.participants else None,
            version=version,
        )

    def supersedes(self, stored: Head | None) -> bool:
        """May this head be written over ``stored`` (None: absent or malformed)?"""
        return stored is None or self.version > stored.version

    def encode(self) -> bytes:
        return json.dumps(
            {
                "round": self.round,
                "complete": self.complete,
                "closed": self.closed,
                "deadline": self.deadline,
                "first": self.first,
                "version": self.version,
            },
            sort_keys=True,
        ).encode()

    @staticmethod
    def decode(raw: bytes | None) -> Head | None:
        """Parse a head; ``None`` when absent or malformed (the node then reads the document)."""
        if raw is None:
            return None
        try:
            doc = json.loads(raw)
            return Head(
                round=int(doc["round"]),
                complete=bool(doc["complete"]),
                closed=bool(doc["closed"]),
                deadline=None if doc.get("deadline") is None else float(doc["deadline"]),
                first=None if doc.get("first") is None else str(doc["first"]),
                version=int(doc.get("version", 0)),
            )
        except (ValueError, KeyError, TypeError, AttributeError):
            return None


def head_lags(head: Head | None, state: State) -> bool:
    """Does the stored head (None: absent or malformed) show less than ``state`` does?"""
    return head is None or (head.round, head.complete, head.closed, head.deadline) != (
        state.round,
        state.complete,
        state.closed,
        state.deadline,
    )


def skip_exit(head: Head | None, seat_round: int | None) -> int | None:
    """May a node leave its round without reading the document? The round to announce for.

    ``seat_round`` is the round of the node's latest seat (None: it never sat
    in a complete round). Leaving reads the document only when the node may
    be a participant of the complete round the head names (it must open the
    next round for all, :func:`dissolve`); otherwise a newer round is open
    and the node is in its wait list (placed only once it announces for it),
    or it was never seated and has nothing to leave. None: read the document.

    One case this cannot see: a node whose daemon restarted while it was a
    participant of an *open* round keeps its place there with its old
    announcement (its master port, should it become group rank 0) instead
    of leaving and being placed again; the round still forms, and a stale
    port fails that round's workers, which re-form the next one.
    """
    if head is None or head.closed:
        return None if seat_round is not None else 0
    if seat_round is not None and seat_round >= head.round:
        # A participant of the complete round: dissolve it. A head that names the seat's
        # round as still open, or an older round, was read before that round completed
        # (it lags the document): it cannot say that a newer round is open.
        return None
    return head.round + (1 if head.complete else 0)


class Look(Enum):
    """What a joining node that has not read the document does next (:func:`look`)."""

    SEAT = "read its seat"  # the head says our round is complete
    CLOSED = "the rendezvous is closed"
    REANNOUNCE = "a newer round opened: announce for it"
    TAKE = "try to take the absorber role"
    WAIT = "wait for the head or the absorber to change"
    DECIDE = "read the document and decide (a deadline is due, or something is odd)"


@dataclass(frozen=True)
class Absorber:
    """The absorber key as a joining node last saw it (None fields: not held)."""

    holder: str | None = None
    until: float = 0.0


def look(
    head: Head | None,
    absorber: Absorber,
    me: str,
    my_round: int,
    now: float,
    join_deadline: float,
    grace: float,
    tried: bool,
    patient_until: float | None = None,
    overdue: float | None = None,
) -> tuple[Look, float | None]:
    """A joining node's next step from the head and the absorber role alone, and until when.

    ``tried``: this node already failed to take the role since it last saw
    it free (it waits for a change rather than asking again). A hold counts
    until ``overdue`` (default ``grace``) after its time: a holder's renewal
    may queue behind a crowd's requests, and a stuck holder is displaced
    only after that (a dead one frees the role with its lease). A node that
    is not among the first to announce waits ``patient_until`` for one of
    them to take the free role rather than asking with the whole crowd.
    WAIT comes with the time to look again at (the last call's deadline,
    plus ``grace`` for all but its first participant; a stuck absorber's
    hold; the patience; the join deadline); DECIDE at that time reads the
    document, as a node that has no head does.
    """
    if head is not None and head.closed:
        return Look.CLOSED, None
    if now > join_deadline:
        return Look.DECIDE, None
    if head is not None and head.round > my_round:
        return Look.REANNOUNCE, None
    if head is not None and head.complete and head.round == my_round:
        return Look.SEAT, None
    margin = grace if overdue is None else overdue
    held = absorber.holder is not None and now < absorber.until + margin
    until = join_deadline
    if not held and not tried:
        if patient_until is None or now >= patient_until:
            return Look.TAKE, None
        until = min(until, patient_until)
    if held:
        until = min(until, absorber.until + margin)
    if head is not None and head.deadline is not None:
        due = head.deadline + (0.0 if head.first == me else grace)
        if now >= due:
            return Look.DECIDE, None
        until = min(until, due)
    return Look.WAIT, until
