"""A one-node job restarts early: its workers start while the store records the restart.

The round of a job no other node can join is known before the store forms it
(``FastRestart``), so the replacement workers are spawned while the failure
is recorded, the round formed and the restart charged. These tests check what
must not change because of it: every event lands, in the restart's order;
the workers get exactly the round and restart count the store then records;
the budget, a cancel in the middle and a job of more nodes behave as before.
Real daemon (in-memory store), real worker subprocesses.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import httpx
import pytest

from api.app import create_app
from elasticd.rendezvous import StoreRendezvous
from tests.conftest import PY, events_of, make_daemon, script, wait_job

#: Each worker writes its contract variables; rank 1 fails in its first two attempts.
CRASH_TWICE = """
import json, os, sys
out = os.path.join(sys.argv[1], f"a{os.environ['TORCHELASTIC_RESTART_COUNT']}-r{os.environ['LOCAL_RANK']}.json")
keys = ("TORCHELASTIC_RESTART_COUNT", "ELASTICD_ATTEMPT", "MASTER_PORT", "RANK", "WORLD_SIZE")
with open(out, "w") as fh:
    json.dump({k: os.environ[k] for k in keys}, fh)
if os.environ["LOCAL_RANK"] == "1" and int(os.environ["TORCHELASTIC_RESTART_COUNT"]) < 2:
    sys.exit(3)
"""


def records(folder: Path) -> dict[str, dict[str, str]]:
    return {p.stem: json.loads(p.read_text()) for p in folder.glob("*.json")}


async def test_a_one_node_restart_starts_early_and_loses_nothing(client, tmp_path):
    """Two restarts of a one-node job: both start early, every event lands in the restart's
    order, and the workers' round, port and restart count are the ones the store recorded."""
    out = tmp_path / "out"
    out.mkdir()
    path = script(tmp_path, "crash.py", CRASH_TWICE)
    r = await client.post(
        "/jobs",
        json={
            "entrypoint": PY,
            "args": [path, str(out)],
            "nproc_per_node": 2,
            "gpu_health_check": False,  # no check at all: nothing awaited before the spawn
        },
    )
    job = await wait_job(client, r.json()["id"])
    assert job["state"] == "SUCCEEDED" and job["restart_count"] == 2
    events = await events_of(client, job["id"])
    totals = [e["message"] for e in events if e["kind"] == "recovery.total"]
    assert len(totals) == 2 and all("started early, during the rendezvous" in m for m in totals)
    restarting = [e for e in events if e["kind"] == "group.restarting"]
    assert [e["attempt"] for e in restarting] == [0, 1]  # the attempt that failed
    assert [e["seq"] for e in events] == sorted(e["seq"] for e in events)
    started = [e for e in events if e["kind"] == "workers.started"]
    assert [bool(e.get("early")) for e in started] == [False, True, True]
    rounds = [e for e in events if e["kind"] == "rendezvous.complete"]
    assert len(rounds) == 3
    seen = records(out)
    for count, (rdzv, start) in enumerate(zip(rounds, started, strict=True)):
        # The round the store formed is the one the early workers were given.
        number = int(rdzv["message"].split()[1].rstrip(":"))
        port = rdzv["message"].rsplit(":", 1)[1]
        # Rank 1 ran to its exit in every attempt, both ranks in the last; rank 0 of a failed
        # attempt may be stopped by the restart before its first line (nothing promises it
        # runs), but where it did run it had the same round.
        for rank in (0, 1):
            env = seen.get(f"a{count}-r{rank}")
            if env is None:
                assert rank == 0 and count < 2, (count, rank, sorted(seen))
                continue
            assert env["ELASTICD_ATTEMPT"] == f"{number}.{count}"
            assert env["MASTER_PORT"] == port
            assert env["TORCHELASTIC_RESTART_COUNT"] == str(count)
        assert start["attempt"] == count
    # Each restart's events in the order of a restart (the spawn overlaps the store
    # work; the record of it does not reorder: the job is RESTARTING before its round).
    kinds = [
        e["kind"]
        for e in events
        if e["kind"]
        in ("workers.stopped", "group.restarting", "rendezvous.complete", "workers.started")
        or (e["kind"] == "job.state" and e["state"] == "RESTARTING")
    ]
    one = ["workers.stopped", "job.state", "group.restarting", "rendezvous.complete"]
    assert kinds == ["rendezvous.complete", "workers.started"] + [*one, "workers.started"] * 2


async def test_the_budget_still_ends_a_one_node_job(client, tmp_path):
    """With the budget spent the failure is not restarted early: the job FAILS as before."""
    path = script(tmp_path, "fail.py", "import sys; sys.exit(5)\n")
    r = await client.post("/jobs", json={"entrypoint": PY, "args": [path], "max_restarts": 2})
    job = await wait_job(client, r.json()["id"])
    assert job["state"] == "FAILED" and job["restart_count"] == 2
    assert "restart budget spent" in job["reason"]
    started = [e for e in await events_of(client, job["id"]) if e["kind"] == "workers.started"]
    assert [bool(e.get("early")) for e in started] == [False, True, True]


