"""The agent's goodput hook (elasticd.agent.goodput): its pure parts."""

from __future__ import annotations

import json

import pytest

from elasticd.agent.goodput import end_of, parse_record
from elasticd.goodput import MAX_ATTEMPTS, AttemptFacts, End, NodeGoodput
from elasticd.models import tagged_for


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
