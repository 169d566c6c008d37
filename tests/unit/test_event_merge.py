"""The merged event order, decided purely (issue 12, defect 7): tables, no store."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from elasticd.errors import JobConflict
from elasticd.models import Event
from elasticd.node.events import (
    PUBLISH_BATCH_BYTES,
    PUBLISH_BATCH_EVENTS,
    SEQ_STRIDE,
    merge_key,
    merged_seqs,
    of_job,
    publication_batches,
    published_key,
)


def ev(node: str, seq: int, message: str = "", job: str = "j") -> Event:
    return Event(
        seq=seq, time=0.0, job_id=job, node=node, source="agent", kind="k", message=message
    )


@pytest.mark.parametrize(
    ("created", "seqs"),
    [
        ([], []),
        ([5], [5 * SEQ_STRIDE]),
        ([5, 5, 5, 7], [5000, 5001, 5002, 7000]),
        ([3, 4, 4, 9, 9], [3000, 4000, 4001, 9000, 9001]),
    ],
)
def test_merged_seqs_are_unique_and_increasing(created: list[int], seqs: list[int]) -> None:
    """Events sharing a revision (one batch) are told apart by their place in it."""
    assert merged_seqs(created) == seqs


def test_one_batch_sorts_by_node_then_the_nodes_own_seq() -> None:
    """Within a revision: node, then local seq, whatever order the listing gave."""
    found = [(4, ev("b", 2)), (4, ev("a", 9)), (4, ev("b", 1)), (3, ev("c", 7))]
    found.sort(key=lambda pair: merge_key(*pair))
    assert [(e.node, e.seq) for _, e in found] == [("c", 7), ("a", 9), ("b", 1), ("b", 2)]


def test_publication_batches_keep_order_drop_repeats_and_bound_size() -> None:
    """Queued twice (emitted before start re-queued it) goes out once; batches are bounded."""
    queued = [ev("n", 2), ev("n", 1), ev("n", 2), *(ev("n", s) for s in range(3, 250))]
    batches = publication_batches(queued)
    flat = [e.seq for b in batches for e in b]
    assert flat == [2, 1, *range(3, 250)]
    assert all(len(b) <= PUBLISH_BATCH_EVENTS for b in batches)
    assert len({published_key(e) for e in batches[0]}) == len(batches[0])
    big = [ev("n", s, message="x" * 60_000) for s in range(1, 20)]
    for batch in publication_batches(big):
        assert sum(len(e.model_dump_json()) for e in batch) <= PUBLISH_BATCH_BYTES


@pytest.mark.timeout(10)
async def test_events_emitted_before_start_are_published_once_in_order(tmp_path) -> None:
    """Emitted before the publisher starts: each published once, the node's order kept."""
    from elasticd.eventkinds import EventKind
    from elasticd.node.db import Database
    from elasticd.node.events import EventLog
    from elasticd.store.memory import MemoryStore

    async with MemoryStore() as store, Database(tmp_path / "elasticd.sqlite3") as db:
        log = EventLog(db, "n0", store=store)
        for i in range(150):  # more than one publication batch
            log.emit("j", "daemon", EventKind.JOB_STATE, f"event {i}")
        await log.start()
        await log.flush()
        merged = await log.cluster_events("j")
        await log.stop()
    assert [e.message for e in merged] == [f"event {i}" for i in range(150)]
    assert [e.seq for e in merged] == sorted({e.seq for e in merged})


@pytest.mark.timeout(10)
async def test_events_of_some_kinds_are_those_of_the_full_merge(tmp_path) -> None:
    """``cluster_events_of`` (the goodput's cheap read) finds exactly the merged view's
    events of those kinds, also when another event's message names one of them."""
    from elasticd.eventkinds import EventKind
    from elasticd.goodput import FACT_KINDS
    from elasticd.node.db import Database
    from elasticd.node.events import EventLog
    from elasticd.store.memory import MemoryStore

    kinds = [EventKind.JOB_STATE, EventKind.JOB_PLACED, EventKind.WORKER_EXITED]
    async with MemoryStore() as store, Database(tmp_path / "elasticd.sqlite3") as db:
        log = EventLog(db, "n0", store=store)
        await log.start()
        for i in range(60):
            log.emit("j", "daemon", kinds[i % 3], f"event {i}")
        log.emit("j", "daemon", EventKind.JOB_STATE, '"job.preempted" (only a message)')
        log.emit("j", "daemon", EventKind.JOB_PREEMPTED, "preempted")
        log.emit("other", "daemon", EventKind.JOB_PLACED, "another job's")
        await log.flush()
        merged = await log.cluster_events("j")
        some = await log.cluster_events_of("j", FACT_KINDS)
        await log.stop()
    want = sorted(e.message for e in merged if e.kind in FACT_KINDS)
    assert len(want) == 21
    assert sorted(e.message for e in some) == want