@pytest.mark.parametrize("attempt", [0, 1, 2, 3])
async def test_a_cancel_during_early_restarts_leaves_no_worker(client, tmp_path, attempt):
    """Cancelled while it crash-loops (each restart starting early, each worker exiting at
    once), the job ends CANCELLED, no worker of any attempt is left (the early workers are
    stopped like any), and no attempt's exits are reported before its start."""
    pids = tmp_path / "pids"
    pids.mkdir()
    path = script(
        tmp_path,
        "loop.py",
        """
        import os, sys, time
        open(os.path.join(sys.argv[1], str(os.getpid())), "w").close()
        sys.exit(1)
        """,
    )
    r = await client.post(
        "/jobs",
        json={
            "entrypoint": PY,
            "args": [path, str(pids)],
            "nproc_per_node": 2,
            "max_restarts": 1000,
            "termination_grace": 2,
        },
    )
    job_id = r.json()["id"]
    async with asyncio.timeout(60):
        while len(list(pids.iterdir())) < 4 + 2 * attempt:
            await asyncio.sleep(0.01)
    assert (await client.post(f"/jobs/{job_id}/cancel", json={})).status_code == 200
    job = await wait_job(client, job_id)
    assert job["state"] == "CANCELLED"
    async with asyncio.timeout(30):
        while True:
            alive = []
            for p in pids.iterdir():
                try:
                    os.kill(int(p.name), 0)
                    alive.append(p.name)
                except ProcessLookupError:
                    pass
            if not alive:
                break
            await asyncio.sleep(0.05)
    # Workers that exited before the store confirmed their early start are reported
    # after it: no attempt's exit comes before its start.
    events = await events_of(client, job_id)
    for attempt in {e["attempt"] for e in events if e["kind"] == "worker.exited"}:
        exits = [
            i
            for i, e in enumerate(events)
            if e["kind"] == "worker.exited" and e["attempt"] == attempt
        ]
        starts = [
            i
            for i, e in enumerate(events)
            if e["kind"] == "workers.started" and e["attempt"] == attempt
        ]
        if starts:
            assert starts[0] < exits[0], events[starts[0]]


async def test_a_job_other_nodes_may_join_does_not_start_early(client, tmp_path):
    """``max_nodes`` above 1: the next round is the store's to decide, never guessed."""
    path = script(
        tmp_path,
        "crash.py",
        """
        import os, sys
        if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
            sys.exit(3)
        """,
    )
    r = await client.post(
        "/jobs",
        json={
            "entrypoint": PY,
            "args": [path],
            "min_nodes": 1,
            "max_nodes": 2,
            "last_call_timeout": 0.1,
        },
    )
    job = await wait_job(client, r.json()["id"])
    assert job["state"] == "SUCCEEDED" and job["restart_count"] == 1
    started = [e for e in await events_of(client, job["id"]) if e["kind"] == "workers.started"]
    assert [bool(e.get("early")) for e in started] == [False, False]


async def test_a_failed_health_check_leaves_the_restart_to_the_store(client, tmp_path):
    """The check before the restart fails once (one restart spent at once): the workers are
    not started early, the next round is formed after a passing check, and both restarts
    are charged once each."""
    runs = tmp_path / "runs"
    check = script(
        tmp_path,
        "check.py",
        f"""
        import os, sys
        n = len(os.listdir({str(runs)!r}))
        open(os.path.join({str(runs)!r}, str(n)), "w").close()
        sys.exit(1 if n == 1 else 0)  # the check before the first restart fails
        """,
    )
    runs.mkdir()
    path = script(
        tmp_path,
        "crash.py",
        """
        import os, sys
        sys.exit(3 if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" else 0)
        """,
    )
    r = await client.post(
        "/jobs",
        json={"entrypoint": PY, "args": [path], "health_check": [PY, check], "max_restarts": 3},
    )
    job = await wait_job(client, r.json()["id"])
    assert job["state"] == "SUCCEEDED" and job["restart_count"] == 2
    events = await events_of(client, job["id"])
    started = [e for e in events if e["kind"] == "workers.started"]
    assert [bool(e.get("early")) for e in started] == [False, False]
    kinds = [e["kind"] for e in events]
    assert kinds.count("worker.health_check_failed") == 1
    assert kinds.count("rendezvous.complete") == 2  # no round formed and then abandoned


async def test_early_workers_stop_when_the_store_is_slower_than_the_fence(tmp_path, monkeypatch):
    """Unconfirmed workers have no round watch: when the store takes longer than the node's
    fence to form their round, they are stopped, and the round's own start when it forms."""
    slow = StoreRendezvous.next_round

    async def next_round(self, *, port=None):
        if port is not None:  # the early restart's round: the store "hangs" past the fence
            await asyncio.sleep(2.0)
        return await slow(self, port=port)

    monkeypatch.setattr(StoreRendezvous, "next_round", next_round)
    daemon = make_daemon(tmp_path, lease_ttl=1.0)
    async with asyncio.timeout(30):
        await daemon.start()
    try:
        transport = httpx.ASGITransport(app=create_app(daemon))
        async with httpx.AsyncClient(
            transport=transport,
            headers={"Authorization": f"Bearer {daemon.token}"},
            base_url="http://x",
        ) as client:
            path = script(
                tmp_path,
                "crash.py",
                """
                import os, sys, time
                if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
                    sys.exit(3)
                time.sleep(0.5)
                """,
            )
            r = await client.post("/jobs", json={"entrypoint": PY, "args": [path]})
            job = await wait_job(client, r.json()["id"])
            events = await events_of(client, job["id"])
    finally:
        async with asyncio.timeout(60):
            await daemon.shutdown()
    assert job["state"] == "SUCCEEDED" and job["restart_count"] == 1
    kinds = [(e["kind"], e.get("attempt"), bool(e.get("early"))) for e in events]
    started = [k for k in kinds if k[0] == "workers.started"]
    # Attempt 1 (early) never started; the round's own start is attempt 2. A 1 s lease on a
    # loaded machine may also lapse now and then: the node fences and resumes as a further
    # attempt, charging nothing (restart_count stays 1), so later starts are not an error.
    assert started[:2] == [("workers.started", 0, False), ("workers.started", 2, False)], kinds
    assert not [k for k in started if k[2]], kinds
    stopped = [k for k in kinds if k[0] == "workers.stopped"]
    assert ("workers.stopped", 1, False) in stopped  # the early attempt, never confirmed
