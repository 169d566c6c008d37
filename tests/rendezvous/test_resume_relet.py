"""A resumed node (the daemon's re-exec) is not taken for one whose lease was granted anew."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from elasticd.rendezvous import Settings, StoreRendezvous
from elasticd.rendezvous import handler as handler_mod
from elasticd.rendezvous import signals as signals_mod
from elasticd.testing import MemoryStore


class CountingStore:
    """The store, counting its watches."""

    def __init__(self, inner: MemoryStore) -> None:
        self._inner = inner
        self.watches = 0

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    async def watch(self, *args, **kwargs):
        self.watches += 1
        return await self._inner.watch(*args, **kwargs)


def rendezvous(store, name: str, settings: Settings, lease: int) -> StoreRendezvous:
    async def current_lease() -> int:
        return lease

    return StoreRendezvous(
        store, "job", node=name, role="default", local_world_size=1,
        advertise_addr="127.0.0.1", settings=settings, lease=current_lease,
        absorber_from=1, seats_from=1, absorber_overdue=0.5,
    )  # fmt: skip


async def test_a_resumed_non_sentinel_watches_the_head_without_a_watch_per_lease_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After resume() the node's announcement is bound to the lease it kept: its watch of
    the head is not cut every LEASE_CHECK (was: one watch request a second per node, for
    the whole round, after every re-exec)."""
    monkeypatch.setattr(signals_mod, "LEASE_CHECK", 0.02)
    store = MemoryStore()
    n = 4  # group rank 3 is past the SENTINELS: it follows the head
    s = Settings(min_nodes=n, max_nodes=n)
    leases = [await store.grant(30.0) for _ in range(n)]
    nodes = [rendezvous(store, f"n{i}", s, leases[i]) for i in range(n)]
    async with asyncio.timeout(20):
        rounds = await asyncio.gather(*(r.next_round() for r in nodes))
    last = max(range(n), key=lambda i: rounds[i].group_rank)
    assert rounds[last].group_rank >= handler_mod.SENTINELS
    counting = CountingStore(store)
    resumed = rendezvous(counting, f"n{last}", s, leases[last])
    await resumed.resume(rounds[last])
    assert not await resumed._relet()
    watch = asyncio.create_task(resumed.wait_for_change(rounds[last].round))
    await asyncio.sleep(0.5)  # 25 lease checks
    assert not watch.done()
    watch.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await watch
    assert counting.watches <= 2
