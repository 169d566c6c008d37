"""A node's health across jobs, and its quarantine (issue 37).

Each node has one health record in the store, ``health/<node>``
(:class:`NodeHealth`): the failures attributed to it, whichever job they
happened in, and its quarantine, with why, since when, by whom and until
when. Three kinds of entry are attributed to a node
(:class:`HealthEntry`): the first failure in time of a job's round when it
happened on this node (``first_failure``: the root cause, not collateral), a
worker of this node killed by a hardware-like signal (``hardware``: SIGBUS,
whatever the round), and a failed health check (``health_check``).

The policy is pure (:func:`note`, :func:`released`): a failed health check
quarantines at once; ``quarantine_threshold`` attributed failures within
``quarantine_window`` do too; either only with ``auto_quarantine`` on. An
automatic quarantine lasts ``quarantine_ttl`` (unset: until an admin
undrains); an admin's drain lasts until an undrain. A quarantined node is not
placed by the fleet scheduler (:mod:`elasticd.node.scheduler` reads these
records): the plan takes its jobs away, each re-forms without it (onto a
spare where there is one), uncharged, since a participant that does not come
back is a membership change (:func:`elasticd.agent.edits.settle_failure`).

Who writes a record (the privilege boundary): the daemon, never the job's
side. Workers' tokens reach only their job's ``jobs/<id>/`` keys, so no
worker can write ``health/``. A daemon's code writes only its *own*
record from what it saw of its own workers (:meth:`HealthBook.note`), and
another node's only to carry out an admin's ``POST /nodes/{name}/drain`` or
``undrain`` (:meth:`HealthBook.drain`, authorized by
:data:`elasticd.identity.Action.DRAIN` before it is called): one node never
quarantines another. (The daemons share the store's credential, so the store
itself cannot tell them apart; this is the daemons' rule, as for every other
key.) Read back, a record is bounded and validated; a record that names
another node than its key, or does not validate, counts as no quarantine.

Which side of the boundary: the daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from elasticd import keys
from elasticd.clock import Clock
from elasticd.config import Config
from elasticd.errors import StoreError
from elasticd.eventkinds import EventKind
from elasticd.models import JOB_ID_PATTERN, NODE_NAME_PATTERN, valid_node_name
from elasticd.node.events import EventLog
from elasticd.sched.plan import FleetPlan
from elasticd.store import Store

__all__ = [
    "ENTRY_KINDS",
    "EntryKind",
    "HARDWARE_SIGNALS",
    "HealthBook",
    "HealthEntry",
    "NodeHealthService",
    "NodeView",
    "NodeHealth",
    "Policy",
    "Quarantine",
    "attributed",
    "by_kind",
    "decode_health",
    "drained",
    "expired",
    "in_force",
    "node_health",
    "note",
    "release_due",
    "released",
    "undrained",
    "view_of",
]

log = logging.getLogger("elasticd.node.quarantine")

#: Signals that say the machine, not the program, failed (a bad page, a dying bus).
HARDWARE_SIGNALS = frozenset({7})  # SIGBUS
#: Seconds before a store that failed is asked again about this node's quarantine (and, times
#: 60, the longest wait for a TTL's end: the wall clock may step).
RELEASE_RETRY = 5.0
#: A look a little after the TTL's end, not at it (``in_force`` is strict).
RELEASE_SLACK = 0.05
#: The most entries a record keeps (the newest).
MAX_ENTRIES = 64
_Text = Annotated[str, Field(max_length=1024)]

EntryKind = Literal["first_failure", "hardware", "health_check"]
#: Every kind of entry, in the order the metrics show them.
ENTRY_KINDS: tuple[EntryKind, ...] = get_args(EntryKind)


class HealthEntry(BaseModel):
    """One failure attributed to the node."""

    model_config = ConfigDict(allow_inf_nan=False)

    kind: EntryKind
    at: float = Field(description="Wall-clock time on the node, which alone writes these.")
    job: Annotated[str, Field(pattern=JOB_ID_PATTERN)] | None = None
    round: int | None = None
    message: _Text = ""


class Quarantine(BaseModel):
    """Why the node is out of the fleet, since when, by whom, until when."""

    model_config = ConfigDict(allow_inf_nan=False)

    reason: _Text
    since: float
    by: Annotated[str, Field(max_length=128)] = Field(
        description="`policy` (the node's own, automatic) or the admin who drained it."
    )
    until: float | None = Field(default=None, description="Its end (a TTL); None: an undrain.")


class NodeHealth(BaseModel):
    """``health/<node>``: a node's record across jobs."""

    model_config = ConfigDict(allow_inf_nan=False)

    node: Annotated[str, Field(pattern=NODE_NAME_PATTERN)]
    entries: list[HealthEntry] = Field(default_factory=list, max_length=MAX_ENTRIES)
    quarantine: Quarantine | None = None
    released: Quarantine | None = Field(
        default=None, description="The last quarantine ended, with the undrain's reason."
    )


