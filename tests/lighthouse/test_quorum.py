"""One job's Lighthouse over a shared in-memory store: quorums, the loss of the leader's
node, restarts, and hostile documents (JobQuorum's API, no gRPC)."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, cast

import pytest

from elasticd import keys
from elasticd.lighthouse.proto import Quorum, QuorumMember
from elasticd.lighthouse.quorum import JobQuorum
from elasticd.lighthouse.rules import Settings
from elasticd.lighthouse.state import QuorumDoc, decode_doc, encode
from elasticd.testing import MemoryStore

pytestmark = pytest.mark.timeout(30)

JOB = "job1"
FAST = Settings(min_replicas=2, join_timeout=0.3, heartbeat_timeout=0.5)


class Node:
    """A node: its lease (kept alive), its JobQuorum, and the heartbeats of its replicas."""

    def __init__(self, store: MemoryStore, name: str, settings: Settings = FAST) -> None:
        self.store, self.name, self.settings = store, name, settings
        self.lease = 0
        self.replicas: set[str] = set()
        self.jq: JobQuorum | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> JobQuorum:
        if not self.lease:
            self.lease = await self.store.grant(1.0)
        self.jq = JobQuorum(self.store, JOB, self.name, self._get_lease, self.settings)
        await self.jq.start()
        self._tasks = [asyncio.create_task(self._keep()), asyncio.create_task(self._beat())]
        return self.jq

    async def _get_lease(self) -> int:
        return self.lease

    async def _keep(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            with contextlib.suppress(Exception):
                await self.store.keep_alive(self.lease)

    async def _beat(self) -> None:
        while True:
            assert self.jq is not None
            for r in self.replicas:
                self.jq.heartbeat(r)
            await asyncio.sleep(0.05)

    async def crash(self) -> None:
        """kill -9 of the daemon: its loops stop, nothing is cleaned; its lease ends."""
        for task in self._tasks:
            task.cancel()
        assert self.jq is not None
        await self.jq.stop(leave=False)
        await self.store.revoke(self.lease)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self.jq is not None:
            await self.jq.stop()

    def ask(self, replica: str, step: int = 0) -> Awaitable[Quorum]:
        self.replicas.add(replica)
        assert self.jq is not None
        return self.jq.quorum(QuorumMember(replica, address=f"addr-{replica}", step=step))


@pytest.fixture
async def store() -> AsyncIterator[MemoryStore]:
    async with MemoryStore() as s:
        yield s


async def round_(asks: dict[str, Node]) -> dict[str, Quorum]:
    """Every replica asks once; each one's answer."""
    answers = await asyncio.gather(*(node.ask(r) for r, node in asks.items()))
    return dict(zip(asks, answers, strict=True))


def ids(q: Quorum) -> list[str]:
    return [m.replica_id for m in q.participants]


async def until(check: Callable[[], bool], seconds: float = 10.0) -> None:
    async with asyncio.timeout(seconds):
        while not check():
            await asyncio.sleep(0.02)


async def test_a_quorum_forms_repeats_its_id_and_shrinks_when_a_replica_dies(
    store: MemoryStore,
) -> None:
    """All ask: quorum 1; again: still 1; one stops: quorum 2 of the other two."""
    node = Node(store, "n1")
    await node.start()
    try:
        first = await round_({"a": node, "b": node, "c": node})
        assert {q.quorum_id for q in first.values()} == {1}
        assert ids(first["a"]) == ["a", "b", "c"]
        again = await round_({"a": node, "b": node, "c": node})
        assert {q.quorum_id for q in again.values()} == {1}
        node.replicas.discard("c")  # c dies: no more beats, no more requests
        shrunk = await round_({"a": node, "b": node})
        assert {q.quorum_id for q in shrunk.values()} == {2}
        assert ids(shrunk["a"]) == ["a", "b"]
        assert node.jq is not None
        status = node.jq.status()
        assert status["quorum_id"] == 2 and status["members"] == ["a", "b"]
        assert status["leading"] is True and status["decided_by"] == "n1"
    finally:
        await node.stop()


async def test_the_loss_of_the_leaders_node_costs_one_lease_and_no_quorum_of_one(
    store: MemoryStore,
) -> None:
    """Two nodes; the leader's crashes with its replica: the other node's two replicas go on,
    ids rising, within lease TTL + heartbeat timeout (+ slack), never alone."""
    n1, n2 = Node(store, "n1"), Node(store, "n2")
    await n1.start()
    await n2.start()
    try:
        await until(lambda: bool(n1.jq and n1.jq.leading))
        first = await round_({"a": n1, "b": n2, "c": n2})
        assert {q.quorum_id for q in first.values()} == {1}
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await n1.crash()
        after = await round_({"b": n2, "c": n2})
        stall = loop.time() - t0
        assert {q.quorum_id for q in after.values()} == {2}
        assert ids(after["b"]) == ["b", "c"]
        assert n2.jq is not None and n2.jq.leading
        assert stall < 1.0 + FAST.heartbeat_timeout + FAST.join_timeout + 1.0
    finally:
        await n2.stop()


