"""When a node closes a job's torchft Lighthouse (``node/lighthouses.unused_for``, pure)."""

from __future__ import annotations

import pytest

from elasticd.lighthouse.state import Participant, QuorumDoc, StoredMember
from elasticd.node.lighthouses import quorum_words, unused_for


@pytest.mark.parametrize(
    ("served", "active", "unused", "now", "close", "since"),
    [
        # A job with a group's agent here stays, and its unused clock is dropped.
        (["a"], {"a"}, {"a": 1.0}, 50.0, [], {}),
        # No agent since now: kept, its clock starts.
        (["a"], set(), {}, 50.0, [], {"a": 50.0}),
        # No agent for less than the grace (a re-exec's adoption): kept.
        (["a"], set(), {"a": 45.0}, 50.0, [], {"a": 45.0}),
        # No agent for the whole grace: closed.
        (["a"], set(), {"a": 40.0}, 50.0, ["a"], {}),
        # Each job by its own clock.
        (["a", "b", "c"], {"b"}, {"a": 40.0, "c": 49.0}, 50.0, ["a"], {"c": 49.0}),
        # A clock of a job no longer served is forgotten.
        ([], set(), {"gone": 1.0}, 50.0, [], {}),
    ],
)
def test_a_lighthouse_is_closed_after_its_grace_with_no_group_here(
    served: list[str],
    active: set[str],
    unused: dict[str, float],
    now: float,
    close: list[str],
    since: dict[str, float],
) -> None:
    """A job's Lighthouse is closed once no group's agent has run here for the grace (10 s
    here), never sooner: a re-exec's new image serves it before it takes the agents up."""
    assert unused_for(served, active, unused, now, 10.0) == (close, since)


def _doc(quorum_id: int, *members: str) -> QuorumDoc:
    return QuorumDoc(
        quorum_id=quorum_id,
        participants=[
            Participant(member=StoredMember(replica_id=m), node="n0", ticket=1) for m in members
        ],
    )


@pytest.mark.parametrize(
    ("old", "new", "words"),
    [
        (None, _doc(1, "a", "b"), "quorum 1: 2 replica group(s); joined: a, b"),
        (_doc(1, "a", "b", "c"), _doc(2, "a", "b"), "quorum 2: 2 replica group(s); left: c"),
        (
            _doc(2, "a", "b"),
            _doc(3, "a", "b", "d"),
            "quorum 3: 3 replica group(s); joined: d",
        ),
        (_doc(3, "a", "b"), _doc(4, "a", "c"), "quorum 4: 2 replica group(s); joined: c; left: b"),
    ],
)
def test_a_new_quorum_says_who_joined_and_who_left(
    old: QuorumDoc | None, new: QuorumDoc, words: str
) -> None:
    """The job's lighthouse.quorum event: the new id, its size, the replicas in and out."""
    assert quorum_words(old, new) == words
