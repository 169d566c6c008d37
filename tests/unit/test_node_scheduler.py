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


class _Events:
    """Records what the scheduler tells the jobs (the event log's one method it uses)."""

    def __init__(self) -> None:
        self.kinds: list[tuple[str, str]] = []

    def emit(self, job_id: str, source: str, kind: object, message: str = "", **_: object):
        self.kinds.append((job_id, str(getattr(kind, "value", kind))))


class _BrokenWallClock:
    """A clock whose wall time raises once ``broken``: a pass fails half way, a bug stand-in."""

    broken = False

    def monotonic(self) -> float:
        import time

        return time.monotonic()

    def time(self) -> float:
        import time

        if self.broken:
            raise RuntimeError("a bug in the planner")
        return time.time()


async def test_a_crashed_pass_gives_up_leadership_and_another_daemon_places(monkeypatch):
    """The leader's pass raises: it is told to the job, and the other daemon takes over."""
    import asyncio

    from elasticd import keys
    from elasticd.models import Job, JobSpec
    from elasticd.node import scheduler as sched
    from elasticd.states import JobState
    from elasticd.testing import MemoryStore

    monkeypatch.setattr(sched, "RESIGN_SECONDS", 60.0)  # the crashed one must not come back
    clock = _BrokenWallClock()
    async with MemoryStore() as store, asyncio.timeout(20):
        leases = {name: await store.grant(30) for name in ("a", "b")}
        for name, lease in leases.items():
            await store.put(keys.node_key(name), record(name), lease=lease)
        events = {"a": _Events(), "b": _Events()}
        made = {
            name: sched.FleetScheduler(
                store,
                events[name],  # type: ignore[arg-type]
                on_plan=lambda plan: None,
                node=name,
                lease=lambda lease=lease: asyncio.sleep(0, lease),
                clock=clock if name == "a" else _BrokenWallClock(),
            )
            for name, lease in leases.items()
        }
        await made["a"].start()
        while not made["a"].leading:
            await asyncio.sleep(0.01)
        await made["b"].start()
        clock.broken = True  # from now on a's passes fail
        job = Job(
            id="j",
            spec=JobSpec(entrypoint="true"),
            state=JobState.PENDING,
            max_restarts=0,
            created_at=1.0,
        )
        await store.put("job/j", job.model_dump_json().encode())
        made["a"].wake()
        made["b"].wake()
        while ("j", "sched.crashed") not in events["a"].kinds:
            await asyncio.sleep(0.01)
        while not (made["b"].leading and made["b"].plan.placements.get("j")):
            await asyncio.sleep(0.01)
        assert not made["a"].leading
        for s in made.values():
            await s.stop()