async def test_the_quorum_id_survives_every_daemon(store: MemoryStore) -> None:
    """Both daemons stop; fresh ones start from the stored id, never from 1."""
    node = Node(store, "n1")
    await node.start()
    await round_({"a": node, "b": node})
    await node.stop()
    fresh = Node(store, "n1")
    await fresh.start()
    try:
        answers = await round_({"x": fresh, "y": fresh})
        assert {q.quorum_id for q in answers.values()} == {2}
    finally:
        await fresh.stop()


async def test_a_damaged_quorum_document_never_sends_the_id_back(store: MemoryStore) -> None:
    """A store writer overwrites the document with garbage, then with id 0: the leader's
    floor keeps the ids rising."""
    node = Node(store, "n1")
    await node.start()
    try:
        await round_({"a": node, "b": node})
        await store.put(keys.lighthouse_quorum_key(JOB), b"not json")
        node.replicas = {"a"}  # b leaves; c joins
        answers = await round_({"a": node, "c": node})
        assert {q.quorum_id for q in answers.values()} == {2}
        await store.put(keys.lighthouse_quorum_key(JOB), encode(QuorumDoc(quorum_id=0)))
        node.replicas = {"a"}  # c leaves; d joins
        answers = await round_({"a": node, "d": node})
        assert {q.quorum_id for q in answers.values()} == {3}
        entry = await store.get(keys.lighthouse_quorum_key(JOB))
        assert entry is not None
        doc = decode_doc(entry.value)
        assert isinstance(doc, QuorumDoc) and doc.quorum_id == 3
    finally:
        await node.stop()


async def test_records_and_leaders_off_any_lease_are_ignored(store: MemoryStore) -> None:
    """A squatted leader key (no lease) is taken over; a forged record (no lease) adds no
    replica to the quorum."""
    await store.put(keys.lighthouse_leader_key(JOB), b"ghost")
    forged = b'{"v":1,"node":"ghost","beats":{"z":1},"pending":{}}'
    await store.put(keys.lighthouse_node_key(JOB, "ghost"), forged)
    node = Node(store, "n1")
    await node.start()
    try:
        answers = await round_({"a": node, "b": node})
        assert ids(answers["a"]) == ["a", "b"]  # z would have made 2 of 3 wait for it
        assert node.jq is not None and node.jq.leading
    finally:
        await node.stop()


async def test_a_straggler_is_waited_for_until_the_join_timeout(store: MemoryStore) -> None:
    """Three beat, two ask: the quorum waits join_timeout for the third, then goes on."""
    node = Node(store, "n1", Settings(min_replicas=2, join_timeout=0.6, heartbeat_timeout=5.0))
    await node.start()
    node.replicas |= {"c"}
    try:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        answers = await round_({"a": node, "b": node})
        assert ids(answers["a"]) == ["a", "b"]
        assert loop.time() - t0 >= 0.6
    finally:
        await node.stop()


async def test_node_records_are_written_per_period_not_per_beat(store: MemoryStore) -> None:
    """Heartbeats every 50 ms for a second: about five record writes, not twenty."""
    node = Node(store, "n1", Settings(min_replicas=1, join_timeout=0.0, heartbeat_timeout=1.0))
    await node.start()
    node.replicas |= {"a", "b"}
    key = keys.lighthouse_node_key(JOB, "n1")
    try:
        start = await store.get(key)
        assert start is not None
        await asyncio.sleep(1.0)
        events = await store.watch(key, start.version, 0.01)
        assert 3 <= len(events) <= 8
    finally:
        await node.stop()


class Jittery:
    """The store with a seeded delay before and after every call, so that concurrent
    loops interleave between a read and their write (the in-memory store never yields)."""

    def __init__(self, store: MemoryStore, seed: int) -> None:
        self._store = store
        self._rng = random.Random(seed)

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._store, name)
        if name not in {"get", "list", "put", "compare_and_set", "delete", "watch"}:
            return target

        async def call(*args: Any, **kwargs: Any) -> Any:
            await asyncio.sleep(self._rng.random() * 0.004)
            result = await target(*args, **kwargs)
            await asyncio.sleep(self._rng.random() * 0.004)
            return result

        return call


