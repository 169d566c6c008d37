"""The merged event order, decided purely (issue 12, defect 7): tables, no store."""

from __future__ import annotations

import pytest

from elasticd.models import Event
from elasticd.node.events import (
    PUBLISH_BATCH_BYTES,
    PUBLISH_BATCH_EVENTS,
    SEQ_STRIDE,
    merge_key,
    merged_seqs,
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
