"""Several real daemons on 127.0.0.1, one store, real gloo jobs all-reducing across nodes."""

from __future__ import annotations

import asyncio

import pytest

from tests.conftest import PY, ROOT
from tests.e2e.cluster import LocalCluster, follow_until, job_ended, read_notes

pytestmark = [pytest.mark.slow, pytest.mark.torch]
pytest.importorskip("torch")

TRAIN = str(ROOT / "examples" / "train_elastic.py")


@pytest.fixture
def cluster(tmp_path):
    c = LocalCluster(tmp_path)
    try:
        yield c
    finally:
        c.stop_all()


def spec(job_id: str, out, *, min_nodes: int, max_nodes: int, extra=(), **fields):
    return {
        "id": job_id,
        "entrypoint": PY,
        "args": [TRAIN, "--out", str(out), *extra],
        "nproc_per_node": 1,
        "min_nodes": min_nodes,
        "max_nodes": max_nodes,
        "termination_grace": 3,
        **fields,
    }


def worlds(notes, restart=None):
    return sorted({n["world"] for n in notes if restart is None or n["restart"] == restart})


async def test_worker_crash_restarts_every_node_and_spends_one_restart(cluster, tmp_path):
    """A crash on one node restarts all three groups once; the job-wide count reaches every worker."""
    await cluster.start_all("n0", "n1", "n2")
    out = tmp_path / "notes.jsonl"
    async with cluster.client("n1") as c:
        r = await c.post(
            "/jobs",
            json=spec(
                "crash",
                out,
                min_nodes=3,
                max_nodes=3,
                extra=["--crash-rank", "1", "--crash-at", "0"],
            ),
        )
        assert r.status_code == 201
        await follow_until(c, "crash", job_ended, 150)
        job = (await c.get("/jobs/crash")).json()
        assert job["state"] == "SUCCEEDED", cluster.logs()
        assert job["restart_count"] == 1
        assert job["error"]["message"].startswith("RuntimeError: rank 1 crashes on purpose")
        notes = read_notes(out)
        final = [n for n in notes if n["restart"] == 1]
        assert sorted(n["rank"] for n in final) == [0, 1, 2]
        assert {n["world"] for n in final} == {3} and {n["sum"] for n in final} == {6.0}
        assert len({n["master"] for n in notes}) == 2  # a fresh master port per round
        view = (await c.get("/jobs/crash/workers")).json()
        assert sorted(g["node"] for g in view["groups"]) == ["n0", "n1", "n2"]
        assert all(g["state"] == "SUCCEEDED" for g in view["groups"])
        # Any daemon answers with every node's events, merged in one order.
        async with cluster.client("n2") as c2:
            events = (await c2.get("/jobs/crash/events")).json()
        assert {e["node"] for e in events} >= {"n0", "n1", "n2"}
        assert [e["seq"] for e in events] == sorted(e["seq"] for e in events)
        # Logs are served by the node that has them, through any daemon.
        crashed = next(g for g in view["groups"] if g["group_rank"] == 1)["node"]
        log = await c.get(
            "/jobs/crash/logs", params={"node": crashed, "stream": "stderr", "attempt": 0}
        )
        assert log.status_code == 200 and "crashes on purpose" in log.text


async def test_node_loss_survivors_reform_without_hanging(cluster, tmp_path):
    """kill -9 of a node and its workers: survivors notice the lease expiry and re-form (2:3)."""
    await cluster.start_all("n0", "n1", "n2")
    out, hold = tmp_path / "notes.jsonl", tmp_path / "hold"
    async with cluster.client("n0") as c:
        await c.post(
            "/jobs", json=spec("loss", out, min_nodes=2, max_nodes=3, extra=["--hold", str(hold)])
        )
        await follow_until(c, "loss", lambda ev: len(read_notes(out)) >= 3, 120)
        assert worlds(read_notes(out)) == [3]
        view = (await c.get("/jobs/loss/workers")).json()
        victim = next(g for g in view["groups"] if g["node"] != "n0")
        cluster.kill9(victim["node"], [w["pid"] for w in victim["workers"]])
        await follow_until(c, "loss", lambda ev: 2 in worlds(read_notes(out)), 60)
        hold.touch()
        await follow_until(c, "loss", job_ended, 60)
        job = (await c.get("/jobs/loss")).json()
        assert job["state"] == "SUCCEEDED", cluster.logs()
        assert job["restart_count"] == 0  # losing a node is a membership change, not a failure
        survivors = [n for n in read_notes(out) if n["world"] == 2]
        assert sorted(n["rank"] for n in survivors) == [0, 1]


