"""The rendezvous under adversarial schedules: real nodes' code over a real store, one seed.

Each simulated node runs what an agent runs of the rendezvous (the real
:class:`~elasticd.rendezvous.handler.StoreRendezvous`): join a round, run its
"workers", watch for a change, say it is leaving, stop them (taking a while),
join the next. Underneath is the real :class:`~elasticd.store.memory.MemoryStore`
(revisions, compare-and-set, leases with TTL, watches, compaction) behind one
proxy per node, on a virtual-time loop (:mod:`.vloop`).

One ``random.Random(seed)`` decides everything:

* which pending store call proceeds next: each call waits a drawn delay before
  it reaches the store and another before its answer reaches the node (a write
  can land while its answer is slow), so the seed orders every interleaving;
* faults, one draw per step: kill -9 of a node and its workers (its lease lives
  on until its TTL), restarts, dropped lease renewals, stalls of one node's
  calls or of the whole store, partitions of a node from the store, compaction,
  clock steps of a node forward and back, worker crashes, slow stops, and the
  job's end.

Invariants are checked at every change the store applies and every round a
node joins (:meth:`World.check_state`, :meth:`World.check_round`); once the
faults stop, the live nodes must form one round of ``min(live, max_nodes)``
within :data:`LIVENESS_BOUND` virtual seconds. A violation stops the run; the
run's trace (every fault and every round, with its virtual time) is kept, and
its tail is printed with the seed that replays it.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from elasticd.errors import (
    LeaseNotFound,
    RendezvousClosed,
    RendezvousError,
    StoreError,
    StoreUnavailable,
)
from elasticd.keys import rendezvous_prefix
from elasticd.rendezvous.handler import ABSORBER_FROM, StoreRendezvous
from elasticd.rendezvous.interface import RoundInfo
from elasticd.rendezvous.layout import state_key
from elasticd.rendezvous.protocol import Change, Head, Settings, State
from elasticd.store.base import CasResult, Entry, Listing, Store, WatchEvent
from elasticd.store.memory import MemoryStore, _Lease
from elasticd.tasks import cancel_and_wait
from tests.sim.vloop import run_virtual

JOB = "job"
#: The nodes' lease TTL (the daemon's default).
LEASE_TTL = 3.0
#: Wall time at virtual time 0.
EPOCH = 1_800_000_000.0
#: Virtual seconds after the last fault within which the live nodes must form one round.
LIVENESS_BOUND = 90.0


class Violation(AssertionError):
    """An invariant broke; the message says which, where and when."""


@dataclass
class Plan:
    """What one seed draws before the run: the job's shape and how hard the world is."""

    seed: int
    nodes: int
    min_nodes: int
    max_nodes: int
    steps: int
    #: Mean virtual seconds between two fault steps.
    tick: float
    #: The chance that a step injects a fault at all.
    fault_rate: float
    #: Agents leave for good (at the job's end, and when the plan takes a node). Off: the
    #: schedules drawn before they did, which the found seeds replay exactly.
    leaves: bool = True

    @staticmethod
    def draw(seed: int, steps: int = 300, large: bool | None = None, leaves: bool = True) -> Plan:
        rng = random.Random(f"plan-{seed}")
        if large is None:
            large = rng.random() < 0.1
        if large:
            nodes = rng.randint(ABSORBER_FROM, ABSORBER_FROM + 4)
            max_nodes = rng.randint(ABSORBER_FROM, nodes)
            min_nodes = rng.randint(max(1, max_nodes // 2), max_nodes)
        else:
            nodes = rng.randint(3, 6)
            max_nodes = rng.randint(2, nodes)
            min_nodes = rng.randint(1, max_nodes)
        return Plan(
            seed=seed,
            nodes=nodes,
            min_nodes=min_nodes,
            max_nodes=max_nodes,
            steps=steps,
            tick=rng.choice([0.1, 0.3, 0.6, 1.0]),
            fault_rate=rng.choice([0.05, 0.15, 0.3]),
            leaves=leaves,
        )


@dataclass
class Node:
    """One simulated daemon (its agent of the job, its lease, its workers)."""

    name: str
    index: int
    alive: bool = False
    incarnation: int = 0
    lease: int | None = None
    #: The round whose workers run on this node now (None: none run).
    running: int | None = None
    #: The wall clock's offset from the true time (clock steps move it).
    offset: float = 0.0
    crash: asyncio.Event = field(default_factory=asyncio.Event)
    lease_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    drop_renewals_until: float = 0.0
    #: Its agent's rendezvous (for a leave for good, as the real agent's last step).
    rdzv: StoreRendezvous | None = None
    #: Seconds the next stop of its workers takes.
    stop_delay: float = 0.0
    ended: str | None = None


class SimClock:
    """A node's clocks: the loop's time, and its wall clock with the node's offset."""

    def __init__(self, node: Node) -> None:
        self._node = node

    def monotonic(self) -> float:
        return asyncio.get_running_loop().time()

    def time(self) -> float:
        return EPOCH + asyncio.get_running_loop().time() + self._node.offset


class CheckedStore(MemoryStore):
    """The real in-memory store, telling the world of every change it applies."""

    def __init__(self, world: World) -> None:
        super().__init__(clock=lambda: asyncio.get_running_loop().time())
        self._world = world
        self._lease_ids = 0

    def _changed(self, event: WatchEvent, entry: Entry | None) -> None:
        super()._changed(event, entry)
        if event.key == self._world.state_key and event.value is not None:
            self._world.check_state(State.decode(event.value), event.revision)
        if event.key == self._world.done_key and event.value is not None:
            self._world.check_head(Head.decode(event.value), event.revision)

    async def grant(self, ttl: float) -> int:
        """A lease as the real store grants it, with an id drawn from a counter, not from
        ``secrets``: a replay's trace names the same leases."""
        self._check_open()
        self._lease_ids += 1
        lease = _Lease(id=self._lease_ids, ttl=float(ttl))
        self._leases[lease.id] = lease
        self._arm(lease)
        return lease.id

    async def grant_one(self) -> int:
        """A lease of the nodes' TTL (for a client that acts outside any node)."""
        return await self.grant(LEASE_TTL)


class NodeStore(Store):
    """One node's way to the store: every call waits its drawn delays, and fails while
    the node is cut off (see the module docstring)."""

    def __init__(self, world: World, node: Node) -> None:
        self._world = world
        self._node = node
        self._mem = world.store

    async def _go(self) -> None:
        await self._world.pass_gate(self._node)

    async def _back(self) -> None:
        await self._world.pass_back(self._node)

    async def get(self, key: str) -> Entry | None:
        await self._go()
        out = await self._mem.get(key)
        await self._back()
        return out

    async def compare_and_set(
        self, key: str, value: bytes, expected_version: int | None, *, lease: int | None = None
    ) -> CasResult:
        await self._go()
        out = await self._mem.compare_and_set(key, value, expected_version, lease=lease)
        await self._back()
        return out

    async def put(self, key: str, value: bytes, *, lease: int | None = None) -> Entry:
        await self._go()
        out = await self._mem.put(key, value, lease=lease)
        await self._back()
        return out

    async def put_batch(self, items: Sequence[tuple[str, bytes]]) -> list[Entry]:
        await self._go()
        out = await self._mem.put_batch(items)
        await self._back()
        return out

    async def add(self, key: str, delta: int = 1) -> int:
        await self._go()
        out = await self._mem.add(key, delta)
        await self._back()
        return out

    async def delete(self, key: str, expected_version: int | None = None) -> bool:
        await self._go()
        out = await self._mem.delete(key, expected_version)
        await self._back()
        return out

    async def list(self, prefix: str) -> Listing:
        await self._go()
        out = await self._mem.list(prefix)
        await self._back()
        return out

    async def grant(self, ttl: float) -> int:
        await self._go()
        out = await self._mem.grant(ttl)
        await self._back()
        return out

    async def keep_alive(self, lease: int) -> None:
        await self._go()
        await self._mem.keep_alive(lease)
        await self._back()

    async def revoke(self, lease: int) -> None:
        await self._go()
        await self._mem.revoke(lease)
        await self._back()

    async def watch(
        self, key: str, after_version: int, timeout: float, *, prefix: bool = False
    ) -> list[WatchEvent]:
        await self._go()
        out = await self._mem.watch(key, after_version, timeout, prefix=prefix)
        await self._back()
        return out


class World:
    """The simulated cluster of one job: nodes, the store, the faults and the checks."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.rng = random.Random(plan.seed)
        self.state_key = state_key(JOB)
        self.done_key = rendezvous_prefix(JOB) + "signal/done"
        self.last_head: Head | None = None
        self.last_state_version = 0
        self.settings = Settings(min_nodes=plan.min_nodes, max_nodes=plan.max_nodes)
        self.store = CheckedStore(self)
        self.nodes = [Node(f"n{i}", i) for i in range(plan.nodes)]
        self.by_name = {n.name: n for n in self.nodes}
        self.trace: list[str] = []
        self.violation: Violation | None = None
        self.job_ended = False
        self.faulting = True
        self.cut: set[str] = set()
        self.stalled_until: dict[str, float] = {}
        self.store_stalled_until = 0.0
        # What the store's changes showed: the last document, and each complete round.
        self.last_state: State | None = None
        self.completed: dict[int, dict[str, int]] = {}
        self.rounds_seen: dict[str, int] = {}
        self.rounds_joined = 0
        self._fail_event = asyncio.Event()

    # the trace and the verdict

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    def log(self, message: str) -> None:
        self.trace.append(f"{self.now():9.3f}  {message}")

    def fail(self, message: str) -> None:
        if self.violation is None:
            self.log(f"VIOLATION: {message}")
            self.violation = Violation(f"seed {self.plan.seed}: {message}")
            self._fail_event.set()

    # the store's way: delays, stalls, partitions

    def _delay(self) -> float:
        r = self.rng.random()
        if r < 0.6:
            return 0.0
        if r < 0.95:
            return self.rng.uniform(0.0, 0.01)
        return self.rng.uniform(0.05, 2.0)  # a slow call

    async def pass_gate(self, node: Node) -> None:
        await asyncio.sleep(self._delay())
        while True:
            until = max(self.stalled_until.get(node.name, 0.0), self.store_stalled_until)
            if self.now() >= until:
                break
            await asyncio.sleep(until - self.now())
        if node.name in self.cut:
            await asyncio.sleep(self.rng.uniform(0.0, 0.5))
            raise StoreUnavailable(f"{node.name} is cut off from the store")

    async def pass_back(self, node: Node) -> None:
        await asyncio.sleep(self._delay())
        if node.name in self.cut:
            raise StoreUnavailable(f"{node.name} is cut off from the store (the answer was lost)")

    # invariants

    def check_head(self, head: Head | None, revision: int) -> None:
        """At every write of the head: it never goes back, and never leads the document."""
        before, self.last_head = self.last_head, head
        where = f"the head (revision {revision})"
        if head is None:
            self.fail(f"{where} is malformed")
            return
        # By what it shows, whatever version it names (a head of an older daemon names none).
        if before is not None and (
            (head.round, head.complete) < (before.round, before.complete)
            or (before.closed and not head.closed and self.job_ended)
            or head.version < before.version
        ):
            self.fail(f"{where} went back: {before} -> {head}")
        doc = self.last_state
        if head.version > self.last_state_version or (doc is not None and head.round > doc.round):
            self.fail(f"{where} leads the document (version {self.last_state_version}): {head}")

    def check_state(self, state: State, revision: int) -> None:
        """At every write of the document."""
        s, before = self.settings, self.last_state
        self.last_state, self.last_state_version = state, revision
        p, w, r = frozenset(state.participants), state.wait_list, state.redundancy_list
        where = f"round {state.round} (revision {revision})"
        if p & w or p & r or w & r:
            self.fail(f"{where}: the participant, wait and spare lists overlap: {state}")
        if len(p) > s.max_nodes:
            self.fail(f"{where}: {len(p)} participants, more than max_nodes {s.max_nodes}")
        if state.complete:
            if sorted(state.participants.values()) != list(range(len(p))):
                self.fail(f"{where}: ranks {state.participants} are not 0..{len(p) - 1}")
            if not s.min_nodes <= len(p) <= s.max_nodes:
                self.fail(f"{where}: a complete round of {len(p)} nodes, not in min..max")
            missing = p - frozenset(state.nodes)
            if missing:
                self.fail(f"{where}: participants {sorted(missing)} have no join info")
        if before is not None:
            if state.round < before.round:
                self.fail(f"{where}: the round went back from {before.round}")
            if state.round == before.round and before.complete:
                if not state.complete:
                    self.fail(f"{where}: a complete round was opened again in place")
                elif state.participants != before.participants:
                    self.fail(
                        f"{where}: a complete round was rewritten in place: "
                        f"{before.participants} -> {state.participants}"
                    )
            if before.closed and not state.closed and self.job_ended:
                self.fail(f"{where}: the rendezvous of an ended job was opened again")
        if state.complete and not state.closed:
            known = self.completed.get(state.round)
            if known is None:
                self.completed[state.round] = dict(state.participants)
                self.log(f"round {state.round} complete: {dict(state.participants)}")
                for name in p:
                    node = self.by_name.get(name)
                    if node is not None and node.alive and node.running is not None:
                        self.fail(
                            f"{where}: {name} is a participant while it still runs "
                            f"round {node.running}'s workers"
                        )
            elif known != state.participants:
                self.fail(f"{where}: two different complete rounds: {known} and {state}")

    def check_round(self, node: Node, info: RoundInfo) -> None:
        """At every round a node joins."""
        s = self.settings
        self.rounds_joined += 1
        last = self.rounds_seen.get(node.name)
        where = f"{node.name} joined round {info.round}"
        self.log(f"{where} as group rank {info.group_rank} of {info.group_world_size}")
        if last is not None and info.round <= last:
            self.fail(f"{where}, after round {last}: a node's rounds must only go up")
        self.rounds_seen[node.name] = info.round
        if not s.min_nodes <= info.group_world_size <= s.max_nodes:
            self.fail(f"{where}: world size {info.group_world_size} not in min..max")
        if not 0 <= info.group_rank < info.group_world_size:
            self.fail(f"{where}: group rank {info.group_rank} out of 0..world size")
        known = self.completed.get(info.round)
        if known is None:
            self.fail(f"{where}: no complete document of that round was ever written")
            return
        if known.get(node.name) != info.group_rank or len(known) != info.group_world_size:
            self.fail(f"{where}: the round was completed as {known}")
        if info.roster_known and info.participants != known:
            self.fail(f"{where}: its participants {info.participants} differ from {known}")

    # the nodes

    def still_active(self) -> bool:
        return not self.job_ended

    async def _lease(self, node: Node, store: NodeStore) -> int:
        """The node's live lease, granted if it has none (one grant at a time, as the
        daemon's ``Cluster.lease``)."""
        async with node.lease_lock:
            while node.lease is None:
                node.lease = await store.grant(LEASE_TTL)
            return node.lease

    async def _renew(self, node: Node, store: NodeStore) -> None:
        while True:
            await asyncio.sleep(LEASE_TTL / 3)
            if self.now() < node.drop_renewals_until:
                continue
            try:
                if node.lease is None:
                    await self._lease(node, store)
                else:
                    await store.keep_alive(node.lease)
            except LeaseNotFound:
                self.log(f"{node.name}: its lease expired; a new one is granted")
                node.lease = None
            except StoreError:
                pass

    async def _agent(self, node: Node, store: NodeStore) -> None:
        async def lease() -> int:
            return await self._lease(node, store)

        rdzv = StoreRendezvous(
            store,
            JOB,
            node=node.name,
            role="default",
            local_world_size=1 + node.index % 2,
            advertise_addr="127.0.0.1",
            settings=self.settings,
            lease=lease,
            master_port=20_000 + node.index,
            clock=SimClock(node),
            still_active=self._active,
        )
        node.rdzv = rdzv
        while True:
            try:
                info = await rdzv.next_round()
            except RendezvousClosed:
                node.ended = "closed"
                self.log(f"{node.name}: the rendezvous is closed; its agent ends")
                await self._leave(node, rdzv)
                return
            except StoreError as exc:
                self.log(f"{node.name}: the store failed its join ({exc}); it tries again")
                await asyncio.sleep(0.5)
                continue
            except RendezvousError as exc:
                self.fail(f"{node.name}'s join failed the job: {exc!r}")
                return
            self.check_round(node, info)
            node.running = info.round
            node.crash.clear()
            change = await self._run_round(node, rdzv, info)
            if change is Change.CLOSED:
                node.running = None
                node.ended = "closed"
                self.log(f"{node.name}: the job ended; its agent ends")
                await self._leave(node, rdzv)
                return
            with contextlib.suppress(StoreError):
                await rdzv.leaving(info.round)
            await asyncio.sleep(node.stop_delay)
            node.stop_delay = 0.0
            node.running = None

    async def _leave(self, node: Node, rdzv: StoreRendezvous) -> None:
        """The agent's last step, as the real agent's (Departure.leave): bounded, best effort."""
        if not self.plan.leaves:
            return
        with contextlib.suppress(StoreError, RendezvousError, TimeoutError):
            async with asyncio.timeout(5.0):
                await rdzv.leave()
                self.log(f"{node.name} left the rendezvous for good")

    async def _active(self) -> bool:
        return self.still_active()

    async def _run_round(self, node: Node, rdzv: StoreRendezvous, info: RoundInfo) -> Change | None:
        """The workers run until they crash or the watch names a change (None: a crash,
        or the store lost)."""
        crash = asyncio.create_task(node.crash.wait())
        try:
            return await self._watch_round(node, rdzv, info, crash)
        finally:
            crash.cancel()

    async def _watch_round(
        self, node: Node, rdzv: StoreRendezvous, info: RoundInfo, crash: asyncio.Task[bool]
    ) -> Change | None:
        while True:
            watch = asyncio.create_task(rdzv.wait_for_change(info.round))
            try:
                done, _ = await asyncio.wait({crash, watch}, return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:  # the node is killed
                watch.cancel()
                raise
            if crash in done:
                await cancel_and_wait(watch)  # a kill of the node meanwhile still goes through
                self.log(f"{node.name}: a worker of round {info.round} crashed")
                return None
            try:
                change = watch.result()
            except StoreError as exc:
                self.log(f"{node.name}: its watch failed ({exc}); its workers stop")
                crash.cancel()
                return None
            except RendezvousError as exc:
                crash.cancel()
                self.fail(f"{node.name}'s watch failed the job: {exc!r}")
                return None
            crash.cancel()
            self.log(f"{node.name}: round {info.round} ends: {change.value}")
            return change

    def start(self, node: Node) -> None:
        node.alive, node.incarnation = True, node.incarnation + 1
        node.lease, node.running, node.ended = None, None, None
        node.crash, node.lease_lock = asyncio.Event(), asyncio.Lock()
        store = NodeStore(self, node)
        node.tasks = [
            asyncio.create_task(self._guard(node, lambda: self._agent(node, store))),
            asyncio.create_task(self._guard(node, lambda: self._renew(node, store))),
        ]
        self.log(f"{node.name} starts (incarnation {node.incarnation})")

    async def _guard(self, node: Node, body: Callable[[], Awaitable[None]]) -> None:
        """Run ``body()`` (made here: a node killed before its task starts leaves no
        coroutine unawaited)."""
        try:
            await body()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # an agent that raises fails its job: agent.error
            self.fail(f"{node.name}'s agent raised {exc!r}")

    async def kill(self, node: Node) -> None:
        node.alive, node.running = False, None
        for task in node.tasks:
            task.cancel()
        if node.tasks:
            # A cancelled agent ends at once (no task outlives its owner): one that is
            # still running a minute later swallowed its cancellation.
            _, pending = await asyncio.wait(node.tasks, timeout=60.0)
            if pending:
                self.fail(f"{node.name}'s agent went on after it was cancelled (killed)")
        node.tasks = []
        self.log(f"{node.name} is killed -9 (its lease lives until its TTL)")

    # the faults

    async def step(self) -> None:
        rng, plan = self.rng, self.plan
        if rng.random() >= plan.fault_rate:
            return
        alive = [n for n in self.nodes if n.alive]
        dead = [n for n in self.nodes if not n.alive]
        kind = rng.choice(
            [
                "kill", "restart", "crash", "crash", "crash", "renewals", "stall", "stall_all",
                "cut", "compact", "clock", "slow_stop", "end",
                *(["leave"] if plan.leaves else []),
            ]
        )  # fmt: skip
        if kind == "kill" and alive:
            await self.kill(rng.choice(alive))
        elif kind == "restart" and dead:
            self.start(rng.choice(dead))
        elif kind == "crash":
            running = [n for n in alive if n.running is not None]
            if running:
                node = rng.choice(running)
                node.stop_delay = rng.choice([0.0, 0.0, rng.uniform(0.0, 3.0)])
                node.crash.set()
                self.log(
                    f"{node.name}: a worker crashes (its stop will take {node.stop_delay:.2f} s)"
                )
        elif kind == "slow_stop" and alive:
            node = rng.choice(alive)
            node.stop_delay = rng.uniform(0.5, 3.0)
            self.log(f"{node.name}: its next stop will take {node.stop_delay:.2f} s")
        elif kind == "renewals" and alive:
            node = rng.choice(alive)
            span = rng.uniform(0.5, 3 * LEASE_TTL)
            node.drop_renewals_until = self.now() + span
            self.log(f"{node.name}: its lease renewals are dropped for {span:.2f} s")
        elif kind == "stall" and alive:
            node = rng.choice(alive)
            span = rng.uniform(0.1, 2 * LEASE_TTL)
            self.stalled_until[node.name] = self.now() + span
            self.log(f"{node.name}: its store calls stall for {span:.2f} s")
        elif kind == "stall_all":
            span = rng.uniform(0.1, LEASE_TTL)
            self.store_stalled_until = self.now() + span
            self.log(f"the store stalls for {span:.2f} s")
        elif kind == "cut" and alive:
            node = rng.choice(alive)
            span = rng.uniform(0.2, 3 * LEASE_TTL)
            self.cut.add(node.name)
            asyncio.get_running_loop().call_later(span, self.cut.discard, node.name)
            self.log(f"{node.name} is cut off from the store for {span:.2f} s")
        elif kind == "compact":
            self.store.compact()
            self.log(f"the store is compacted at revision {self.store.revision}")
        elif kind == "clock" and alive:
            node = rng.choice(alive)
            jump = rng.choice([-1.0, 1.0]) * rng.choice([0.2, 1.0, 5.0, 3600.0])
            node.offset += jump
            self.log(f"{node.name}: its wall clock steps {jump:+.1f} s")
        elif kind == "leave" and alive and not self.job_ended:
            # The plan takes the node from the job: its agent ends (workers stopped) and
            # leaves for good; the daemon (and its lease) is then killed: it may come back.
            node = rng.choice(alive)
            rdzv = node.rdzv
            agent = node.tasks[0]
            agent.cancel()
            _, pending = await asyncio.wait({agent}, timeout=60.0)
            if pending:
                self.fail(f"{node.name}'s agent went on after it was cancelled (taken)")
            node.running = None
            self.log(f"{node.name}: the plan takes it from the job; it leaves for good")
            if rdzv is not None:
                await self._leave(node, rdzv)
            await self.kill(node)
        elif kind == "end" and rng.random() < 0.1 and not self.job_ended:
            await self.end_job()

    async def end_job(self) -> None:
        """The job ends (its workers succeeded, or a cancel): its end, then the closure."""
        self.job_ended = True
        self.log("the job ends: the rendezvous is closed")
        closer = StoreRendezvous(
            self.store,
            JOB,
            node="closer",
            role="default",
            local_world_size=1,
            advertise_addr="127.0.0.1",
            settings=self.settings,
            lease=self.store.grant_one,
            master_port=19_999,
        )
        await closer.close()

    async def heal(self) -> None:
        """The faults stop: every cut, stall, dropped renewal and clock step ends."""
        self.faulting = False
        self.cut.clear()
        self.stalled_until.clear()
        self.store_stalled_until = 0.0
        for node in self.nodes:
            node.drop_renewals_until = 0.0
            node.offset = self.rng.uniform(-0.05, 0.05)
        dead = [n for n in self.nodes if not n.alive]
        self.rng.shuffle(dead)
        while sum(n.alive for n in self.nodes) < self.settings.min_nodes and dead:
            self.start(dead.pop())
        for node in dead:
            if self.rng.random() < 0.5:
                self.start(node)
        self.log("the faults stop")

    def settled(self) -> bool:
        """One round of min(live, max) nodes runs, with every one of them in it."""
        live = [n for n in self.nodes if n.alive]
        if self.job_ended:
            return all(n.ended is not None for n in live)
        state = self.last_state
        if state is None or not state.complete or state.closed:
            return False
        want = min(len(live), self.settings.max_nodes)
        members = set(state.participants)
        return (
            len(members) == want
            and members <= {n.name for n in live}
            and all(self.by_name[m].running == state.round for m in members)
        )

    async def run(self) -> None:
        for node in self.nodes:
            self.start(node)
        failed = asyncio.create_task(self._fail_event.wait())
        try:
            for _ in range(self.plan.steps):
                await asyncio.sleep(self.rng.expovariate(1 / self.plan.tick))
                await self.step()
                if self.violation is not None:
                    return
            await self.heal()
            deadline = self.now() + LIVENESS_BOUND
            while not self.settled():
                if self.violation is not None:
                    return
                if self.now() >= deadline:
                    live = [n.name for n in self.nodes if n.alive]
                    self.fail(
                        f"liveness: {LIVENESS_BOUND:.0f} s after the faults stopped, "
                        f"the live nodes {live} formed no round of "
                        f"min(live, max_nodes={self.settings.max_nodes}): {self.last_state}"
                    )
                    return
                await asyncio.sleep(0.25)
            self.log("settled")
        finally:
            failed.cancel()
            for node in self.nodes:
                if node.alive:
                    await self.kill(node)


@dataclass
class Outcome:
    plan: Plan
    violation: Violation | None
    trace: list[str]
    rounds: int
    virtual_s: float

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.trace[-lines:])


def simulate(
    seed: int, steps: int = 300, large: bool | None = None, leaves: bool = True
) -> Outcome:
    """Run one schedule; the outcome holds the violation (None: every invariant held)."""
    plan = Plan.draw(seed, steps, large, leaves)
    box: dict[str, World] = {}

    async def main() -> float:
        world = World(plan)
        box["world"] = world
        await world.run()
        return world.now()

    virtual = run_virtual(main())
    world = box["world"]
    return Outcome(plan, world.violation, world.trace, world.rounds_joined, virtual)
