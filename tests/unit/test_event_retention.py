"""The event retention decision (issue 23 item 7): first N, last N, every failure, one marker."""

from __future__ import annotations

import pytest

from elasticd.node.events import (
    EventRetention,
    Retained,
    Trim,
    is_failure,
    summarised_jobs,
    trim_events,
    trim_jobs,
)

P = EventRetention(first=2, last=2)


def ev(seq: int, failure: bool = False, published: bool = True, dropped: int = 0) -> Retained:
    return Retained(seq=seq, time=float(seq), failure=failure, published=published, dropped=dropped)


def crash(seq: int, code: int = 3, kind: str = "worker.exited") -> Retained:
    """A worker failure a crash loop repeats (its signature: kind, rank 0, exit code)."""
    return Retained(seq=seq, time=float(seq), failure=True, signature=(kind, 0, code))


def marker(seq: int, count: int, until: float) -> Retained:
    return Retained(seq=seq, time=float(seq), dropped=count, until=until)


@pytest.mark.parametrize(
    ("events", "expected"),
    [
        # within the bounds: nothing goes
        ([ev(1), ev(2), ev(3), ev(4)], Trim()),
        # the middle goes; a marker in place of the first of it
        (
            [ev(1), ev(2), ev(3), ev(4), ev(5), ev(6), ev(7)],
            Trim(delete=(4, 5), marker=marker(3, 3, 5.0)),
        ),
        # failures stay, and so does what is not published yet
        (
            [ev(1), ev(2), ev(3, failure=True), ev(4), ev(5, published=False), ev(6), ev(7)],
            Trim(delete=(), marker=marker(4, 1, 4.0)),
        ),
        # an earlier marker folds in: its count grows, its span too
        (
            [ev(1), ev(2), marker(3, 10, 8.0), ev(9, failure=True), ev(10), ev(11), ev(12)],
            Trim(delete=(10,), marker=marker(3, 11, 10.0)),
        ),
        # only an earlier marker in the middle: nothing to do
        ([ev(1), ev(2), marker(3, 10, 8.0), ev(9), ev(10)], Trim()),
        # all failures: every one kept
        ([ev(i, failure=True) for i in range(1, 9)], Trim()),
        # a crash loop: the first of a run of the same failure stays, its repeats in the
        # middle go into the marker, the last ones stay
        (
            [ev(1), ev(2), crash(3), crash(4), crash(5), crash(6), crash(7)],
            Trim(delete=(5,), marker=Retained(seq=4, time=4.0, dropped=2, until=5.0)),
        ),
        # a different failure breaks the run: it stays, and so does the next of the first kind
        (
            [ev(1), ev(2), crash(3), crash(4, code=9), crash(5), crash(6), ev(7), ev(8)],
            Trim(delete=(), marker=Retained(seq=6, time=6.0, dropped=1, until=6.0)),
        ),
        # runs are per kind: a restart between two identical exits does not break their run
        (
            [ev(1), ev(2), crash(3), crash(4, kind="group.restarting"), crash(5), ev(6), ev(7)],
            Trim(delete=(), marker=Retained(seq=5, time=5.0, dropped=1, until=5.0)),
        ),
        # failures without a signature (faults: store.lost, ...) are never repeats
        (
            [ev(1), ev(2), ev(3, failure=True), ev(4, failure=True), ev(5), ev(6)],
            Trim(),
        ),
        # a repeat not yet published stays
        (
            [
                ev(1),
                ev(2),
                crash(3),
                Retained(
                    seq=4,
                    time=4.0,
                    failure=True,
                    signature=("worker.exited", 0, 3),
                    published=False,
                ),
                ev(5),
                ev(6),
            ],
            Trim(),
        ),
    ],
)
def test_trim_events(events: list[Retained], expected: Trim) -> None:
    """What a trim deletes and where its marker goes."""
    assert trim_events(events, P) == expected


FINISHED = EventRetention(first=2, last=2, finished_first=1, finished_last=2)