async def test_node_arrival_grows_the_job_without_spending_a_restart(cluster, tmp_path):
    """A new daemon joins the wait list; the running group re-forms to include it."""
    await cluster.start_all("n0", "n1")
    out, hold = tmp_path / "notes.jsonl", tmp_path / "hold"
    async with cluster.client("n0") as c:
        await c.post(
            "/jobs", json=spec("grow", out, min_nodes=2, max_nodes=3, extra=["--hold", str(hold)])
        )
        await follow_until(c, "grow", lambda ev: len(read_notes(out)) >= 2, 120)
        cluster.start("n2")
        await follow_until(c, "grow", lambda ev: 3 in worlds(read_notes(out)), 90)
        hold.touch()
        await follow_until(c, "grow", job_ended, 60)
        job = (await c.get("/jobs/grow")).json()
        assert job["state"] == "SUCCEEDED", cluster.logs()
        assert job["restart_count"] == 0
        assert worlds(read_notes(out)) == [2, 3]


async def test_hot_spare_replaces_a_lost_node(cluster, tmp_path):
    """With more nodes than max_nodes the extra one waits; it replaces a lost participant for free."""
    await cluster.start_all("n0", "n1", "n2")
    out, hold = tmp_path / "notes.jsonl", tmp_path / "hold"
    async with cluster.client("n0") as c:
        await c.post(
            "/jobs", json=spec("spare", out, min_nodes=2, max_nodes=2, extra=["--hold", str(hold)])
        )
        await follow_until(c, "spare", lambda ev: len(read_notes(out)) >= 2, 120)
        view = (await c.get("/jobs/spare/workers")).json()
        running = {g["node"] for g in view["groups"]}
        assert len(running) == 2
        (spare,) = {"n0", "n1", "n2"} - running
        victim = next(g for g in view["groups"] if g["node"] != "n0")
        cluster.kill9(victim["node"], [w["pid"] for w in victim["workers"]])
        await follow_until(c, "spare", lambda ev: len(read_notes(out)) >= 4, 90)
        hold.touch()
        await follow_until(c, "spare", job_ended, 60)
        job = (await c.get("/jobs/spare")).json()
        assert job["state"] == "SUCCEEDED", cluster.logs()
        assert job["restart_count"] == 0
        final = (await c.get("/jobs/spare/workers")).json()
        assert {g["node"] for g in final["groups"]} == {"n0", spare}


async def test_cancel_on_any_daemon_stops_every_node(cluster, tmp_path):
    """POST /jobs/{id}/cancel on one daemon stops the workers on all of them."""
    await cluster.start_all("n0", "n1", "n2")
    out, hold = tmp_path / "notes.jsonl", tmp_path / "hold"
    async with cluster.client("n2") as c:
        await c.post(
            "/jobs", json=spec("stop", out, min_nodes=3, max_nodes=3, extra=["--hold", str(hold)])
        )
        await follow_until(c, "stop", lambda ev: len(read_notes(out)) >= 3, 120)
        pids = [n["pid"] for n in read_notes(out)]
        async with cluster.client("n1") as c1:
            assert (await c1.post("/jobs/stop/cancel", json={})).json()["state"] == "CANCELLED"

        def all_stopped(_events) -> bool:
            return all(not _alive(p) for p in pids)

        await follow_until(c, "stop", all_stopped, 30)
        # Every node gives the job's slots back (records are republished; poll under a deadline).
        async with asyncio.timeout(20):
            while True:
                nodes = (await c.get("/nodes")).json()
                if {n["name"] for n in nodes} == {"n0", "n1", "n2"} and all(
                    n["free_slots"] == 2 for n in nodes
                ):
                    break
                await asyncio.sleep(0.1)


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
