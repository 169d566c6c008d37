"""The fleet scheduler's thin loop: read, decide (:func:`elasticd.sched.plan.schedule`), CAS.

Every daemon runs one; one of them at a time decides, the **leader**: the
daemon that holds ``sched/leader``, a key created if absent and bound to its
node lease, so that it vanishes with the daemon and another one takes it
(within a lease TTL). Leadership only saves work: N daemons deciding on
every change would cost N reads of every job and node. Correctness never
depends on it: a daemon that believes it leads while another does too (a
lease that lapsed in a partition) writes through the same compare-and-set.
A pass reads the plan (``sched/plan``), then the job
documents, then the live node records (in that order, so that every job a
stored placement names is in the listing), calls the pure decision and
writes the result back by compare-and-set on the plan's version; a lost
race reads again and decides again, so the daemons agree without a leader
and placements can never count a slot twice. Only the writer of a change
emits its events (``job.placed``, ``job.queued``, ``job.preempted``,
``job.shrunk``, ``job.unschedulable``), so each is recorded once.

A pass runs when something it depends on changes, never on a timer: a job
document (the cluster's job watch calls :meth:`FleetScheduler.wake`), a
node joining, leaving or changing its slots or labels (a watch on
``nodes/``), and the plan itself (a watch on ``sched/plan``, which also
hands every new plan to the job service: it starts the agents the plan
places on this node and stops the ones it no longer does).

Which side of the boundary: the daemon. What it reads from the store is
untrusted: a plan that does not parse is replaced by the next pass, job
documents go through the cluster's check, node records must be bound to a
lease and name themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Literal

from pydantic import ValidationError

from elasticd import keys
from elasticd.clock import SYSTEM_CLOCK, Clock
from elasticd.errors import StoreCompacted, StoreError
from elasticd.eventkinds import EventKind
from elasticd.models import NODE_NAME_PATTERN, Launcher, incarnation_tag
from elasticd.node.cluster import NodeRecord, parse_jobs
from elasticd.node.events import EventLog
from elasticd.node.quarantine import decode_health, in_force
from elasticd.sched.plan import Demand, FleetPlan, NodeCapacity, Notice, clip, schedule
from elasticd.states import JOB_ACTIVE
from elasticd.store import Entry, Store
from elasticd.store.parts import list_in_parts
from elasticd.tasks import TaskSet, cancel_and_wait

log = logging.getLogger("elasticd.node.scheduler")

#: Compare-and-set attempts of one pass before it yields to the next wake-up.
CAS_ATTEMPTS = 50
#: Seconds a daemon whose decide task crashed leaves leadership to the others.
RESIGN_SECONDS = 5.0
#: Jobs told, at most, that the scheduler crashed (the waiting ones of the last pass).
CRASH_EVENTS = 20

_NODE_NAME = re.compile(NODE_NAME_PATTERN)

_NOTICE_KINDS = {
    "placed": EventKind.JOB_PLACED,
    "queued": EventKind.JOB_QUEUED,
    "unplaceable": EventKind.JOB_UNSCHEDULABLE,
    "preempted": EventKind.JOB_PREEMPTED,
    "shrunk": EventKind.JOB_SHRUNK,
}


def decode_plan(raw: bytes | None) -> FleetPlan | None:
    """The stored plan; ``None`` when it does not parse (the next pass replaces it)."""
    if raw is None:
        return FleetPlan()
    try:
        return FleetPlan.model_validate_json(raw)
    except ValidationError:
        return None


def check_node_entry(entry: Entry) -> tuple[NodeCapacity | None, str | None]:
    """``(capacity, None)`` for a live node's record; ``(None, why)`` for one to ignore.

    Live means bound to a lease, valid within :class:`NodeRecord`'s bounds
    (at most :data:`~elasticd.node.cluster.MAX_NODE_SLOTS` slots), and stored
    under its own name. Never raises, whatever the store holds.
    """
    if entry.lease is None:
        return None, "it is not bound to a lease"
    try:
        record = NodeRecord.model_validate_json(entry.value)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "record"
        return None, f"it is not a valid node record ({where}: {first.get('msg', 'invalid')})"
    if keys.node_key(record.name) != entry.key:
        return None, f"it names node {record.name!r}, not its key"
    caps = NodeCapacity(record.name, record.slots, dict(record.labels), frozenset(record.declined))
    return caps, None


def quarantined(entries: list[Entry], now: float) -> set[str]:
    """The nodes whose health record (``health/<node>``) holds a quarantine at ``now``."""
    out = set()
    for entry in entries:
        name = entry.key[len(keys.HEALTH) :]
        if in_force(decode_health(name, entry.value).quarantine, now):
            out.add(name)
    return out


def live_nodes(
    entries: list[Entry], on_refused: Callable[[Entry, str], None] | None = None
) -> list[NodeCapacity]:
    """The live nodes' records among ``entries``, as capacities; the others go to ``on_refused``."""
    out = []
    for entry in entries:
        caps, why = check_node_entry(entry)
        if caps is not None:
            out.append(caps)
        elif why is not None and on_refused is not None:
            on_refused(entry, why)
    return out


