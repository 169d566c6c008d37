"""The watch history keeps what watchers need (issue 23 item 7), not a blanket 100,000 changes."""

from __future__ import annotations

import asyncio

import pytest

from elasticd.errors import StoreCompacted
from elasticd.store.memory import MemoryStore, RecentRevisions, history_floor

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(
    ("revision", "parked", "recent", "margin", "floor"),
    [
        (5000, None, None, 1000, 4000),  # nobody watches: the margin only
        (5000, 4500, None, 1000, 3500),  # a parked watch pins its revision
        (5000, None, 4200, 1000, 3200),  # a recent listing pins its revision
        (5000, 4500, 4200, 1000, 3200),  # the lowest of them wins
        (5000, 4500, 4200, 0, 4200),  # no margin
        (500, None, None, 1000, 0),  # never below zero: keep everything
    ],
)
def test_history_floor(
    revision: int, parked: int | None, recent: int | None, margin: int, floor: int
) -> None:
    """The floor is the lowest revision any watcher needs, less the margin."""
    assert history_floor(revision, parked, recent, margin) == floor


def test_recent_revisions_forget_what_is_past_the_window() -> None:
    """One bucket per second holds its lowest revision; buckets past the window go."""
    recent = RecentRevisions(keep=10.0)
    recent.note(0.0, 50)
    recent.note(0.5, 40)  # same bucket, lower
    recent.note(3.0, 90)
    assert recent.oldest(5.0) == 40
    assert recent.oldest(10.5) == 90  # the first bucket is past the window
    assert recent.oldest(14.0) is None


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_history_shrinks_to_what_watchers_need() -> None:
    """Without watchers the history is the margin; a recent listing keeps its changes; once
    the keep window passes it shrinks again, a parked watch pinning nothing (its change still
    reaches it); an old watch gets StoreCompacted."""
    clock = Clock()
    async with MemoryStore(history_keep=30.0, history_margin=10, clock=clock) as store:
        for i in range(200):
            await store.put(f"k/{i % 7}", b"x")
        assert store.history_size()[0] == 11  # the margin, and the change being made
        listing = await store.list("k/")
        parked = asyncio.create_task(store.watch("other", listing.revision, 20))
        await asyncio.sleep(0)
        clock.now = 5.0
        for _ in range(100):
            await store.put("k/0", b"y")
        assert store.history_size()[0] == 110  # from the listing's revision, less the margin
        events = await store.watch("k/", listing.revision, 0, prefix=True)
        assert len(events) == 100
        clock.now = 100.0  # the listing is old now, and a parked watch pins nothing
        await store.put("k/1", b"z")
        assert store.history_size()[0] == 11
        await store.put("other", b"!")
        assert [e.key for e in await parked] == ["other"]
        with pytest.raises(StoreCompacted):
            await store.watch("k/", listing.revision, 0, prefix=True)


async def test_a_parked_watch_pins_nothing_and_still_gets_its_change() -> None:
    """A watch parked long ago on a quiet key needs no history: changes of other keys are
    trimmed meanwhile, and its own change, when it comes, still reaches it."""
    clock = Clock()
    async with MemoryStore(history_keep=1.0, history_margin=0, clock=clock) as store:
        first = await store.put("quiet", b"0")
        watch = asyncio.create_task(store.watch("quiet", first.version, 20))
        await asyncio.sleep(0)
        clock.now = 50.0
        for _ in range(500):
            await store.put("busy", b"x")
        assert store.history_size()[0] <= 2
        await store.put("quiet", b"1")
        events = await watch
        assert [e.value for e in events] == [b"1"]