A, B = "a" * 32, "b" * 32


@pytest.mark.parametrize(
    ("event_tag", "reader_tag", "shown"),
    [
        (A, A, True),  # the job asked about
        (B, A, False),  # another job of the id (deleted, the id taken again)
        (None, A, True),  # an older daemon's event: nothing says whose, kept
        (B, None, True),  # a reader of every job of the id
        (None, None, True),
    ],
)
def test_a_read_by_id_shows_the_events_of_its_job_and_the_untagged(
    event_tag: str | None, reader_tag: str | None, shown: bool
) -> None:
    """``of_job``: an event tagged with another job of the id is left out; no tag is kept."""
    event = ev("n", 1).model_copy(update={"job_tag": event_tag})
    assert of_job(event, reader_tag) is shown


def test_an_event_tag_is_a_tag() -> None:
    """``job_tag`` is what ``incarnation_tag`` writes (32 hex digits), nothing else."""
    with pytest.raises(ValidationError):
        Event.model_validate({**ev("n", 1).model_dump(), "job_tag": "../x"})


@pytest.mark.timeout(20)
async def test_merged_reads_leave_out_another_job_of_the_id(tmp_path) -> None:
    """Events of two jobs of one id (and an untagged one) in the store: a read for one job
    gets its own and the untagged, numbered as a read of every event numbers them; the
    kinds' read and the long-poll alike. Another job's event ends a long-poll only when
    the id no longer names the job followed."""
    from elasticd.eventkinds import EventKind
    from elasticd.goodput import FACT_KINDS
    from elasticd.node.db import Database
    from elasticd.node.events import EventLog
    from elasticd.store.memory import MemoryStore

    async with MemoryStore() as store, Database(tmp_path / "elasticd.sqlite3") as db:
        log = EventLog(db, "n0", store=store)
        await log.start()
        log.emit("j", "daemon", EventKind.JOB_PLACED, "a placed", job_tag=A)
        log.emit("j", "daemon", EventKind.JOB_PLACED, "b placed", job_tag=B)
        log.emit("j", "daemon", EventKind.JOB_STATE, "untagged")
        log.emit("j", "agent", EventKind.WORKER_EXITED, "a exited", job_tag=A)
        await log.flush()
        every = await log.cluster_events("j")
        of_a = await log.cluster_events("j", tag=A)
        placed_b = await log.cluster_events_of("j", FACT_KINDS, tag=B)
        last = every[-1].seq
        asked: list[str] = []

        async def still() -> None:  # the id still names job a: b's event is a late one
            asked.append("a")

        follow = asyncio.ensure_future(log.follow_cluster("j", last, 1.0, tag=A, still=still))
        log.emit("j", "daemon", EventKind.JOB_PREEMPTED, "b preempted", job_tag=B)
        await log.flush()
        followed = await follow

        async def replaced() -> None:  # the id names job b now: job a's follower is done
            raise JobConflict("replaced")

        with pytest.raises(JobConflict):
            await log.follow_cluster("j", last, 5.0, tag=A, still=replaced)
        await log.stop()
    assert [e.message for e in of_a] == ["a placed", "untagged", "a exited"]
    assert [(e.seq, e.message) for e in of_a] == [
        (e.seq, e.message) for e in every if e.message != "b placed"
    ]
    assert [e.message for e in placed_b] == ["b placed"]
    assert followed == []
    assert asked == ["a"]