@dataclass(frozen=True)
class Policy:
    """The settings of automatic quarantine (``auto_quarantine`` and the rest)."""

    auto: bool = True
    threshold: int = 3
    window: float = 3600.0
    ttl: float | None = None
    max_fraction: float = 0.1
    """The share of the fleet's nodes the policy may hold quarantined at once (at least one
    node): past it, a failure is counted but quarantines nothing. Any user's job can fail in
    ways that look like the node's (a SIGBUS it raised itself): this bounds what one can
    take out of the fleet; an admin's drain is not bounded."""


@dataclass(frozen=True)
class Fleet:
    """What the policy weighs a new quarantine against: the fleet as the store shows it."""

    nodes: int
    """Nodes alive (with a lease) or quarantined, this one among them."""
    quarantined: int
    """Other nodes quarantined by the policy now (an admin's drains aside)."""

    def has_room(self, policy: Policy) -> bool:
        """Whether one more node may be quarantined by the policy (pure)."""
        return self.quarantined < max(1, int(policy.max_fraction * self.nodes))


def in_force(quarantine: Quarantine | None, now: float) -> bool:
    """Whether ``quarantine`` holds at ``now`` (wall time: its TTL's end passed or not)."""
    return quarantine is not None and (quarantine.until is None or now < quarantine.until)


def attributed(health: NodeHealth, window: float, now: float) -> list[HealthEntry]:
    """The entries that count now: inside the window, one per (job, round)."""
    seen: set[tuple[str | None, int | None, str]] = set()
    out = []
    for e in health.entries:
        if now - e.at > window:
            continue
        key = (e.job, e.round, "hc" if e.kind == "health_check" else "f")
        if e.job is not None and key in seen:
            continue
        seen.add(key)
        out.append(e)
    return out


def by_kind(health: NodeHealth, window: float, now: float) -> dict[EntryKind, int]:
    """The entries that count now (:func:`attributed`), by kind, every kind from zero: the
    kinds add up to the ``attributed_failures`` that ``GET /nodes`` shows (pure)."""
    counts = dict.fromkeys(ENTRY_KINDS, 0)
    for e in attributed(health, window, now):
        counts[e.kind] += 1
    return counts


def _evidence(counted: list[HealthEntry]) -> bool:
    """Do the counted failures point at the node rather than at one job's own code?

    A hardware-like signal does. First failures of rounds do only across two jobs or
    more: a multi-node job whose every rank fails at once on its own bug has its first
    failure on some node, at random; counted alone, one buggy job would quarantine the
    fleet's nodes one after another."""
    if any(e.kind == "hardware" for e in counted):
        return True
    return len({e.job for e in counted}) >= 2


def note(
    health: NodeHealth, entry: HealthEntry, policy: Policy, now: float, fleet: Fleet | None = None
) -> NodeHealth:
    """The record with ``entry`` added; quarantined when the policy trips and ``fleet`` has
    room for one more (:attr:`Policy.max_fraction`; None: no bound) (pure)."""
    entries = [*health.entries, entry][-MAX_ENTRIES:]
    health = health.model_copy(update={"entries": entries})
    if in_force(health.quarantine, now) or not policy.auto:
        return health
    if fleet is not None and not fleet.has_room(policy):
        return health
    until = now + policy.ttl if policy.ttl is not None else None
    if entry.kind == "health_check":
        reason = f"health check failed: {entry.message}"
    else:
        counted = [e for e in attributed(health, policy.window, now) if e.kind != "health_check"]
        if len(counted) < policy.threshold or not _evidence(counted):
            return health
        reason = (
            f"{len(counted)} failures attributed to it within {policy.window:g} s "
            f"(threshold {policy.threshold}); the last: {entry.message}"
        )
    quarantine = Quarantine(reason=reason[:1024], since=now, by="policy", until=until)
    return health.model_copy(update={"quarantine": quarantine})