@pytest.mark.parametrize(
    ("policy", "events", "expected"),
    [
        # a finished job's policy: its own first 1 and last 2, failures kept
        (
            FINISHED.of_finished(),
            [ev(1), crash(2), ev(3), ev(4), ev(5), ev(6)],
            Trim(delete=(4,), marker=marker(3, 2, 4.0)),
        ),
        # past finished_total: its last event and the marker; failures go too
        (
            FINISHED.of_summarised(),
            [ev(1), crash(2), crash(3, code=9), ev(4), ev(5, failure=True)],
            Trim(delete=(2, 3, 4), marker=marker(1, 4, 4.0)),
        ),
        # summarised again: only the marker and the last event, nothing new
        (FINISHED.of_summarised(), [marker(1, 4, 4.0), ev(5, failure=True)], Trim()),
        # what is not published yet stays, even then
        (
            FINISHED.of_summarised(),
            [ev(1), ev(2, published=False), ev(3)],
            Trim(delete=(), marker=marker(1, 1, 1.0)),
        ),
    ],
    ids=["finished", "summarised", "summarised-again", "unpublished"],
)
def test_trim_events_of_finished_jobs(
    policy: EventRetention, events: list[Retained], expected: Trim
) -> None:
    """A finished job's events: its own first and last (the finished policy), or, past the
    finished jobs' total, its last event only."""
    assert trim_events(events, policy) == expected


@pytest.mark.parametrize(
    ("finished", "total", "expected"),
    [
        ([], 10, set()),
        # within the total: nobody summarised
        ([("a", 1.0, 4), ("b", 2.0, 6)], 10, set()),
        # past it: the job that goes over and every older one, newest ends kept
        ([("a", 1.0, 4), ("b", 2.0, 6), ("c", 3.0, 5)], 10, {"a", "b"}),
        ([("c", 3.0, 5), ("a", 1.0, 4), ("b", 2.0, 3)], 10, {"a"}),
        # one newest job larger than the total alone: summarised too
        ([("a", 1.0, 1), ("b", 2.0, 20)], 10, {"a", "b"}),
        # total 0: every finished job keeps only its last event
        ([("a", 1.0, 1), ("b", 2.0, 1)], 0, {"a", "b"}),
        # the same end time: ordered by id, so the decision is stable
        ([("a", 1.0, 6), ("b", 1.0, 6)], 10, {"a"}),
    ],
)
def test_summarised_jobs(
    finished: list[tuple[str, float, int]], total: int, expected: set[str]
) -> None:
    """Which finished jobs keep only their last event: the oldest ends past the total."""
    assert summarised_jobs(finished, total) == expected


A, B = "a" * 32, "b" * 32


@pytest.mark.parametrize(
    ("views", "expected"),
    [
        # each job of the id by its own bounds: a's 4 are within them, b's middle goes
        (
            {A: [ev(1), ev(2), ev(3), ev(4)], B: [ev(5), ev(6), ev(7), ev(8), ev(9)]},
            {A: Trim(), B: Trim(delete=(), marker=marker(7, 1, 7.0))},
        ),
        # b's first crash is not a repeat of a's: kept; a's middle under a's own marker
        (
            {
                A: [ev(1), ev(2), crash(3), ev(4), ev(5), ev(6)],
                B: [ev(7), ev(8), crash(9), ev(10), ev(11), ev(12)],
            },
            {
                A: Trim(delete=(), marker=marker(4, 1, 4.0)),
                B: Trim(delete=(), marker=marker(10, 1, 10.0)),
            },
        ),
        # untagged events (from before tags) are one more job
        (
            {None: [ev(1), ev(2), ev(3)], B: [ev(4), ev(5), ev(6), ev(7), ev(8)]},
            {None: Trim(), B: Trim(delete=(), marker=marker(6, 1, 6.0))},
        ),
    ],
)
def test_trim_jobs(
    views: dict[str | None, list[Retained]], expected: dict[str | None, Trim]
) -> None:
    """Each job of an id is trimmed on its own: its own first, last and failures."""
    assert trim_jobs(views, P) == expected


@pytest.mark.parametrize(
    ("kind", "state", "has_error", "kept"),
    [
        ("worker.exited", "FAILED", False, True),
        ("worker.exited", "STOPPED", False, False),
        ("worker.exited", "SUCCEEDED", False, False),
        ("group.restarting", "STOPPED", True, True),
        ("job.state", "FAILED", False, True),
        ("job.state", "RESTARTING", False, False),
        ("store.lost", None, False, True),
        ("store.back", None, False, True),
        ("agent.fenced", None, False, True),
        ("recovery.total", None, False, False),
        ("group.state", "HEALTHY", False, False),
        ("something.new", None, True, True),  # a root cause is always kept
    ],
)
def test_is_failure(kind: str, state: str | None, has_error: bool, kept: bool) -> None:
    """Which events the policy always keeps."""
    assert is_failure(kind, state, has_error) is kept
