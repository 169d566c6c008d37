"""The agent's goodput hook (elasticd.agent.goodput): its pure parts."""

from __future__ import annotations

import json

import pytest

from elasticd.agent.goodput import end_of, parse_record
from elasticd.goodput import MAX_ATTEMPTS, AttemptFacts, End, NodeGoodput


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