@pytest.mark.parametrize("seed", range(3))
async def test_two_leaders_at_once_still_issue_one_line_of_quorums(
    store: MemoryStore, seed: int
) -> None:
    """Extra decide loops (leaders whose lease lapsed in a partition, still deciding) beside
    the elected one, on both nodes, so that every round two loops decide from one version
    and race to write it: every stored quorum has one membership per id, ids never go
    back, none is below min_replicas, and every replica gets an answer."""
    jittery = cast(MemoryStore, Jittery(store, seed))
    n1, n2 = Node(jittery, "n1"), Node(jittery, "n2")
    await n1.start()
    await n2.start()
    assert n1.jq is not None and n2.jq is not None
    rogues = [asyncio.create_task(n.jq._decide_loop()) for n in (n1, n2) if n.jq is not None]
    key = keys.lighthouse_quorum_key(JOB)
    try:
        start = (await store.list(key)).revision
        for step in range(8):
            asks = {"a": n1, "b": n2, "c": n2} if step % 3 else {"a": n1, "b": n2}
            if step % 3 == 0:
                n2.replicas.discard("c")
                await asyncio.sleep(FAST.heartbeat_timeout)  # c goes stale
            answers = await round_(asks)
            assert len({q.quorum_id for q in answers.values()}) == 1
        events = await store.watch(key, start, 0.01)
        docs = [decode_doc(e.value) for e in events if e.value is not None]
        assert all(isinstance(d, QuorumDoc) for d in docs)
        line = [(d.quorum_id, d.members()) for d in docs if isinstance(d, QuorumDoc)]
        assert [i for i, _ in line] == sorted(i for i, _ in line)
        by_id: dict[int, set[tuple[str, ...]]] = {}
        for quorum_id, members in line:
            by_id.setdefault(quorum_id, set()).add(members)
            assert len(members) >= FAST.min_replicas
        assert all(len(m) == 1 for m in by_id.values()), by_id
        # and each request is granted once: no two writes from one version
        grants = [
            (p.node, p.ticket) for d in docs if isinstance(d, QuorumDoc) for p in d.participants
        ]
        assert len(grants) == len(set(grants))
    finally:
        for rogue in rogues:
            rogue.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await rogue
        await n1.stop()
        await n2.stop()


async def test_a_nodes_record_is_bounded(store: MemoryStore) -> None:
    """Past MAX_PARTICIPANTS replicas a heartbeat is refused; a request that would put the
    record over MAX_DOC_BYTES is refused; what was accepted is still written."""
    from elasticd.lighthouse.quorum import OverLimit
    from elasticd.lighthouse.state import MAX_DOC_BYTES, decode_record

    node = Node(store, "n1", Settings(min_replicas=5000, join_timeout=0.0, heartbeat_timeout=5.0))
    jq = await node.start()
    polls: list[asyncio.Future[Quorum]] = []
    try:
        for i in range(1024):
            jq.heartbeat(f"r{i}")
        with pytest.raises(OverLimit, match="1024 replicas"):
            jq.heartbeat("one-more")
        jq.heartbeat("r7")  # a known replica still beats
        big = "x" * 4000
        refused: BaseException | None = None
        for i in range(1024):
            member = QuorumMember(f"r{i}", address=big, store_address=big, data=big)
            polls.append(asyncio.ensure_future(jq.quorum(member)))
            await asyncio.sleep(0)
            if polls[-1].done():
                refused = polls.pop().exception()
                break
        assert isinstance(refused, OverLimit) and "over 524288 bytes" in str(refused)
        await asyncio.sleep(0.1)
        entry = await store.get(keys.lighthouse_node_key(JOB, "n1"))
        assert entry is not None and len(entry.value) <= MAX_DOC_BYTES
        record = decode_record(entry.value, "n1")
        assert not isinstance(record, str) and 20 < len(record.pending) < 60
    finally:
        for poll in polls:
            poll.cancel()
        await node.stop()


async def test_a_reexec_keeps_leadership_tickets_and_the_next_quorum(store: MemoryStore) -> None:
    """The daemon's image is replaced (its loops stop without leaving; the same node and
    lease start again): it still leads, its tickets go on, the next round is answered."""
    node = Node(store, "n1")
    first = await node.start()
    await round_({"a": node, "b": node})
    ticket = first._ticket
    for task in node._tasks:
        task.cancel()
    await first.stop(leave=False)
    second = await node.start()
    try:
        assert second._ticket >= ticket
        answers = await round_({"a": node, "b": node})
        assert {q.quorum_id for q in answers.values()} == {1}
        assert second.leading
    finally:
        await node.stop()


async def test_a_poll_whose_quorum_was_missed_is_told_to_ask_again(store: MemoryStore) -> None:
    """A document that shows the poll's request granted but does not name it (the quorum
    that did was compacted away unseen): the poll ends with MissedQuorum, not a hang."""
    from elasticd.lighthouse.quorum import MissedQuorum
    from elasticd.lighthouse.state import Grant

    node = Node(store, "n1", Settings(min_replicas=3, join_timeout=0.0, heartbeat_timeout=5.0))
    jq = await node.start()
    try:
        poll = asyncio.ensure_future(node.ask("a"))
        await asyncio.sleep(0)
        later = QuorumDoc(quorum_id=9, granted={"a": Grant(node="n1", ticket=jq._ticket)})
        await store.put(keys.lighthouse_quorum_key(JOB), encode(later))
        with pytest.raises(MissedQuorum):
            await asyncio.wait_for(poll, 5)
    finally:
        await node.stop()
