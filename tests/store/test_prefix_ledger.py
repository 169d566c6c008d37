"""The prefix ledger's listing (issue 35)."""

from __future__ import annotations

import asyncio

from elasticd.store.base import Listing
from elasticd.store.memory import MemoryStore
from elasticd.store.scoped import PrefixLedger, PrefixShare, ScopedStore

SHARE = PrefixShare(max_keys=1000, max_bytes=1 << 20)


class CountingStore(MemoryStore):
    lists = 0

    async def list(self, prefix: str) -> Listing:
        self.lists += 1
        await asyncio.sleep(0.05)  # a large prefix takes a while to read
        return await super().list(prefix)


async def test_concurrent_writes_read_the_prefix_once() -> None:
    """Each listing of a job's prefix may be store_max_list_bytes: 128 concurrent writes of
    one token (its connection share) must not read it 128 times at once (128 x 64 MiB)."""
    async with asyncio.timeout(10):
        store = CountingStore()
        ledger = PrefixLedger()
        writes = [
            ScopedStore(store, "jobs/j/", share=SHARE, ledger=ledger).put(f"jobs/j/{i}", b"x")
            for i in range(50)
        ]
        await asyncio.gather(*writes)
        assert store.lists == 1, f"{store.lists} listings of one prefix for one burst"