LeaderVerdict = Literal["mine", "other", "usurp"]


def leader_verdict(
    holder: Entry, node: Entry | None, me: str, lease: int
) -> tuple[LeaderVerdict, str]:
    """Whose ``sched/leader`` record ``holder`` is, given the record of the node it names.

    A daemon takes leadership bound to the lease its node record lives on, so
    a genuine leader record names a node whose record lives on the very same
    lease. Anything else was written by hand (or by a hostile store writer)
    and would stop the fleet for as long as it stays: it is taken over
    (``usurp``, with the reason), never waited on.
    """
    if (holder.value, holder.lease) == (me.encode(), lease):
        return "mine", ""
    try:
        name = holder.value.decode("ascii")
    except UnicodeDecodeError:
        return "usurp", "it is not a node name"
    if not _NODE_NAME.match(name):
        return "usurp", "it is not a node name"
    if holder.lease is None:
        return "usurp", "it is not bound to a lease"
    if node is None or node.lease != holder.lease:
        return "usurp", f"node {name!r} has no live record on the same lease"
    caps, why = check_node_entry(node)
    if caps is None:
        return "usurp", f"node {name!r}'s record is ignored ({why})"
    return "other", ""


class FleetScheduler:
    """One daemon's share of the fleet scheduler (see the module docstring)."""

    def __init__(
        self,
        store: Store,
        events: EventLog,
        *,
        on_plan: Callable[[FleetPlan], None],
        node: str = "",
        lease: Callable[[], Awaitable[int]] | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.store = store
        self.node = node
        self._lease = lease
        #: Whether this daemon decides now (always, without a lease to bind leadership to).
        self.leading = lease is None
        self._leads = asyncio.Event()  # set while leading: only the leader watches nodes/
        self._follows = asyncio.Event()  # set while another daemon leads
        (self._leads if self.leading else self._follows).set()
        self.events = events
        self.clock = clock
        self._on_plan = on_plan
        self._dirty = asyncio.Event()
        #: The pass loop and its watches: started by start, ended by stop.
        self._tasks = TaskSet("scheduler")
        self._fleet: (
            frozenset[tuple[str, int, tuple[tuple[str, str], ...], frozenset[str]]] | None
        ) = None
        #: The latest plan seen (served by ``GET /queue``).
        self.plan = FleetPlan()
        #: Monotonic time before which this daemon does not try to lead (after a crash).
        self._holdoff_until = 0.0
        #: Jobs that waited for a placement in the last pass (told if a pass crashes).
        self._waiting: list[str] = []
        #: Which job of its id each job of the last pass is (its events say so).
        self._tags: dict[str, str] = {}
        #: Ignored node records already logged: key -> the version logged.
        self._refused_nodes: dict[str, int] = {}

    async def start(self) -> None:
        self._dirty.set()
        self._tasks.spawn(self._decide(), name="sched-decide")
        self._tasks.spawn(self._watch_plan(), name="sched-plan-watch")
        self._tasks.spawn(self._watch_nodes(), name="sched-node-watch")
        if self._lease is not None:
            self._tasks.spawn(self._lead(), name="sched-leader")

    async def stop(self) -> None:
        await self._tasks.aclose()

    def wake(self) -> None:
        """Something the placement depends on changed: run a pass soon (coalesced)."""
        self._dirty.set()

    # deciding

    async def _lead(self) -> None:
        """Take ``sched/leader`` when it is free; watch it while another daemon holds it."""
        assert self._lease is not None
        backoff = 0.05
        while True:
            try:
                holdoff = self._holdoff_until - self.clock.monotonic()
                if holdoff > 0:  # this daemon's pass crashed: another one takes over first
                    await asyncio.sleep(holdoff)
                lease = await self._lease()
                result = await self.store.compare_and_set(
                    keys.SCHED_LEADER, self.node.encode(), None, lease=lease
                )
                holder = result.entry
                verdict: LeaderVerdict = "mine" if result.ok else "other"
                if not result.ok and holder is not None:
                    name = holder.value.decode("ascii", "replace")
                    node = (
                        await self.store.get(keys.node_key(name))
                        if _NODE_NAME.match(name)
                        else None
                    )
                    verdict, why = leader_verdict(holder, node, self.node, lease)
                    if verdict == "usurp":
                        # A squatted or stale record would stop the fleet: delete exactly
                        # that version (a genuine leader's newer write stays) and try again.
                        log.warning(
                            "the %s record %r is not a live daemon's (%s): taking it over",
                            keys.SCHED_LEADER,
                            holder.value[:80],
                            why,
                        )
                        await self.store.delete(keys.SCHED_LEADER, holder.version)
                        continue
                self._set_leading(verdict == "mine")
                # Watch from the store's revision now (a key's own version may predate a
                # restart of the store, whose history is then gone): a change, or the key
                # gone with its holder's lease, means decide again.
                listing = await self.store.list(keys.SCHED_LEADER)
                now = next((e for e in listing.entries if e.key == keys.SCHED_LEADER), None)
                if now is not None and holder is not None and now.version == holder.version:
                    while not await self.store.watch(
                        keys.SCHED_LEADER, listing.revision, 30.0, prefix=True
                    ):
                        pass
                backoff = 0.05
            except (StoreError, StoreCompacted) as exc:
                log.debug("scheduler leadership: %s", exc)
                await asyncio.sleep(backoff)  # never a busy loop, whatever the store says
                backoff = min(backoff * 2, 2.0)

    def _set_leading(self, leading: bool) -> None:
        if leading and not self.leading:
            log.info("%s decides the fleet's placement now", self.node)
        self.leading = leading
        if leading:
            self._follows.clear()
            self._leads.set()
            self.wake()
        else:
            self._leads.clear()
            self._follows.set()

    async def _decide(self) -> None:
        backoff = 0.05
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            if not self.leading:
                continue  # the leader decides; this daemon applies what it writes
            try:
                await self.run_pass()
                backoff = 0.05
            except StoreError as exc:
                log.warning("fleet scheduler: %s (trying again in %.1f s)", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                self._dirty.set()
            except Exception as exc:
                # A bug or an input the planner did not foresee: never die silently while
                # holding sched/leader, which would stop placement on the whole fleet.
                await self._crashed(exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                self._dirty.set()

    async def _crashed(self, exc: Exception) -> None:
        """Log the crash, tell the waiting jobs, and give up leadership for a while."""
        log.error(
            "the fleet scheduler's pass failed; %s gives up deciding for %.0f s",
            self.node,
            RESIGN_SECONDS,
            exc_info=exc,
        )
        message = clip(
            f"the fleet scheduler's pass on {self.node} failed ({type(exc).__name__}: "
            f"{clip(str(exc), 300)}); it gives up deciding for {RESIGN_SECONDS:.0f} s so that "
            "another daemon takes over",
            1000,
        )
        for job_id in self._waiting[:CRASH_EVENTS]:
            self.events.emit(
                job_id, "daemon", EventKind.SCHED_CRASHED, message, job_tag=self._tags.get(job_id)
            )
        self._holdoff_until = self.clock.monotonic() + RESIGN_SECONDS
        if self._lease is None:
            return  # no leadership to give up: the loop backs off and tries again
        self._set_leading(False)
        with contextlib.suppress(StoreError):
            entry = await self.store.get(keys.SCHED_LEADER)
            if entry is not None and entry.value == self.node.encode():
                await self.store.delete(keys.SCHED_LEADER, entry.version)

    async def run_pass(self) -> bool:
        """Read, decide, compare-and-set; True when this pass wrote a new plan."""
        for _ in range(CAS_ATTEMPTS):
            entry = await self.store.get(keys.SCHED_PLAN)
            stored = decode_plan(entry.value if entry is not None else None)
            # In parts where one listing would be over the bound: no owner's documents
            # can fail the pass for everyone (issue 35).
            jobs = parse_jobs((await list_in_parts(self.store, keys.JOBS)).entries)
            nodes = live_nodes(
                list((await self.store.list(keys.NODES)).entries), self._node_refused
            )
            health = list((await self.store.list(keys.HEALTH)).entries)
            demands = [
                Demand(
                    id=j.id,
                    nproc=j.spec.nproc_per_node,
                    min_nodes=j.spec.min_nodes,
                    max_nodes=j.spec.max_nodes or j.spec.min_nodes,
                    priority=j.spec.priority,
                    created_at=j.created_at,
                    selector=dict(j.spec.node_selector),
                    nodes=frozenset(j.spec.nodes) if j.spec.nodes is not None else None,
                    # A job from before identities may preempt and has no quota.
                    # A local user and an identity of the same name are two owners.
                    owner=(
                        None
                        if j.owner is None
                        else f"user {j.owner.name}"
                        if j.owner.local
                        else j.owner.name
                    ),
                    may_preempt=j.owner.may_preempt if j.owner is not None else True,
                    slot_quota=j.owner.slot_quota if j.owner is not None else None,
                )
                for j in jobs
                if j.state in JOB_ACTIVE
                and j.launcher == Launcher.ELASTICD  # torchrun runs its own
            ]
            self._tags = {j.id: incarnation_tag(j) for j in jobs}
            placed = (stored or self.plan).placements
            self._waiting = [d.id for d in demands if d.id not in placed]
            # A plan that does not parse (written by hand, or by a hostile store writer) is
            # replaced, deciding from the last good one seen, not from nothing: that would
            # move every job without a word.
            now = self.clock.time()
            out = quarantined(health, now)
            nodes = [n for n in nodes if n.name not in out]  # never placed while quarantined
            outcome = schedule(stored or self.plan, demands, nodes, now)
            if stored is not None and outcome.plan == stored:
                return False
            result = await self.store.compare_and_set(
                keys.SCHED_PLAN,
                outcome.plan.model_dump_json().encode(),
                entry.version if entry is not None else None,
            )
            if result.ok:
                for notice in outcome.notices:
                    self._emit(notice)
                return True
        self._dirty.set()  # a busy plan: go again on the next turn of the loop
        return False

    def _node_refused(self, entry: Entry, why: str) -> None:
        """Log an ignored node record once per version."""
        if self._refused_nodes.get(entry.key) == entry.version:
            return
        if len(self._refused_nodes) >= 10_000:
            self._refused_nodes.clear()  # bounded, whatever a store writer adds
        self._refused_nodes[entry.key] = entry.version
        log.warning("ignoring the node record %r: %s", entry.key[:300], why)

    def _emit(self, notice: Notice) -> None:
        self.events.emit(
            notice.job,
            "daemon",
            _NOTICE_KINDS[notice.kind],
            notice.message,
            # The job the pass decided on: a placement decided before its id was taken
            # again is never the new job's.
            job_tag=self._tags.get(notice.job),
            **({"by": notice.by} if notice.by else {}),
        )

    # watching

    async def _watch_plan(self) -> None:
        await self._watch(keys.SCHED_PLAN, self._plan_seen)

    async def _watch_nodes(self) -> None:
        """The leader's watch on the fleet: every node record change re-lists ``nodes/``."""
        while True:
            await self._leads.wait()
            self._fleet = None  # a new leader decides from a fresh look
            watch = asyncio.create_task(self._watch(keys.NODES, self._nodes_seen))
            health = asyncio.create_task(self._watch(keys.HEALTH, lambda _: self.wake()))
            try:
                await self._follows.wait()
            finally:
                await cancel_and_wait(watch)
                await cancel_and_wait(health)

    def _plan_seen(self, entries: list[Entry]) -> None:
        plan = decode_plan(next((e.value for e in entries if e.key == keys.SCHED_PLAN), None))
        if plan is None:
            log.warning(
                "the stored plan %r does not parse; the next pass replaces it", keys.SCHED_PLAN
            )
            self.wake()
            return
        self.plan = plan
        self._on_plan(plan)
        self.wake()  # a plan is re-checked by every pass: one written by hand is corrected

    def _nodes_seen(self, entries: list[Entry]) -> None:
        fleet = frozenset(
            (n.name, n.slots, tuple(sorted(n.labels.items())), n.declined)
            for n in live_nodes(entries, self._node_refused)
        )
        if fleet != self._fleet:  # free-slot updates alone do not change a placement
            self._fleet = fleet
            self.wake()

    async def _watch(self, prefix: str, seen: Callable[[list[Entry]], None]) -> None:
        """List ``prefix``, hand the entries to ``seen``, and again after every change."""
        backoff = 0.05
        while True:
            try:
                listing = await self.store.list(prefix)
                seen(list(listing.entries))
                backoff = 0.05
                while not await self.store.watch(prefix, listing.revision, 30.0, prefix=True):
                    pass  # a quiet watch timed out: watch again from the same revision
            except StoreCompacted:
                continue
            except StoreError as exc:
                log.debug("scheduler watch on %s: %s", prefix, exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
