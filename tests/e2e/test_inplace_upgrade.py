"""The in-place upgrade on a cluster (issue 25): re-executing the daemon that hosts the embedded
store, then the one that leads the fleet scheduler, is invisible to the other nodes: a running
3-node job keeps every worker, its round and its restart count; nobody re-forms."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.cluster import LocalCluster
from tests.hardening.support import PY, script

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]

WORKER = """
import time
from elasticd.worker import ping
while True:
    ping()
    time.sleep(0.05)
"""


async def groups(c: httpx.AsyncClient, job_id: str) -> dict[str, list[int]]:
    """Each node's HEALTHY worker pids (from the group views every node publishes)."""
    view = (await c.get(f"/jobs/{job_id}/workers")).json()
    return {
        g["node"]: [w["pid"] for w in g["workers"]]
        for g in view.get("groups", [])
        if g["state"] == "HEALTHY"
    }


async def leader(c: httpx.AsyncClient) -> str:
    from elasticd.store.codec import decode_entry

    r = await c.get("/store/kv", params={"key": "sched/leader"})
    assert r.status_code == 200, r.text
    return decode_entry(r.json()["entry"]).value.decode()


async def reexec(cluster: LocalCluster, name: str, timeout: float = 90) -> None:
    """SIGHUP to ``name``; return once a new image of the same process is ready."""
    node = cluster.nodes[name]
    async with cluster.client(name) as c:
        before = (await c.get("/healthz")).json()
        node.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + timeout
        while True:
            assert node.proc.poll() is None, node.log.read_text()[-3000:]
            try:
                now = (await c.get("/healthz", timeout=2)).json()
                ready = (await c.get("/readyz", timeout=2)).status_code == 200
                if now["started_at"] != before["started_at"] and ready:
                    assert now["pid"] == before["pid"]
                    return
            except (httpx.TransportError, ValueError):
                pass
            assert time.monotonic() < deadline, cluster.logs()
            await asyncio.sleep(0.05)


async def test_reexec_of_the_store_host_and_the_leader_does_not_reform(tmp_path: Path) -> None:
    """A 3-node job runs; the store host (n0, which also leads the scheduler after a plain
    start) re-executes, then another node (the leader, if n0 is not): every
    worker keeps its pid, the job its round and restart count, the leader its leadership, and
    no node re-forms (no new rendezvous round, no worker stopped). The gap of the store host's
    re-exec is shorter than the lease TTL, which is what the other nodes tolerate."""
    worker = script(tmp_path, "worker.py", WORKER)
    with LocalCluster(tmp_path, lease_ttl=10.0) as cluster:
        async with asyncio.timeout(300):
            await cluster.start_all("n0", "n1", "n2")
            async with cluster.client("n0") as c:
                spec: dict[str, Any] = {
                    "id": "three",
                    "entrypoint": PY,
                    "args": [worker],
                    "env": {"PYTHONPATH": str(ROOT)},
                    "min_nodes": 3,
                    "max_nodes": 3,
                    "nproc_per_node": 1,
                    "termination_grace": 2,
                }
                assert (await c.post("/jobs", json=spec)).status_code == 201
                while len(before := await groups(c, "three")) < 3:
                    await asyncio.sleep(0.1)
                job = (await c.get("/jobs/three")).json()
                first_leader = await leader(c)
            await reexec(cluster, "n0")  # the store host
            second = first_leader if first_leader != "n0" else "n1"
            await reexec(cluster, second)
            async with cluster.client("n0") as c:
                await asyncio.sleep(3 * 1.0)  # a node that re-forms says so within a second
                assert await groups(c, "three") == before
                after = (await c.get("/jobs/three")).json()
                assert (after["state"], after["round"], after["restart_count"]) == (
                    "RUNNING",
                    job["round"],
                    0,
                ), after
                assert await leader(c) == first_leader
                events = (await c.get("/jobs/three/events", params={"limit": 1000})).json()
                kinds = [e["kind"] for e in events]
                assert kinds.count("rendezvous.complete") == 3, kinds  # the first round only
                assert "workers.stopped" not in kinds
                assert "rendezvous.change" not in kinds
                assert "job.resumed" not in kinds
                readopted = sorted(e["node"] for e in events if e["kind"] == "job.readopted")
                assert readopted == sorted(["n0", second])
