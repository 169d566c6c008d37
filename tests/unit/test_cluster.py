"""The node's membership (elasticd/node/cluster.py): the lease renewal the re-exec makes."""

from __future__ import annotations

import asyncio

import pytest

from elasticd.errors import LeaseNotFound
from elasticd.node.cluster import Cluster, NodeRecord
from elasticd.testing import FakeClock, MemoryStore


def a_cluster(store: MemoryStore, clock: FakeClock) -> Cluster:
    record = NodeRecord(
        name="n1",
        url="http://127.0.0.1:7070",
        addr="127.0.0.1",
        labels={},
        slots=1,
        free_slots=1,
        version="0",
        started_at=0.0,
    )
    return Cluster(store, record, on_jobs=lambda jobs: None, lease_ttl=3.0, clock=clock)


async def test_a_renewal_now_moves_renewed_at_and_without_a_lease_does_nothing() -> None:
    """The renewal right before a re-exec records when it was sent (the manifest hands it on:
    the next image fences its handed workers a TTL after it); a node not registered yet has
    nothing to renew; a lapsed lease says so."""
    async with asyncio.timeout(10):
        store, clock = MemoryStore(), FakeClock()
        cluster = a_cluster(store, clock)
        await cluster.renew()
        assert (cluster.lease_id, cluster.renewed_at) == (None, None)
        lease = await cluster.lease()
        assert cluster.renewed_at == 1_000.0
        clock.advance(2.0)
        await cluster.renew()
        assert cluster.renewed_at == 1_002.0
        await store.expire(lease)
        with pytest.raises(LeaseNotFound):
            await cluster.renew()
        assert cluster.renewed_at == 1_002.0
        await store.close()