def drained(health: NodeHealth, reason: str, by: str, now: float) -> NodeHealth:
    """An admin's drain: quarantined until undrained (pure)."""
    return health.model_copy(
        update={"quarantine": Quarantine(reason=reason[:1024], since=now, by=by[:128])}
    )


def undrained(health: NodeHealth, reason: str, by: str, now: float) -> NodeHealth:
    """An admin's undrain: the quarantine ends, the counted failures are forgiven (pure)."""
    ended = Quarantine(reason=reason[:1024], since=now, by=by[:128])
    return health.model_copy(update={"quarantine": None, "released": ended, "entries": []})


def released(health: NodeHealth, now: float) -> bool:
    """Whether a quarantine is recorded whose TTL has run out (pure)."""
    return health.quarantine is not None and not in_force(health.quarantine, now)


def expired(health: NodeHealth, now: float) -> NodeHealth:
    """The record with a quarantine whose TTL ran out ended, as an undrain by the policy
    would (its counted failures forgiven); any other record as it is (pure)."""
    if not released(health, now):
        return health
    return undrained(health, "its quarantine's TTL ran out", "policy", now)


def release_due(health: NodeHealth, now: float) -> float | None:
    """Seconds until the record's quarantine ends by its TTL (0: it has); None: nothing
    ends by itself (no quarantine, or an admin's drain, which lasts until an undrain)."""
    q = health.quarantine
    if q is None or q.until is None:
        return None
    return max(q.until - now, 0.0)


def decode_health(name: str, raw: bytes | None) -> NodeHealth:
    """The record read from the store; a missing, invalid or misnamed one is a clean one.

    Never raises: a key whose name is no node's (written by hand into ``health/``) is a
    clean record too, built without validation (:meth:`HealthBook.all` leaves it out)."""
    if not valid_node_name(name):
        return NodeHealth.model_construct(node=name)
    if raw is not None:
        try:
            health = NodeHealth.model_validate_json(raw)
        except ValidationError:
            log.warning("ignoring malformed health record of %s", name)
        else:
            if health.node == name:
                return health
    return NodeHealth(node=name)


class HealthBook:
    """The store side: read a record, change it by compare-and-set."""

    def __init__(self, store: Store, node: str) -> None:
        self.store = store
        self.node = node
        #: Records this daemon wrote so far (a ``/metrics`` page older than one is stale).
        self.writes = 0

    async def read(self, name: str) -> NodeHealth:
        entry = await self.store.get(keys.health_key(name))
        return decode_health(name, entry.value if entry is not None else None)

    async def all(self) -> dict[str, NodeHealth]:
        """Every record under ``health/`` whose key names a node (the store's keys are
        anyone's with its credential: another name is no node's, and is left out)."""
        listing = await self.store.list(keys.HEALTH)
        out = {}
        for e in listing.entries:
            name = e.key[len(keys.HEALTH) :]
            if valid_node_name(name):
                out[name] = decode_health(name, e.value)
        return out

    async def note(self, entry: HealthEntry, policy: Policy, now: float) -> tuple[bool, NodeHealth]:
        """Add an entry to *this node's own* record: (newly quarantined, the record)."""
        before: list[NodeHealth] = []
        fleet = await self.fleet(now)

        def edit(health: NodeHealth) -> NodeHealth:
            before[:] = [health]
            bounded = note(health, entry, policy, now, fleet)
            if bounded.quarantine is None and note(health, entry, policy, now).quarantine:
                log.warning(
                    "node %s would be quarantined, but %d of the fleet's %d nodes already are "
                    "(quarantine_max_fraction %g): it stays in the fleet, its failures counted",
                    self.node,
                    fleet.quarantined,
                    fleet.nodes,
                    policy.max_fraction,
                )
            return bounded

        after = await self._update(self.node, edit)
        newly = after.quarantine is not None and (
            not before or not in_force(before[0].quarantine, now)
        )
        return newly and in_force(after.quarantine, now), after

    async def fleet(self, now: float) -> Fleet:
        """The fleet as the store shows it now: live and quarantined nodes, and how many
        others the policy holds quarantined (read at an attributed failure only)."""
        records = await self.all()
        live = {e.key[len(keys.NODES) :] for e in (await self.store.list(keys.NODES)).entries}
        by_policy = {
            name
            for name, health in records.items()
            if in_force(health.quarantine, now)
            and health.quarantine is not None
            and health.quarantine.by == "policy"
        }
        return Fleet(len(live | by_policy | {self.node}), len(by_policy - {self.node}))

    async def drain(self, name: str, reason: str, by: str, now: float) -> NodeHealth:
        """An admin's drain of ``name`` (any node): authorized by the caller."""
        return await self._update(name, lambda h: drained(h, reason, by, now))

    async def undrain(self, name: str, reason: str, by: str, now: float) -> NodeHealth:
        """An admin's undrain of ``name``."""
        return await self._update(name, lambda h: undrained(h, reason, by, now))

    async def release_expired(self, now: float) -> tuple[bool, NodeHealth]:
        """End *this node's own* quarantine if its TTL ran out: (ended now, the record)."""
        ended: list[bool] = []

        def edit(health: NodeHealth) -> NodeHealth:
            ended[:] = [released(health, now)]
            return expired(health, now)

        entry = await self.store.get(keys.health_key(self.node))
        current = decode_health(self.node, entry.value if entry is not None else None)
        if not released(current, now):
            return False, current  # nothing to end: no write (a write wakes every scheduler)
        after = await self._update(self.node, edit)
        return bool(ended and ended[0]), after

    async def _update(self, name: str, edit: Callable[[NodeHealth], NodeHealth]) -> NodeHealth:
        key = keys.health_key(name)
        entry = await self.store.get(key)
        for _ in range(32):
            current = decode_health(name, entry.value if entry is not None else None)
            new = edit(current)
            expected = entry.version if entry is not None else None
            result = await self.store.compare_and_set(key, new.model_dump_json().encode(), expected)
            if result.ok:
                self.writes += 1
                return new
            entry = result.entry  # lost the race: decide again on the winner's record
        raise StoreError(f"health record of {name}: too many concurrent writes")


