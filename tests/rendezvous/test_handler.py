"""The rendezvous executor over a real in-memory store: rounds, re-formation, loss, closing."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections import Counter

import pytest

from elasticd.errors import RendezvousClosed
from elasticd.rendezvous import Change, RoundInfo, Settings, StoreRendezvous
from elasticd.rendezvous.handler import MAX_REOPENS
from elasticd.rendezvous.layout import absorber_key, decode_state, membership_prefix, state_key
from elasticd.rendezvous.protocol import State
from elasticd.testing import MemoryStore

SEATS_FROM = 16


@pytest.fixture(autouse=True, params=[16, 1], ids=["document", "seats"])
def _seats_from(request, monkeypatch):
    """Every test runs twice: jobs joining by the document, and by seats (large jobs' way)."""
    monkeypatch.setattr(sys.modules[__name__], "SEATS_FROM", request.param)


async def node(
    store: MemoryStore,
    name: str,
    settings: Settings,
    ttl: float = 30.0,
    absorber_from: int = 1,
    still_active=None,
):
    """One simulated node (by default with the absorber role on at every job size);
    ``still_active``: whether its job still runs (StoreRendezvous)."""
    lease = await store.grant(ttl)

    async def current_lease() -> int:
        return lease

    rdzv = StoreRendezvous(
        store,
        "job",
        node=name,
        role="default",
        local_world_size=2,
        advertise_addr="127.0.0.1",
        settings=settings,
        lease=current_lease,
        absorber_from=absorber_from,
        seats_from=SEATS_FROM,
        absorber_overdue=0.5,  # large jobs give a late hold ABSORBER_HOLD more; tests less
        still_active=still_active,
    )
    return rdzv, lease


async def test_two_nodes_agree_on_ranks_and_master():
    """Both nodes finish the same round with distinct group ranks and one master."""
    store = MemoryStore()
    s = Settings(min_nodes=2, max_nodes=2)
    (a, _), (b, _) = await node(store, "a", s), await node(store, "b", s)
    async with asyncio.timeout(10):
        ra, rb = await asyncio.gather(a.next_round(), b.next_round())
    assert (ra.round, rb.round) == (0, 0)
    assert {ra.group_rank, rb.group_rank} == {0, 1}
    assert (ra.master_addr, ra.master_port) == (rb.master_addr, rb.master_port)
    if ra.seat is None:
        assert [n.local_world_size for n in ra.nodes] == [2, 2]
    else:  # the completer computed the ranks: no node list travels
        assert (ra.seat.world_size, ra.seat.base_rank) == (4, 2 * ra.group_rank)


async def test_failed_node_rejoins_and_the_other_reforms_without_livelock():
    """A node leaving to rejoin opens the next round for both in one write; both form round 1."""
    store = MemoryStore()
    s = Settings(min_nodes=2, max_nodes=2)
    (a, _), (b, _) = await node(store, "a", s), await node(store, "b", s)
    async with asyncio.timeout(10):
        first = await asyncio.gather(a.next_round(), b.next_round())
        rejoin = asyncio.create_task(a.next_round())  # a's worker failed: leave and rejoin
        assert await b.wait_for_change(first[1].round) is Change.NEW_ROUND
        ra, rb = await asyncio.gather(rejoin, b.next_round())
    assert ra.round == rb.round == 1
    assert ra.master_port != first[0].master_port  # a fresh port every round


async def test_lease_expiry_is_seen_as_loss_at_once():
    """A participant whose lease ends is reported as LOSS to the watcher without polling."""
    store = MemoryStore()
    s = Settings(min_nodes=1, max_nodes=2)
    (a, _), (b, lease_b) = await node(store, "a", s), await node(store, "b", s)
    async with asyncio.timeout(10):
        ra, _ = await asyncio.gather(a.next_round(), b.next_round())
        watcher = asyncio.create_task(a.wait_for_change(ra.round))
        await asyncio.sleep(0)
        assert not watcher.done()
        await store.revoke(lease_b)
        assert await watcher is Change.LOSS
        again = await a.next_round()
    assert again.group_world_size == 1


async def _closed_while_running(
    store: MemoryStore, s: Settings, a_active, b_active
) -> tuple[StoreRendezvous, StoreRendezvous, RoundInfo, asyncio.Task[Change]]:
    """Nodes ``a`` and ``b`` (their ``still_active``) form a round, then the agent of a
    deleted job of the id (no such check) closes it while ``a`` watches: ``a``, ``b``, the
    round and ``a``'s watch."""
    (a, _) = await node(store, "a", s, still_active=a_active)
    (b, _) = await node(store, "b", s, still_active=b_active)
    (old, _) = await node(store, "old", s)
    first = await asyncio.gather(a.next_round(), b.next_round())
    watching = asyncio.create_task(a.wait_for_change(first[0].round))
    await asyncio.sleep(0)
    await old.close()
    return a, b, first[0], watching


async def _state(store: MemoryStore) -> State:
    entry = await store.get(state_key("job"))
    assert entry is not None
    return decode_state(entry.value, entry.version)


async def test_a_closure_while_the_job_still_runs_is_undone_in_place():
    """Closed by another job of the id (an old agent's late close) while this job runs: the
    running node opens it again as it was (the same round, its participants) and keeps
    watching, so nothing restarts (a node at the exit barrier does not run its finished
    workers again); a later change ends the watch as always, and a node that finds it
    closed when it joins opens it and joins."""
    store = MemoryStore()
    s = Settings(min_nodes=2, max_nodes=2)
    asked: list[str] = []

    async def still_active() -> bool:
        asked.append("asked")
        return True

    async with asyncio.timeout(10):
        a, b, first, watching = await _closed_while_running(store, s, still_active, still_active)
        while (await _state(store)).closed:  # a's watch saw it and opens it again
            await asyncio.sleep(0.01)
        state = await _state(store)
        assert (state.round, state.complete, sorted(state.participants)) == (
            first.round,
            True,
            ["a", "b"],
        )
        await asyncio.sleep(0.1)
        assert not watching.done()  # a's workers run on
        rejoin = asyncio.create_task(b.next_round())  # a real change: b's worker failed
        assert await watching is Change.NEW_ROUND
        again = await asyncio.gather(a.next_round(), rejoin)
    assert again[0].round == again[1].round == first.round + 1
    assert asked
    async with asyncio.timeout(10):  # closed before a join: the join opens it again
        await (await node(store, "old", s))[0].close()
        rejoined = await asyncio.gather(a.next_round(), b.next_round())
    assert rejoined[0].round == rejoined[1].round > again[0].round


async def test_a_job_that_ends_while_its_closure_is_undone_stays_closed():
    """A cancel racing the reopen: the job is read still running, then it ends (its end
    written, then its close: a no-op on the rendezvous already closed by the late closer)
    before the reopen's write lands. The end stands: the rendezvous is closed again, the
    watch says CLOSED and the next join is refused, instead of the nodes of a cancelled
    job re-forming (and waiting out join_timeout for the peers that saw the end)."""
    store = MemoryStore()
    s = Settings(min_nodes=2, max_nodes=2)
    ended = False
    (canceller, _) = await node(store, "canceller", s)  # the cancel route's rendezvous

    async def job_still_runs() -> bool:
        return not ended

    async def read_then_cancelled() -> bool:
        nonlocal ended
        active = not ended  # read: still RUNNING
        if active:  # the cancel lands right after the read: CANCELLED written, then closed
            ended = True
            await canceller.close()
        return active

    async with asyncio.timeout(10):
        a, b, _, watching = await _closed_while_running(
            store, s, read_then_cancelled, job_still_runs
        )
        assert await watching is Change.CLOSED
        assert (await _state(store)).closed
        for rdzv in (a, b):
            with pytest.raises(RendezvousClosed):
                await rdzv.next_round()


@pytest.mark.parametrize("active", [False, None], ids=["the job ended", "no check"])
async def test_a_closure_of_an_ended_job_stands(active):
    """After a close, with the job ended (its end is written before the close) or no
    check given (a torchrun launcher's rendezvous): wait_for_change says CLOSED, and
    next_round raises RendezvousClosed."""

    async def still_active() -> bool:
        return False

    store = MemoryStore()
    s = Settings(min_nodes=1, max_nodes=1)
    (a, _) = await node(store, "a", s, still_active=None if active is None else still_active)
    async with asyncio.timeout(10):
        r = await a.next_round()
        await a.close()
        assert await a.wait_for_change(r.round) is Change.CLOSED
        with pytest.raises(RendezvousClosed):
            await a.next_round()


async def test_closures_made_over_and_over_are_undone_a_bounded_number_of_times():
    """A writer of the store who closes the rendezvous again and again gets the job's agent
    here stopped (CLOSED, as any closure), not a loop of re-formations."""

    async def still_active() -> bool:
        return True

    store = MemoryStore()
    s = Settings(min_nodes=1, max_nodes=1)
    (a, _) = await node(store, "a", s, still_active=still_active)
    (closer, _) = await node(store, "closer", s)
    async with asyncio.timeout(10):
        for _ in range(MAX_REOPENS):
            await closer.close()
            await a.next_round()
        await closer.close()
        with pytest.raises(RendezvousClosed):
            await a.next_round()


class CountingStore:
    """A store with a round trip of latency that counts the listings of each prefix."""

    def __init__(self, inner: MemoryStore, latency: float = 0.002) -> None:
        self.inner = inner
        self.latency = latency
        self.lists: Counter[str] = Counter()
        self.watches = 0
        self.read_bytes = 0  # keys and values that list and get answered

    async def list(self, prefix: str):
        self.lists[prefix] += 1
        await asyncio.sleep(self.latency)  # the network: other nodes run meanwhile
        listing = await self.inner.list(prefix)
        self.read_bytes += sum(len(e.key) + len(e.value) for e in listing.entries)
        return listing

    async def get(self, key: str):
        await asyncio.sleep(self.latency)
        entry = await self.inner.get(key)
        self.read_bytes += 0 if entry is None else len(entry.key) + len(entry.value)
        return entry

    async def watch(self, *args, **kwargs):
        self.watches += 1
        return await self.inner.watch(*args, **kwargs)

    def __getattr__(self, name: str):
        attr = getattr(self.inner, name)
        if name not in ("compare_and_set", "put", "put_batch", "delete"):
            return attr

        async def after_a_round_trip(*args, **kwargs):
            await asyncio.sleep(self.latency)
            return await attr(*args, **kwargs)

        return after_a_round_trip


async def test_of_many_nodes_arriving_together_few_list_the_presence_keys():
    """Only the node holding the absorber role lists and places; the rest read one key."""
    store = CountingStore(MemoryStore())
    n = 60
    s = Settings(min_nodes=n, max_nodes=n)
    nodes = [(await node(store, f"n{i:03}", s))[0] for i in range(n)]
    async with asyncio.timeout(20):
        rounds = await asyncio.gather(*(r.next_round() for r in nodes))
    assert sorted(r.group_rank for r in rounds) == list(range(n))
    assert len({(r.master_addr, r.master_port) for r in rounds}) == 1
    membership = membership_prefix("job")
    assert store.lists[membership] <= 10, store.lists  # not one (or more) per node: 120


async def absorber_held_by(store: MemoryStore, until: float, lease: int) -> None:
    hold = json.dumps({"node": "ghost", "until": until}).encode()
    result = await store.compare_and_set(absorber_key("job"), hold, None, lease=lease)
    assert result.ok


async def test_a_stuck_absorber_is_displaced_when_its_hold_runs_out():
    """A live node that never let go (a lost release) stalls nobody past its hold."""
    store = MemoryStore()
    s = Settings(min_nodes=2, max_nodes=2)
    ghost_lease = await store.grant(300)
    await absorber_held_by(store, time.time() + 0.5, ghost_lease)
    (a, _), (b, _) = await node(store, "a", s), await node(store, "b", s)
    started = time.monotonic()
    async with asyncio.timeout(10):
        ra, rb = await asyncio.gather(a.next_round(), b.next_round())
    assert {ra.group_rank, rb.group_rank} == {0, 1}
    assert time.monotonic() - started >= 0.3  # they did wait for the hold first


async def test_a_dead_absorber_frees_the_role_with_its_lease():
    """The role is bound to the holder's lease: its expiry wakes the waiters at once."""
    store = MemoryStore()
    s = Settings(min_nodes=2, max_nodes=2)
    ghost_lease = await store.grant(300)
    await absorber_held_by(store, time.time() + 3600, ghost_lease)
    (a, _), (b, _) = await node(store, "a", s), await node(store, "b", s)
    async with asyncio.timeout(10):
        joining = asyncio.gather(a.next_round(), b.next_round())
        await asyncio.sleep(0.2)
        assert not joining.done()  # waiting for the holder
        await store.revoke(ghost_lease)
        ra, rb = await joining
    assert {ra.group_rank, rb.group_rank} == {0, 1}


async def test_a_re_rendezvous_of_many_nodes_costs_each_a_constant_number_of_requests():
    """One node fails: it opens the next round for all in one write; the others notice the
    new round from their watch's events (no listing), and the absorber places them."""
    store = CountingStore(MemoryStore())
    n = 40
    s = Settings(min_nodes=n, max_nodes=n)
    nodes = [(await node(store, f"n{i:03}", s))[0] for i in range(n)]
    async with asyncio.timeout(30):
        first = await asyncio.gather(*(r.next_round() for r in nodes))
        store.lists.clear()
        watching = [asyncio.create_task(r.wait_for_change(0)) for r in nodes[1:]]
        while store.watches < n - 1:  # every survivor watches (sentinels read first)
            await asyncio.sleep(0.005)
        store.lists.clear()
        writes_before = store.inner.revision

        async def survivor(i: int):
            assert await watching[i - 1] is Change.NEW_ROUND
            return await nodes[i].next_round()

        second = await asyncio.gather(nodes[0].next_round(), *(survivor(i) for i in range(1, n)))
    assert {r.round for r in second} == {1} and first[0].round == 0
    assert sorted(r.group_rank for r in second) == list(range(n))
    assert store.lists[membership_prefix("job")] <= 10, (
        store.lists
    )  # before: one per node and event
    # Writes: one dissolve, n announcements, the absorber's placements and role changes.
    assert store.inner.revision - writes_before <= 2 * n + 10


@pytest.mark.parametrize("absorber_from", [1, 16], ids=["absorber", "each-places-itself"])
async def test_survivors_reform_at_once_without_waiting_out_the_last_call(absorber_from):
    """After a loss the live set is known: the round completes when the last survivor joins,
    not at the end of the last call (30 s here, longer than the test may take)."""
    store = MemoryStore()
    s = Settings(min_nodes=2, max_nodes=3, last_call_timeout=30)
    made = [await node(store, n, s, absorber_from=absorber_from) for n in "abc"]
    (a, _), (b, _), (_, lease_c) = made
    async with asyncio.timeout(40):
        first = await asyncio.gather(*(r.next_round() for r, _ in made))
    assert {r.group_world_size for r in first} == {3}
    async with asyncio.timeout(5):
        watching = [asyncio.create_task(r.wait_for_change(0)) for r in (a, b)]
        await store.revoke(lease_c)
        assert {await w for w in watching} == {Change.LOSS}
        ra, rb = await asyncio.gather(a.next_round(), b.next_round())
    assert ra.group_world_size == rb.group_world_size == 2 and ra.round == rb.round == 1


@pytest.mark.parametrize("n", [70, 210])  # above ROSTER_INLINE: seats carry no roster
async def test_in_a_large_job_a_node_reads_its_own_seat_not_the_document(n):
    """Joining costs each node O(1) bytes whatever N is: the head, the absorber role and its
    own seat; only the node that places everybody (and completes the round) reads O(N)."""
    store = MemoryStore()
    s = Settings(min_nodes=n, max_nodes=n)
    proxies = [CountingStore(store, latency=0.0005) for _ in range(n)]
    nodes = []
    for i, proxy in enumerate(proxies):
        rdzv, _ = await node(store, f"n{i:03}", s, absorber_from=16)
        rdzv._store = proxy  # this node's own view of the store, counted
        nodes.append(rdzv)
    async with asyncio.timeout(30):
        rounds = await asyncio.gather(*(r.next_round() for r in nodes))
    assert sorted(r.group_rank for r in rounds) == list(range(n))
    assert all(r.seat is not None and r.nodes == [] for r in rounds)
    document = await store.get("rdzv/job/m/state")
    assert document is not None and len(document.value) > 40 * n
    readers = sorted(p.read_bytes for p in proxies)
    assert readers[-2] < 800, readers  # all but the absorber: a few hundred bytes each
    assert sum(1 for p in proxies if p.lists[membership_prefix("job")]) <= 1
    # The agent reads the round's participants once (exit barrier, failure accounting).
    named = await nodes[-1].roster(rounds[-1])
    assert named.participants == {f"n{i:03}": i for i in range(n)}


async def test_a_one_node_job_knows_its_next_round_before_the_store_forms_it():
    """``solo_round`` is exactly what ``next_round`` (given its port) then forms, round after
    round; None where another node could join or the round is not this node's alone."""
    store = MemoryStore()
    a, _ = await node(store, "a", Settings(min_nodes=1, max_nodes=1))
    async with asyncio.timeout(10):
        last = await a.next_round()
        for _ in range(3):
            guess = a.solo_round(last)
            if last.seat is not None:  # large jobs' way: ranks come from the seat, never guessed
                assert guess is None
                break
            assert guess is not None
            assert guess.round == last.round + 1
            last = await a.next_round(port=guess.master_port)
            assert last == guess
        other = type(last)(**{**last.__dict__, "participants": {"b": 0}})
        assert a.solo_round(other) is None
        b, _ = await node(MemoryStore(), "b", Settings(1, 2, last_call_timeout=0.05))
        alone = await b.next_round()
        assert alone.group_world_size == 1
        assert b.solo_round(alone) is None  # a second node may join its next round


async def test_the_absorber_renews_its_hold_only_when_it_is_due(monkeypatch):
    """The keeper renews ABSORBER_RENEW before the hold runs out, not sooner.

    Every renewal wakes every node waiting on the head, so it must not come
    earlier than it has to.
    """
    from elasticd.rendezvous import signals

    monkeypatch.setattr(signals, "ABSORBER_HOLD", 2.0)
    monkeypatch.setattr(signals, "ABSORBER_RENEW", 0.5)  # due 1.5 s after the take
    store = MemoryStore()
    rdzv, _ = await node(store, "a", Settings(min_nodes=16, max_nodes=16))
    key = absorber_key("job")
    async with asyncio.timeout(10):
        taken = await rdzv._absorber.hold(None)
        assert taken.ok and taken.entry is not None
        await asyncio.sleep(1.0)
        assert (await store.get(key)).version == taken.entry.version  # not yet due
        await asyncio.sleep(1.2)
        renewed = await store.get(key)
        assert renewed is not None and renewed.version > taken.entry.version
        assert json.loads(renewed.value)["node"] == "a"
        await rdzv._absorber.release()
    assert await store.get(key) is None


def test_a_round_of_ten_thousand_nodes_needs_no_renewal_of_the_hold():
    """Rounds of 10,000 nodes take under 10 s: no renewal wakes the crowd during one.

    And a renewal that queues behind the crowd's requests still has 20 s to
    land before a waiter may displace the hold (a whole hold past its end).
    """
    from elasticd.rendezvous import signals

    assert signals.ABSORBER_HOLD - signals.ABSORBER_RENEW >= 10.0
    assert signals.ABSORBER_RENEW + signals.ABSORBER_HOLD >= 20.0


class _Gated:
    """A node's store whose chosen calls wait until the test lets them through."""

    def __init__(self, store: MemoryStore) -> None:
        self._store = store
        self.hold_puts = asyncio.Event()
        self.hold_puts.set()
        self.put_waiting = asyncio.Event()
        self.slow_after_complete = False
        self.hold_next_list = False
        self.list_waiting = asyncio.Event()
        self.release_list = asyncio.Event()

    def __getattr__(self, name: str):
        return getattr(self._store, name)

    async def put(self, key, value, *, lease=None):
        if "/m/node/" in key and not self.hold_puts.is_set():
            self.put_waiting.set()
            await self.hold_puts.wait()
        return await self._store.put(key, value, lease=lease)

    async def compare_and_set(self, key, value, expected_version, *, lease=None):
        result = await self._store.compare_and_set(key, value, expected_version, lease=lease)
        written = result.ok and key == state_key("job")
        if self.slow_after_complete and written and json.loads(value)["complete"]:
            self.slow_after_complete = False
            self.hold_next_list = True  # the writer's next read is slow
        return result

    async def list(self, prefix):
        if self.hold_next_list and prefix.endswith("/m/"):
            self.hold_next_list = False
            self.list_waiting.set()
            await self.release_list.wait()
        return await self._store.list(prefix)


async def _gated_node(store: MemoryStore, name: str, settings: Settings, ttl: float = 30.0):
    gated = _Gated(store)
    lease = await store.grant(ttl)

    async def current_lease() -> int:
        return lease

    rdzv = StoreRendezvous(
        gated,  # type: ignore[arg-type]
        "job",
        node=name,
        role="default",
        local_world_size=1,
        advertise_addr="127.0.0.1",
        settings=settings,
        lease=current_lease,
        absorber_from=100,
        seats_from=100,
    )
    return rdzv, gated, lease


async def test_a_complete_round_that_loses_a_participant_re_forms_and_never_shrinks():
    """Issue 33's D1 on the real handler: n1 completes round 0 as {n1, n2} and its next read
    is slow; n2 was killed -9 and its lease expires meanwhile. n1 must not run round 0 with
    world size 1 (below min_nodes) or any rank missing: the round re-forms, and n1 runs
    round 1 with the next node to come, with ranks 0..1. (Before the fix, n1's next
    decision wrote the complete round {n1: 0} in place and n1 ran it alone.)"""
    store = MemoryStore()
    s = Settings(min_nodes=2, max_nodes=3, last_call_timeout=0.2)
    n1, gate1, _ = await _gated_node(store, "n1", s)
    n2, _, lease2 = await _gated_node(store, "n2", s)
    gate1.slow_after_complete = True
    async with asyncio.timeout(20):
        first = asyncio.create_task(n1.next_round())
        killed = asyncio.create_task(n2.next_round())
        await gate1.list_waiting.wait()  # n1 wrote round 0 complete; its next read waits
        state = await _state(store)
        assert state.complete and sorted(state.participants) == ["n1", "n2"]
        killed.cancel()  # n2 is killed -9: its agent is gone, its lease lives on
        with contextlib.suppress(asyncio.CancelledError):
            await killed
        await store.expire(lease2)  # ... until it expires
        gate1.release_list.set()
        # n1 must not finish round 0 alone; it waits for a second node to re-form with.
        await asyncio.wait({first}, timeout=1.0)
        if first.done():
            alone = first.result()
            assert alone.group_world_size >= s.min_nodes, f"n1 ran {alone} alone"
        n3, _, _ = await _gated_node(store, "n3", s)
        third = asyncio.create_task(n3.next_round())
        r1, r3 = await asyncio.gather(first, third)
    assert r1.round == r3.round == 1
    assert r1.group_world_size == r3.group_world_size == 2
    assert r1.participants == {"n1": 0, "n3": 1}


async def test_an_arrival_announced_for_round_0_is_seen_by_the_running_nodes():
    """Issue 33's D2 on the real handler: b reads the document while round 0 is open and
    announces just after a completes it. a, running round 0, must see the arrival, and
    both form round 1. (Before the fix an announcement for round 0 read as none: a ran on
    alone, and b waited until its join timed out, failing the job.)"""
    store = MemoryStore()
    s = Settings(min_nodes=1, max_nodes=2, join_timeout=5.0, last_call_timeout=0.5)
    a, _, _ = await _gated_node(store, "a", s)
    b, gate_b, _ = await _gated_node(store, "b", s)
    async with asyncio.timeout(20):
        first = asyncio.create_task(a.next_round())
        while "a" not in (await _state_or_none(store)).participants:
            await asyncio.sleep(0.01)
        gate_b.hold_puts.clear()
        arrival = asyncio.create_task(b.next_round())
        await gate_b.put_waiting.wait()  # b read round 0 open; its announcement waits
        ra = await first
        assert ra.round == 0
        gate_b.hold_puts.set()  # ... and lands once round 0 is complete
        watch = asyncio.create_task(a.wait_for_change(ra.round))
        change = await asyncio.wait_for(asyncio.shield(watch), 3.0)
        assert change is Change.ARRIVAL
        again = await asyncio.gather(a.next_round(), arrival)
    assert again[0].round == again[1].round == 1
    assert again[0].participants == {"a": 0, "b": 1}


async def _state_or_none(store: MemoryStore) -> State:
    entry = await store.get(state_key("job"))
    return State() if entry is None else decode_state(entry.value, entry.version)
