"""The event retention decision (issue 23 item 7): first N, last N, every failure, one marker."""

from __future__ import annotations

import pytest

from elasticd.node.events import EventRetention, Retained, Trim, is_failure, trim_events

P = EventRetention(first=2, last=2)


def ev(seq: int, failure: bool = False, published: bool = True, dropped: int = 0) -> Retained:
    return Retained(seq=seq, time=float(seq), failure=failure, published=published, dropped=dropped)


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
    ],
)
def test_trim_events(events: list[Retained], expected: Trim) -> None:
    """What a trim deletes and where its marker goes."""
    assert trim_events(events, P) == expected


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
