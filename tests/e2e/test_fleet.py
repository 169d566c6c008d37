"""The fleet scheduler on real daemons (issue 14): spread, gangs, spares, shrink, preemption.

Every test runs `elasticd serve` processes on 127.0.0.1 sharing one store and
tiny non-torch workers; it submits as a user would and reads what the API says.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.cluster import LocalCluster, follow_until, job_ended

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

SLEEP = [sys.executable, "-c", "import sys, time; time.sleep(float(sys.argv[1]))"]


def sleeper(job_id: str, seconds: float, **fields: Any) -> dict[str, Any]:
    return {
        "id": job_id,
        "entrypoint": SLEEP[0],
        "args": [*SLEEP[1:], str(seconds)],
        "termination_grace": 2,
        **fields,
    }


async def post(c: httpx.AsyncClient, body: dict[str, Any]) -> None:
    r = await c.post("/jobs", json=body)
    assert r.status_code == 201, r.text


async def state_of(c: httpx.AsyncClient, job_id: str) -> dict[str, Any]:
    return dict((await c.get(f"/jobs/{job_id}")).json())


async def until(
    c: httpx.AsyncClient, job_id: str, check: Any, timeout: float = 60
) -> dict[str, Any]:
    """Poll the job under a deadline until ``check(job)`` holds."""
    async with asyncio.timeout(timeout):
        while True:
            job = await state_of(c, job_id)
            if check(job):
                return job
            await asyncio.sleep(0.05)


def kinds(events: list[dict[str, Any]]) -> list[str]:
    return [e["kind"] for e in events]


async def events_of(c: httpx.AsyncClient, job_id: str) -> list[dict[str, Any]]:
    return list((await c.get(f"/jobs/{job_id}/events")).json())


async def test_a_burst_of_jobs_runs_on_every_node_and_fills_every_slot(tmp_path: Path) -> None:
    """12 one-slot jobs at once on 3 nodes x 2 slots: all 6 slots busy, every node runs jobs."""
    with LocalCluster(tmp_path) as cluster:
        await cluster.start_all("n0", "n1", "n2")
        async with cluster.client("n1") as c:
            await asyncio.gather(*(post(c, sleeper(f"b{i:02}", 1.5)) for i in range(12)))
            peak = 0
            async with asyncio.timeout(60):
                while peak < 6:
                    placements = (await c.get("/queue")).json()["placements"]
                    peak = max(peak, sum(len(p["nodes"]) for p in placements.values()))
                    await asyncio.sleep(0.05)
            ran_on: set[str] = set()
            for i in range(12):
                job = await until(c, f"b{i:02}", lambda j: j["state"] == "SUCCEEDED")
                assert job["restart_count"] == 0
                placed = [e for e in await events_of(c, f"b{i:02}") if e["kind"] == "job.placed"]
                ran_on.add(placed[0]["message"].removeprefix("placed on ").split()[0])
            assert ran_on == {"n0", "n1", "n2"}, ran_on


async def test_two_gangs_on_four_nodes_never_deadlock(tmp_path: Path) -> None:
    """2 jobs of min_nodes=3 on 4 one-slot nodes, submitted together, 20 times: one runs whole,
    the other waits whole and is placed as soon as the first ends."""
    with LocalCluster(tmp_path, slots=1) as cluster:
        await cluster.start_all("n0", "n1", "n2", "n3")
        clients = [cluster.client(n) for n in ("n0", "n3")]
        try:
            for rep in range(20):
                ids = [f"g{rep}a", f"g{rep}b"]
                body = {"entrypoint": "true", "min_nodes": 3, "exit_barrier_timeout": 30}
                await asyncio.gather(
                    *(post(c, {"id": i, **body}) for c, i in zip(clients, ids, strict=True))
                )
                jobs = [
                    await until(clients[0], i, lambda j: j["state"] == "SUCCEEDED", 60) for i in ids
                ]
                first, second = sorted(jobs, key=lambda j: j["started_at"])
                assert second["started_at"] >= first["finished_at"] - 0.5, (first, second)
                waited = [
                    e
                    for e in await events_of(clients[0], second["id"])
                    if e["kind"] == "job.queued"
                ]
                assert waited and "needs 3 nodes with 1 free slot" in waited[0]["message"]
        finally:
            for c in clients:
                await c.aclose()


async def test_a_spare_gives_its_slot_to_a_queued_job_at_once(tmp_path: Path) -> None:
    with LocalCluster(tmp_path, slots=1) as cluster:
        await cluster.start_all("n0", "n1", "n2")
        async with cluster.client() as c:
            await post(c, sleeper("pair", 600, min_nodes=2))
            placed = await until(
                c, "pair", lambda j: j["state"] == "RUNNING" and len(j["nodes"] or []) == 3
            )
            spare = placed["nodes"][-1]
            await post(c, sleeper("small", 0.2))
            small = await until(c, "small", lambda j: j["state"] == "SUCCEEDED")
            assert small["restart_count"] == 0
            shrunk = [e for e in await events_of(c, "pair") if e["kind"] == "job.shrunk"]
            assert shrunk and shrunk[0]["by"] == "small" and spare in shrunk[0]["message"]
            pair = await state_of(c, "pair")
            assert pair["state"] == "RUNNING" and pair["restart_count"] == 0
            await c.post("/jobs/pair/cancel", json={})


async def test_an_elastic_job_shrinks_for_a_queued_job_and_grows_back(tmp_path: Path) -> None:
    with LocalCluster(tmp_path, slots=1) as cluster:
        await cluster.start_all("n0", "n1", "n2")
        async with cluster.client() as c:
            await post(c, sleeper("elastic", 600, min_nodes=1, max_nodes=3))
            await until(
                c, "elastic", lambda j: j["state"] == "RUNNING" and len(j["nodes"] or []) == 3
            )
            await post(c, sleeper("gang", 1.0, min_nodes=2))
            gang = await until(c, "gang", lambda j: j["state"] == "SUCCEEDED")
            assert gang["restart_count"] == 0
            shrunk = [e for e in await events_of(c, "elastic") if e["kind"] == "job.shrunk"]
            assert len(shrunk) == 2 and all(e["by"] == "gang" for e in shrunk)
            # Capacity back: the elastic job grows to 3 nodes again, still no restart charged.
            job = await until(
                c, "elastic", lambda j: len(j["nodes"] or []) == 3 and j["state"] == "RUNNING"
            )
            assert job["restart_count"] == 0
            await c.post("/jobs/elastic/cancel", json={})


CHECKPOINTER = """
import os, signal, sys, time
out = sys.argv[1]
with open(out, "a") as f:
    f.write(f"start {os.environ['RANK']} {os.environ['TORCHELASTIC_RESTART_COUNT']}\\n")
