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
import logging
from collections.abc import Awaitable, Callable

from pydantic import ValidationError

from elasticd import keys
from elasticd.clock import SYSTEM_CLOCK, Clock
from elasticd.errors import StoreCompacted, StoreError
from elasticd.eventkinds import EventKind
from elasticd.node.cluster import NodeRecord, parse_jobs
from elasticd.node.events import EventLog
from elasticd.sched.plan import Demand, NodeCapacity, Notice, Plan, schedule
from elasticd.states import JOB_ACTIVE
from elasticd.store import Entry, Store
from elasticd.tasks import cancel_and_wait

log = logging.getLogger("elasticd.node.scheduler")

#: Compare-and-set attempts of one pass before it yields to the next wake-up.
CAS_ATTEMPTS = 50

_NOTICE_KINDS = {
    "placed": EventKind.JOB_PLACED,
    "queued": EventKind.JOB_QUEUED,
    "unplaceable": EventKind.JOB_UNSCHEDULABLE,
    "preempted": EventKind.JOB_PREEMPTED,
    "shrunk": EventKind.JOB_SHRUNK,
}


def decode_plan(raw: bytes | None) -> Plan | None:
    """The stored plan; ``None`` when it does not parse (the next pass replaces it)."""
    if raw is None:
        return Plan()
    try:
        return Plan.model_validate_json(raw)
    except ValidationError:
        return None


def live_nodes(entries: list[Entry]) -> list[NodeCapacity]:
    """Node records bound to a lease that name themselves, as capacities."""
    out = []
    for entry in entries:
        if entry.lease is None:
            continue
        try:
            record = NodeRecord.model_validate_json(entry.value)
        except ValidationError:
            continue
        if keys.node_key(record.name) == entry.key:
            out.append(
                NodeCapacity(
                    record.name, record.slots, dict(record.labels), frozenset(record.declined)
                )
            )
    return out


class FleetScheduler:
    """One daemon's share of the fleet scheduler (see the module docstring)."""

    def __init__(
        self,
        store: Store,
        events: EventLog,
        *,
        on_plan: Callable[[Plan], None],
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
        self._tasks: list[asyncio.Task[None]] = []
        self._fleet: (
            frozenset[tuple[str, int, tuple[tuple[str, str], ...], frozenset[str]]] | None
        ) = None
        #: The latest plan seen (served by ``GET /queue``).
        self.plan = Plan()

    async def start(self) -> None:
        self._dirty.set()
        self._tasks = [
            asyncio.create_task(self._decide(), name="sched-decide"),
            asyncio.create_task(self._watch_plan(), name="sched-plan-watch"),
            asyncio.create_task(self._watch_nodes(), name="sched-node-watch"),
        ]
        if self._lease is not None:
            self._tasks.append(asyncio.create_task(self._lead(), name="sched-leader"))

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            await cancel_and_wait(task)

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
                lease = await self._lease()
                result = await self.store.compare_and_set(
                    keys.SCHED_LEADER, self.node.encode(), None, lease=lease
                )
                holder = result.entry
                mine = holder is not None and (holder.value, holder.lease) == (
                    self.node.encode(),
                    lease,
                )
                self._set_leading(result.ok or mine)
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

    async def run_pass(self) -> bool:
        """Read, decide, compare-and-set; True when this pass wrote a new plan."""
        for _ in range(CAS_ATTEMPTS):
            entry = await self.store.get(keys.SCHED_PLAN)
            stored = decode_plan(entry.value if entry is not None else None)
            jobs = parse_jobs((await self.store.list(keys.JOBS)).entries)
            nodes = live_nodes(list((await self.store.list(keys.NODES)).entries))
            demands = [
                Demand(
                    id=j.id,
                    nproc=j.spec.nproc_per_node,
                    min_nodes=j.spec.min_nodes,
                    max_nodes=j.spec.max_nodes or j.spec.min_nodes,
                    priority=j.spec.priority,
                    created_at=j.created_at,
                    selector=dict(j.spec.node_selector),
                )
                for j in jobs
                if j.state in JOB_ACTIVE and j.launcher == "elasticd"  # torchrun runs its own
            ]
            # A plan that does not parse (written by hand, or by a hostile store writer) is
            # replaced, deciding from the last good one seen, not from nothing: that would
            # move every job without a word.
            outcome = schedule(stored or self.plan, demands, nodes, self.clock.time())
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

    def _emit(self, notice: Notice) -> None:
        self.events.emit(
            notice.job,
            "daemon",
            _NOTICE_KINDS[notice.kind],
            notice.message,
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
            try:
                await self._follows.wait()
            finally:
                await cancel_and_wait(watch)

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
            for n in live_nodes(entries)
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
