"""A job token's scoped store keeps its prefix within its share (issue 35, finding 3): keys
and bytes, counted across requests by one ledger, refused with the setting's name."""

from __future__ import annotations

import asyncio

import pytest

from elasticd.errors import OverShare, OverShareBytes
from elasticd.store.memory import MemoryStore
from elasticd.store.scoped import PrefixLedger, PrefixShare, ScopedStore

SHARE = PrefixShare(max_keys=3, max_bytes=124)  # keys of 8 bytes count too


async def test_the_prefix_share_holds_across_requests_and_every_write_kind() -> None:
    async with asyncio.timeout(10):
        store = MemoryStore()
        ledger = PrefixLedger(refresh=3600)

        def scoped() -> ScopedStore:  # one per request, as the API makes them
            return ScopedStore(store, "jobs/j/", share=SHARE, ledger=ledger)

        await scoped().put("jobs/j/a", b"x" * 40)
        await scoped().put("jobs/j/a", b"x" * 50)  # an overwrite counts its new size only
        with pytest.raises(OverShareBytes, match="job_store_max_bytes"):
            await scoped().put("jobs/j/b", b"x" * 59)  # 58 + 8 + 59 > 124
        assert await store.get("jobs/j/b") is None
        assert (await scoped().compare_and_set("jobs/j/b", b"x" * 30, None)).ok
        lost = await scoped().compare_and_set("jobs/j/b", b"y", None)  # lost: nothing counted
        assert not lost.ok
        assert await scoped().add("jobs/j/n") == 1  # the third key
        with pytest.raises(OverShare, match="job_store_max_keys"):
            await scoped().put("jobs/j/c", b"")
        with pytest.raises(OverShare):
            await scoped().put_batch([("jobs/j/a", b"1"), ("jobs/j/d", b"2")])
        assert (await store.get("jobs/j/a")).value == b"x" * 50  # type: ignore[union-attr]
        assert await scoped().delete("jobs/j/b")
        await scoped().put("jobs/j/c", b"x" * 30)  # room again


async def test_concurrent_writes_cannot_all_pass_one_check() -> None:
    async with asyncio.timeout(10):
        store = MemoryStore()
        ledger = PrefixLedger()
        writes = [
            ScopedStore(store, "jobs/j/", share=SHARE, ledger=ledger).put(f"jobs/j/{i}", b"x" * 40)
            for i in range(3)
        ]
        results = await asyncio.gather(*writes, return_exceptions=True)
        assert sum(isinstance(r, OverShareBytes) for r in results) == 1, results
        listing = await store.list("jobs/j/")
        assert sum(len(e.value) for e in listing.entries) == 80


async def test_key_names_count_in_the_bytes_of_a_share() -> None:
    """A prefix filled with long key names and empty values is refused like one of large
    values (was: names uncounted, a share of 1 KiB held 64 KiB of 4 KiB names)."""
    async with asyncio.timeout(10):
        store = MemoryStore()
        share = PrefixShare(max_keys=1000, max_bytes=1024)
        scoped = ScopedStore(store, "jobs/j/", share=share, ledger=PrefixLedger(refresh=3600))
        await scoped.put("jobs/j/" + "k" * 500, b"")
        with pytest.raises(OverShareBytes, match="job_store_max_bytes"):
            await scoped.put("jobs/j/" + "l" * 600, b"")
