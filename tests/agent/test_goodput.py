"""The agent's goodput hook (elasticd.agent.goodput): its pure parts."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from elasticd import goodput
from elasticd.agent.goodput import GoodputHook, end_of, parse_record, read_records
from elasticd.clock import FakeClock
from elasticd.goodput import MAX_ATTEMPTS, AttemptFacts, End, NodeGoodput
from elasticd.keys import goodput_key, goodput_page_key, goodput_prefix
from elasticd.models import tagged_for
from elasticd.store import Entry
from elasticd.store.memory import MemoryStore


@pytest.mark.parametrize(
    ("cause", "end"),
    [
        ("worker failure", End.FAILED),
        ("hang", End.HUNG),
        ("a participant's lease expired", End.FAILED),
        ("the rendezvous was closed", End.FINISHED),
        ("a node is waiting to join", End.STOPPED),
        ("the other nodes moved to a new round", End.STOPPED),
    ],
)
def test_recovery_causes_end_attempts(cause: str, end: End) -> None:
    """The agent's recovery causes (machine's and the rendezvous' own words) map to ends."""
    assert end_of(cause) is end


def test_a_stored_record_is_untrusted() -> None:
    """Garbage, another node's record, or one past its bounds is not taken."""
    good = NodeGoodput(node="n", attempts=[AttemptFacts(round=0, spawned_at=1)])
    assert parse_record(good.model_dump_json().encode(), "n") == good
    assert parse_record(good.model_dump_json().encode(), "m") is None
    assert parse_record(b"\x00not json", "n") is None
    huge = {"node": "n", "attempts": [{"round": 0, "spawned_at": 1}] * (MAX_ATTEMPTS + 1)}
    assert parse_record(json.dumps(huge).encode(), "n") is None


OLD, NEW = "a" * 32, "b" * 32


@pytest.mark.parametrize(
    ("recorded", "asked", "taken"),
    [
        (NEW, NEW, True),  # this job's
        (OLD, NEW, False),  # a deleted job's of the id, published late by its agent
        (None, NEW, True),  # an older daemon's: nothing says whose, kept
        (OLD, None, True),  # asked about every job of the id
    ],
)
def test_a_record_of_another_job_of_the_id_is_not_taken(
    recorded: str | None, asked: str | None, taken: bool
) -> None:
    record = NodeGoodput(node="n", attempts=[AttemptFacts(round=0, spawned_at=1)], job_tag=recorded)
    assert (parse_record(record.model_dump_json().encode(), "n", asked) == record) is taken
    assert tagged_for(recorded, asked) is taken


def _ended(round_: int, t: float = 0.0, end: End = End.FAILED) -> AttemptFacts:
    return AttemptFacts(round=round_, spawned_at=t, end=end, ended_at=t + 0.5)


def test_a_record_seals_its_oldest_page_once_it_holds_two() -> None:
    """Issue 34: the rewritten record holds its newest attempts only; its oldest page of
    ended attempts moves to a page written once."""
    short = NodeGoodput(
        node="n", attempts=[_ended(r) for r in range(2 * goodput.PAGE_ATTEMPTS - 1)]
    )
    assert goodput.seal(short) == (short, None)
    opened = [*[_ended(r) for r in range(2 * goodput.PAGE_ATTEMPTS)]]
    opened[3] = AttemptFacts(round=3, spawned_at=0)  # an attempt still open stays
    assert goodput.seal(NodeGoodput(node="n", attempts=opened))[1] is None
    full = NodeGoodput(node="n", job_tag=NEW, attempts=[_ended(r) for r in range(40)], pages=5)
    rest, page = goodput.seal(full)
    assert page is not None and page.page == 5 and page.job_tag == NEW
    assert [a.round for a in page.attempts] == list(range(goodput.PAGE_ATTEMPTS))
    assert rest.pages == 6 and [a.round for a in rest.attempts] == list(
        range(goodput.PAGE_ATTEMPTS, 40)
    )
    assert goodput.join_pages(rest, [page]) == full.model_copy(update={"pages": 6})


def test_pages_join_in_front_counting_a_round_once() -> None:
    """A page written before the record that gave up its attempts (a daemon stopped
    between the two writes) is counted once; pages outside the window, another node's
    and another job's are not taken."""
    record = NodeGoodput(
        node="n", attempts=[_ended(r, t=1.0) for r in (20, 21)], pages=goodput.MAX_PAGES + 2
    )
    kept = NodeGoodput(node="n", attempts=[_ended(19), _ended(20)], page=goodput.MAX_PAGES + 1)
    too_old = NodeGoodput(node="n", attempts=[_ended(1)], page=1)
    other_node = NodeGoodput(node="m", attempts=[_ended(18)], page=goodput.MAX_PAGES)
    other_job = NodeGoodput(node="n", attempts=[_ended(17)], page=goodput.MAX_PAGES, job_tag=OLD)
    joined = goodput.join_pages(record, [too_old, other_node, other_job, kept])
    assert [(a.round, a.spawned_at) for a in joined.attempts] == [(19, 0.0), (20, 1.0), (21, 1.0)]


class _Sizes(MemoryStore):
    """A store that notes the size of every value put, per key."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: dict[str, list[int]] = {}

    async def put(self, key: str, value: bytes, *args: Any, **kwargs: Any) -> Entry:
        self.sizes.setdefault(key, []).append(len(value))
        return await super().put(key, value, *args, **kwargs)


async def test_a_crash_loop_rewrites_a_bounded_record_and_keeps_every_attempt() -> None:
    """Issue 34: 300 attempts on one node. Every write of the record is bounded (it was
    the whole history: 62 KB at 256 attempts, copied into the store's watch history at
    every attempt); the pages kept are bounded; a reader of the store, and a restarted
    daemon's hook, see the same attempts as the node that wrote them."""
    store, clock = _Sizes(), FakeClock()
    hook = GoodputHook(store, "j", "n", clock, lambda _clock: [], tag=NEW)
    async with asyncio.timeout(60):
        await hook.start()
        for round_ in range(300):
            await hook.began(round_, clock.time())
            clock.advance(1.0)
            await hook.ended(End.FAILED, clock.time())
            await asyncio.sleep(0)  # the publisher writes
        await hook.close()
        listing = await store.list(goodput_prefix("j"))
        pages = [e for e in listing.entries if e.key.startswith(goodput_page_key("j", "n"))]
        assert len(pages) <= goodput.MAX_PAGES + 1  # the one past the window goes at the next seal
        written = store.sizes[goodput_key("j", "n")]
        assert len(written) > 100 and max(written) < (2 * goodput.PAGE_ATTEMPTS + 1) * 120, max(
            written
        )
        mine = hook.record
        assert len(mine.attempts) >= MAX_ATTEMPTS - 2 * goodput.PAGE_ATTEMPTS
        assert mine.attempts[-1].round == 299
        assert read_records(listing.entries, goodput_prefix("j"), NEW) == {"n": mine}
        again = GoodputHook(store, "j", "n", clock, lambda _clock: [], tag=NEW)
        await again.start()
        assert again.record == mine
        await again.close()
