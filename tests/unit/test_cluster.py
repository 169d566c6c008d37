"""The node's membership (elasticd/node/cluster.py): the lease renewal the re-exec makes."""

from __future__ import annotations

import asyncio

import pytest

from elasticd.errors import LeaseNotFound
from elasticd.node.cluster import Cluster, NodeRecord
from elasticd.store import Entry
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


class _SlowFirstPublish(MemoryStore):
    """A store whose put of the first published record is held until the second publish
    has begun (and, with nothing to stop it, put its own record): two requests in flight
    over HTTP may land in either order."""

    def __init__(self) -> None:
        super().__init__()
        self.puts = 0
        self.cluster: Cluster | None = None

    async def put(self, key: str, value: bytes, *, lease: int | None = None) -> Entry:
        self.puts += 1
        if self.puts == 2:  # the first is the registration; the second the first publish
            assert self.cluster is not None
            while self.cluster.record.free_slots != 0:
                await asyncio.sleep(0)
            for _ in range(20):  # the second's put, if nothing holds it, lands meanwhile
                await asyncio.sleep(0)
        return await super().put(key, value, lease=lease)


async def test_concurrent_publishes_leave_the_newest_record_in_the_store() -> None:
    """Two publishes of the free slots, the first one's put slow: the store ends with the
    second's record, never the first's landing last (the scheduler would place on slots
    this node no longer has)."""
    async with asyncio.timeout(10):
        store, clock = _SlowFirstPublish(), FakeClock()
        cluster = store.cluster = a_cluster(store, clock)
        await cluster.lease()
        first = asyncio.create_task(cluster.publish(free_slots=1))
        await asyncio.sleep(0)  # its put is in flight
        second = asyncio.create_task(cluster.publish(free_slots=0))
        await asyncio.gather(first, second)
        entry = await store.get(cluster.key)
        assert entry is not None
        assert NodeRecord.model_validate_json(entry.value).free_slots == 0
        assert store.puts == 3
        await store.close()
