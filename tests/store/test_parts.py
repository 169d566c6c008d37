"""``list_in_parts``: a prefix over the store's list bound is read in parts, every entry once
(issue 35: one owner's documents under ``job/`` failed every scheduler pass)."""

from __future__ import annotations

import asyncio

import pytest

from elasticd.errors import ListingTooLarge
from elasticd.store.memory import MemoryStore
from elasticd.store.parts import list_in_parts

LIMIT = 64 * 1024


async def test_a_listing_over_the_bound_is_read_in_parts() -> None:
    async with asyncio.timeout(10):
        store = MemoryStore(max_list_bytes=LIMIT, max_value_bytes=LIMIT)
        keys = [f"job/{p}{i}" for p in ("a", "ab", "Z", "9", "a.") for i in range(4)]
        keys += ["job/", "job/a", "other/x"]
        for key in keys:
            await store.put(key, b"x" * 20_000)
        with pytest.raises(ListingTooLarge):
            await store.list("job/")
        listing = await list_in_parts(store, "job/")
        assert [e.key for e in listing.entries] == sorted(k for k in keys if k.startswith("job/"))
        assert listing.revision <= (await store.list("other/")).revision
        small = await list_in_parts(store, "other/")
        assert [e.key for e in small.entries] == ["other/x"]