def term(*_):
    with open(out, "a") as f:
        f.write(f"checkpoint {os.environ['RANK']}\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, term)
time.sleep(600)
"""


async def test_a_higher_priority_job_preempts_and_the_victim_resumes(tmp_path: Path) -> None:
    """The low-priority job gets SIGTERM (it checkpoints), waits in the queue naming the job that
    preempted it, and resumes as a new attempt with TORCHELASTIC_RESTART_COUNT unchanged."""
    worker = tmp_path / "ckpt.py"
    worker.write_text(CHECKPOINTER)
    notes = tmp_path / "notes.txt"
    with LocalCluster(tmp_path, slots=1) as cluster:
        await cluster.start_all("n0", "n1")
        async with cluster.client("n1") as c:
            low = {
                "id": "low",
                "entrypoint": sys.executable,
                "args": [str(worker), str(notes)],
                "min_nodes": 2,
                "termination_grace": 10,
            }
            await post(c, low)
            await until(c, "low", lambda j: j["state"] == "RUNNING")
            async with asyncio.timeout(30):
                while not notes.exists() or notes.read_text().count("start") < 2:
                    await asyncio.sleep(0.05)
            await post(c, sleeper("high", 1.0, priority=5))
            queued = await until(c, "low", lambda j: j["state"] == "PENDING" and j["queue"])
            assert queued["queue"]["preempted_by"] == "high"
            assert queued["restart_count"] == 0
            high = await until(c, "high", lambda j: j["state"] == "SUCCEEDED")
            assert high["restart_count"] == 0
            await until(c, "low", lambda j: j["state"] == "RUNNING")
            async with asyncio.timeout(30):
                while notes.read_text().count("start") < 4:
                    await asyncio.sleep(0.05)
            lines = notes.read_text().splitlines()
            assert lines.count("checkpoint 0") + lines.count("checkpoint 1") == 2, lines
            assert all(line.endswith(" 0") for line in lines if line.startswith("start")), lines
            events = await events_of(c, "low")
            preempted = [e for e in events if e["kind"] == "job.preempted"]
            assert len(preempted) == 1 and preempted[0]["by"] == "high"
            assert "preempted by job high" in preempted[0]["message"]
            assert (await state_of(c, "low"))["restart_count"] == 0
            await c.post("/jobs/low/cancel", json={})
            await follow_until(c, "low", job_ended, 30)


async def test_queue_lists_priority_then_fifo_and_a_slot_freeing_starts_the_next(
    tmp_path: Path,
) -> None:
    with LocalCluster(tmp_path, slots=1) as cluster:
        await cluster.start_all("n0")
        async with cluster.client() as c:
            await post(c, sleeper("blocker", 600, priority=10))  # nobody preempts it
            await until(c, "blocker", lambda j: j["state"] == "RUNNING")
            for body in (sleeper("a", 0.1), sleeper("b", 0.1), sleeper("c", 0.1, priority=5)):
                await post(c, body)
            async with asyncio.timeout(10):
                while len((await c.get("/queue")).json()["queue"]) < 3:
                    await asyncio.sleep(0.05)
            queue = (await c.get("/queue")).json()["queue"]
            assert [e["job"] for e in queue] == ["c", "a", "b"]
            assert [e["position"] for e in queue] == [1, 2, 3]
            assert (
                queue[0]["message"]
                == "needs 1 node with 1 free slot; 0 matching nodes have them now"
            )
            t0 = time.time()
            await c.post("/jobs/blocker/cancel", json={})
            for job_id in ("c", "a", "b"):
                await until(c, job_id, lambda j: j["state"] == "SUCCEEDED", 30)
            started = {j: (await state_of(c, j))["started_at"] for j in ("c", "a", "b")}
            assert started["c"] < started["a"] < started["b"], started
            assert started["c"] > t0


async def test_when_the_deciding_daemon_dies_another_takes_over(tmp_path: Path) -> None:
    """One daemon decides (it holds sched/leader, bound to its lease); kill -9 it and a job
    submitted afterwards is still placed, by the daemon that took the role over."""
    import base64

    with LocalCluster(tmp_path, slots=1) as cluster:
        await cluster.start_store("store")
        cluster.start("n1")
        cluster.start("n2")
        await asyncio.gather(cluster.wait_ready("n1", via="n1"), cluster.wait_ready("n2"))
        async with cluster.client("store") as s:

            async def leader() -> str | None:
                entry = (await s.get("/store/kv", params={"key": "sched/leader"})).json()["entry"]
                return base64.b64decode(entry["value"]).decode() if entry else None

            async with asyncio.timeout(20):
                while (first := await leader()) is None:
                    await asyncio.sleep(0.05)
            other = "n2" if first == "n1" else "n1"
            cluster.kill9(first, [])
            async with cluster.client(other) as c:
                await post(c, sleeper("after", 0.1))
                job = await until(c, "after", lambda j: j["state"] == "SUCCEEDED", 30)
                assert job["restart_count"] == 0
            assert await leader() == other