class NodeView(BaseModel):
    """``GET /nodes``: a node's record, its state in the fleet, and why."""

    name: str
    state: Literal["ready", "quarantined", "drained"] = "ready"
    reason: str | None = None
    since: float | None = None
    until: float | None = None
    by: str | None = None
    attributed_failures: int = Field(default=0, description="Entries counted in the window.")
    live: bool = Field(default=True, description="Its daemon holds a lease (it is up).")


def view_of(name: str, health: NodeHealth, policy: Policy, now: float, live: bool) -> NodeView:
    """How ``GET /nodes`` and ``elasticd nodes`` show a node (pure)."""
    q = health.quarantine if in_force(health.quarantine, now) else None
    counted = len(attributed(health, policy.window, now))
    if q is None:
        return NodeView(name=name, attributed_failures=counted, live=live)
    state: Literal["quarantined", "drained"] = "quarantined" if q.by == "policy" else "drained"
    return NodeView(
        name=name, state=state, reason=q.reason, since=q.since, until=q.until, by=q.by,
        attributed_failures=counted, live=live,
    )  # fmt: skip


Emit = Callable[[str, EventKind, str], None]


class NodeHealthService:
    """The daemon's side: attribute this node's own failures, carry out an admin's drain.

    ``jobs_on(node)`` names the jobs the plan places on a node (their events say it was
    quarantined or released); ``emit(job, kind, message)`` records one.
    """

    def __init__(
        self,
        book: HealthBook,
        policy: Policy,
        clock: Clock,
        emit: Emit,
        jobs_on: Callable[[str], list[str]],
    ) -> None:
        self.book = book
        self.policy = policy
        self.clock = clock
        self._emit = emit
        self._jobs_on = jobs_on
        #: Counted by kind, for the metrics (this node's own entries).
        self.attributed: dict[str, int] = {}
        self.quarantines = 0
        #: Set when this node is newly quarantined (:meth:`release_when_due` looks again).
        self._noted = asyncio.Event()
        #: The jobs told of this node's latest automatic quarantine (told of its end too:
        #: taken off the node, they may be placed on none now).
        self._affected: set[str] = set()

    @property
    def node(self) -> str:
        return self.book.node

    async def attribute(self, kind: EntryKind, job: str, round_: int | None, message: str) -> bool:
        """Add one failure to this node's own record; True when the node is quarantined now
        (newly or already). Never raises for the store: a lost note is a lost count."""
        now = self.clock.time()
        entry = HealthEntry(kind=kind, at=now, job=job, round=round_, message=message[:1024])
        try:
            newly, health = await self.book.note(entry, self.policy, now)
        except StoreError as exc:
            log.warning("could not note a %s failure of this node: %s", kind, exc)
            return False
        self.attributed[kind] = self.attributed.get(kind, 0) + 1
        if newly and health.quarantine is not None:
            self.quarantines += 1
            self._noted.set()
            self._affected = {job, *self._jobs_on(self.node)}
            self._tell(
                self._affected,
                EventKind.NODE_QUARANTINED,
                f"node {self.node} quarantined by its policy: {health.quarantine.reason}",
            )
        return in_force(health.quarantine, now)

    async def drain(self, name: str, reason: str, by: str) -> NodeView:
        """An admin's drain of ``name`` (authorized by the route's caller)."""
        now = self.clock.time()
        health = await self.book.drain(name, reason, by, now)
        self._tell(
            set(self._jobs_on(name)),
            EventKind.NODE_QUARANTINED,
            f"node {name} drained by {by}: {reason}",
        )
        return view_of(name, health, self.policy, now, live=True)

    async def undrain(self, name: str, reason: str, by: str) -> NodeView:
        """An admin's undrain of ``name``: out of quarantine, its counted failures forgiven."""
        now = self.clock.time()
        health = await self.book.undrain(name, reason, by, now)
        self._tell(
            set(self._jobs_on(name)),
            EventKind.NODE_RELEASED,
            f"node {name} undrained by {by}: {reason}",
        )
        return view_of(name, health, self.policy, now, live=True)

    async def release_when_due(self) -> None:
        """Runs for the daemon's life: when this node's own quarantine reaches the end of its
        TTL, end it in the record and tell its jobs (``node.released``): the record's change
        wakes the fleet scheduler, which places the node again."""
        while True:
            self._noted.clear()
            try:
                ended, health = await self.book.release_expired(self.clock.time())
            except StoreError as exc:
                log.warning("could not look at this node's quarantine: %s", exc)
                await asyncio.sleep(RELEASE_RETRY)
                continue
            if ended:
                affected, self._affected = self._affected, set()
                self._tell(
                    affected | set(self._jobs_on(self.node)),
                    EventKind.NODE_RELEASED,
                    f"node {self.node} released: its quarantine's TTL ran out",
                )
            due = release_due(health, self.clock.time())
            with contextlib.suppress(TimeoutError):
                wait = None if due is None else min(due + RELEASE_SLACK, RELEASE_RETRY * 60)
                async with asyncio.timeout(wait):
                    await self._noted.wait()

    async def records(self) -> dict[str, NodeHealth]:
        """Every node's health record, by name (:meth:`HealthBook.all`)."""
        return await self.book.all()

    async def views(self, live: list[str]) -> list[NodeView]:
        """Every node with a record or a lease, as ``GET /nodes`` shows them."""
        now = self.clock.time()
        records = await self.records()
        names = sorted(set(live) | set(records))
        return [
            view_of(n, records.get(n) or NodeHealth(node=n), self.policy, now, n in live)
            for n in names
        ]

    def _tell(self, jobs: set[str], kind: EventKind, message: str) -> None:
        for job in sorted(jobs):
            self._emit(job, kind, message)


def node_health(
    config: Config,
    store: Store,
    clock: Clock,
    events: EventLog,
    plan: Callable[[], FleetPlan | None],
) -> NodeHealthService:
    """The daemon's service, from its settings; ``plan()`` is the latest fleet plan."""

    def jobs_on(node: str) -> list[str]:
        current = plan()
        if current is None:
            return []
        placed = current.placements.items()
        return [j for j, p in placed if node in p.nodes or node in p.spares]

    policy = Policy(
        auto=config.auto_quarantine,
        threshold=config.quarantine_threshold,
        window=config.quarantine_window,
        ttl=config.quarantine_ttl,
        max_fraction=config.quarantine_max_fraction,
    )

    def emit(job: str, kind: EventKind, message: str) -> None:
        events.emit(job, "daemon", kind, message)

    return NodeHealthService(HealthBook(store, config.node_name), policy, clock, emit, jobs_on)
