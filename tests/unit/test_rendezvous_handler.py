"""The rendezvous executor over a real in-memory store: rounds, re-formation, loss, closing."""

from __future__ import annotations

import asyncio

import pytest

from elasticd.errors import RendezvousClosed
from elasticd.rendezvous import Change, Settings, StoreRendezvous
from elasticd.testing import MemoryStore


async def node(store: MemoryStore, name: str, settings: Settings, ttl: float = 30.0):
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
    assert [n.local_world_size for n in ra.nodes] == [2, 2]


async def test_failed_node_rejoins_and_the_other_reforms_without_livelock():
    """A node re-joining while its peer still runs puts the peer on notice; both form round 1."""
    store = MemoryStore()
    s = Settings(min_nodes=2, max_nodes=2)
    (a, _), (b, _) = await node(store, "a", s), await node(store, "b", s)
    async with asyncio.timeout(10):
        first = await asyncio.gather(a.next_round(), b.next_round())
        rejoin = asyncio.create_task(a.next_round())  # a's worker failed: leave and rejoin
        assert await b.wait_for_change(first[1].round) is Change.ARRIVAL
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


async def test_closed_rendezvous_refuses_the_next_round():
    """After close, wait_for_change says CLOSED and next_round raises RendezvousClosed."""
    store = MemoryStore()
    s = Settings(min_nodes=1, max_nodes=1)
    (a, _) = await node(store, "a", s)
    async with asyncio.timeout(10):
        r = await a.next_round()
        await a.close()
        assert await a.wait_for_change(r.round) is Change.CLOSED
        with pytest.raises(RendezvousClosed):
            await a.next_round()