@pytest.mark.timeout(10)
async def test_the_local_read_leaves_out_another_job_of_the_id(tmp_path) -> None:
    """With no store (``elasticd run``): the read and the follow by tag, a follow reading on
    past a whole batch of another job's events to its own."""
    from elasticd.eventkinds import EventKind
    from elasticd.node.db import Database
    from elasticd.node.events import EventLog

    async with Database(tmp_path / "elasticd.sqlite3") as db:
        log = EventLog(db, "n0")
        for i in range(5):
            log.emit("j", "daemon", EventKind.JOB_STATE, f"b {i}", job_tag=B)
        log.emit("j", "daemon", EventKind.JOB_STATE, "a", job_tag=A)
        await db.backlog.wait_empty()
        assert [e.message for e in log.read("j", tag=A)] == ["a"]
        assert len(log.read("j")) == 6
        followed = await log.follow("j", 0, 1.0, limit=2, tag=A)
        await log.stop()
    assert [e.message for e in followed] == ["a"]


@pytest.mark.timeout(10)
async def test_a_store_outage_is_said_of_the_job_that_lost_the_store(tmp_path) -> None:
    """``store.lost`` and its ``store.back`` carry the tag the loser gave."""
    from elasticd.eventkinds import EventKind
    from elasticd.node.db import Database
    from elasticd.node.events import EventLog

    async with Database(tmp_path / "elasticd.sqlite3") as db:
        log = EventLog(db, "n0")
        assert log.store_lost("j", "agent", "lost", tag=A)
        assert log.store_back("j") == ["j"]
        await db.backlog.wait_empty()
        said = [(e.kind, e.job_tag) for e in log.read("j")]
        await log.stop()
    assert said == [(EventKind.STORE_LOST, A), (EventKind.STORE_BACK, A)]


@pytest.mark.timeout(10)
async def test_retention_trims_each_job_of_the_id_on_its_own(tmp_path) -> None:
    """A node that still holds a deleted job's events when its id is taken again (the old
    job's ``store.back`` or stop said after the node saw the id taken; before
    ``forget_others``, every event of it) trims each job's events by that job's own
    first and last, and its own failures: the new job's first failure is never counted
    as a repeat of the old job's, and what it lost is said by a marker its reader sees."""
    from elasticd.eventkinds import EventKind
    from elasticd.node.db import Database
    from elasticd.node.events import EventLog, EventRetention
    from elasticd.store.memory import MemoryStore

    def routine(log: EventLog, tag: str, name: str) -> None:
        log.emit("j", "agent", EventKind.WORKERS_STARTED, name, job_tag=tag)

    def exit_1(log: EventLog, tag: str) -> None:
        log.emit(
            "j", "agent", EventKind.WORKER_EXITED, "rank 0 exited 1", job_tag=tag,
            state="FAILED", rank=0, exit_code=1,
        )  # fmt: skip

    async with MemoryStore() as store, Database(tmp_path / "elasticd.sqlite3") as db:
        retention = EventRetention(first=2, last=2, every=1000)
        log = EventLog(db, "n0", store=store, retention=retention)
        await log.start()
        for i in range(2):
            routine(log, A, f"a{i}")
        exit_1(log, A)
        for i in range(2, 5):
            routine(log, A, f"a{i}")
        for i in range(2):
            routine(log, B, f"b{i}")
        exit_1(log, B)
        for i in range(2, 6):
            routine(log, B, f"b{i}")
        await log.flush()  # published: only published events are trimmed
        await log.trim("j")
        await db.backlog.wait_empty()
        of_b = [(e.kind, e.message, e.count) for e in log.read("j", tag=B)]
        of_a = [(e.kind, e.count) for e in log.read("j", tag=A)]
        await log.stop()
    started, trimmed = EventKind.WORKERS_STARTED, EventKind.EVENTS_TRIMMED
    assert [kind for kind, _, _ in of_b] == [
        started, started, EventKind.WORKER_EXITED, trimmed, started, started
    ]  # fmt: skip
    assert of_b[3][2] == 2  # b2 and b3, said to b's reader
    assert of_a == [
        (started, None), (started, None), (EventKind.WORKER_EXITED, None), (trimmed, 1),
        (started, None), (started, None),
    ]  # fmt: skip
