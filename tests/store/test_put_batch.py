"""``put_batch`` on every backend: all or nothing, in order, one round trip (issue 12, defect 7).

The event log publishes a node's queued events as one batch, so that the
store creates them in the node's own order; these tests pin what it relies on.
"""

from __future__ import annotations

import uuid

import pytest

from elasticd.errors import ValueTooLarge
from elasticd.store.base import MAX_BATCH_KEYS, Store

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def ns() -> str:
    """A key prefix no other test uses."""
    return f"/test/{uuid.uuid4().hex[:12]}/"


async def test_a_batch_is_written_in_order_and_read_back(store: Store, ns: str) -> None:
    """Every key is written; revisions never go down in the order given; a rewrite keeps created."""
    before = await store.put(ns + "before", b"x")
    items = [(f"{ns}k{i:03d}", f"v{i}".encode()) for i in range(MAX_BATCH_KEYS)]
    entries = await store.put_batch(items)
    assert [(e.key, e.value) for e in entries] == items
    created = [e.created for e in entries]
    assert created == sorted(created) and created[0] > before.version
    assert all(e.version == e.created and e.lease is None for e in entries)
    listing = await store.list(ns + "k")
    assert [(e.key, e.value, e.created) for e in listing.entries] == [
        (k, v, c) for (k, v), c in zip(items, created, strict=True)
    ]
    again = await store.put_batch([(items[0][0], b"new"), (ns + "fresh", b"f")])
    assert again[0].created == created[0] and again[0].version > created[-1]
    assert again[1].created == again[1].version >= again[0].version
    assert await store.put_batch([]) == []


async def test_a_batch_that_cannot_be_applied_writes_nothing(store: Store, ns: str) -> None:
    """A key twice, too many keys, or a value over the limit: refused, and no key written."""
    with pytest.raises(ValueError, match="twice"):
        await store.put_batch([(ns + "a", b"1"), (ns + "a", b"2")])
    too_many = [(f"{ns}m{i}", b"") for i in range(MAX_BATCH_KEYS + 1)]
    with pytest.raises(ValueError, match="at most"):
        await store.put_batch(too_many)
    huge = b"x" * (getattr(store, "max_value_bytes", 1 << 20) + 1)
    with pytest.raises(ValueTooLarge):
        await store.put_batch([(ns + "b", b"1"), (ns + "c", huge)])
    assert (await store.list(ns)).entries == []


async def test_a_batch_wakes_a_watch_with_every_key(store: Store, ns: str) -> None:
    """A prefix watch sees every key of a batch, in the order given."""
    start = await store.put(ns + "start", b"")
    items = [(f"{ns}w{i}", b"v") for i in range(5)]
    await store.put_batch(items)
    seen: list[str] = []
    after = start.version
    while len(seen) < len(items):
        events = await store.watch(ns + "w", after, 10.0, prefix=True)
        assert events, "the watch timed out"
        seen += [e.key for e in events]
        after = max(e.revision for e in events)
    assert seen == [k for k, _ in items]
