"""The scheduler loop's pure checks of what it reads: node records and the sched/leader record."""

from __future__ import annotations

import json

import pytest

from elasticd.node.cluster import MAX_NODE_SLOTS
from elasticd.node.scheduler import check_node_entry, leader_verdict
from elasticd.store import Entry


def record(name: str = "n1", **changes: object) -> bytes:
    doc: dict[str, object] = {
        "name": name,
        "url": "http://127.0.0.1:1",
        "addr": "127.0.0.1",
        "labels": {},
        "slots": 2,
        "free_slots": 2,
        "version": "1",
        "started_at": 0.0,
    }
    doc.update(changes)
    return json.dumps(doc).encode()


def node_entry(value: bytes, lease: int | None = 7, key: str = "nodes/n1") -> Entry:
    return Entry(key=key, value=value, version=3, created=3, lease=lease)


@pytest.mark.parametrize(
    ("value", "lease", "key", "why"),
    [
        (record(), 7, "nodes/n1", None),
        (record(slots=MAX_NODE_SLOTS), 7, "nodes/n1", None),
        (record(slots=10**9), 7, "nodes/n1", "slots"),
        (record(slots=-1), 7, "nodes/n1", "slots"),
        (record(labels={"k": "v" * 5000}), 7, "nodes/n1", "labels"),
        (record(labels={f"k{i}": "v" for i in range(65)}), 7, "nodes/n1", "labels"),
        (record(name="x" * 300), 7, "nodes/n1", "name"),
        (record(started_at="NaN"), 7, "nodes/n1", "started_at"),
        (record(version="v" * 100), 7, "nodes/n1", "version"),
        (b"\xff not json", 7, "nodes/n1", "not a valid node record"),
        (record(), None, "nodes/n1", "not bound to a lease"),
        (record(name="n2"), 7, "nodes/n1", "names node 'n2'"),
    ],
)
def test_a_node_record_is_used_only_within_its_bounds(value, lease, key, why):
    """A record with unbounded slots, long labels or a wrong name is ignored with the reason."""
    caps, reason = check_node_entry(node_entry(value, lease, key))
    if why is None:
        assert caps is not None and reason is None
    else:
        assert caps is None and reason is not None and why in reason


def leader(value: bytes, lease: int | None) -> Entry:
    return Entry(key="sched/leader", value=value, version=9, created=9, lease=lease)


@pytest.mark.parametrize(
    ("holder", "node", "verdict", "why"),
    [
        (leader(b"me", 1), None, "mine", ""),
        (leader(b"n1", 7), node_entry(record(), 7), "other", ""),
        # Squats: no lease, another lease than the node's, no such node, a bad record, junk.
        (leader(b"n1", None), node_entry(record(), 7), "usurp", "not bound to a lease"),
        (leader(b"n1", 8), node_entry(record(), 7), "usurp", "no live record on the same lease"),
        (leader(b"n1", 7), None, "usurp", "no live record"),
        (leader(b"n1", 7), node_entry(record(slots=10**6), 7), "usurp", "is ignored"),
        (leader(b"../x", 7), None, "usurp", "not a node name"),
        (leader(b"\xff\xfe", 7), None, "usurp", "not a node name"),
        (leader(b"me", 2), None, "usurp", "no live record"),  # my own, from a lost lease
    ],
)
def test_leader_record_verdict(holder, node, verdict, why):
    """Only a leader record on the lease of a live, valid node record is waited on."""
    got, reason = leader_verdict(holder, node, "me", 1)
    assert got == verdict and why in reason
