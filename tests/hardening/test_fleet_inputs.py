"""Hostile but authenticated input cannot stop the fleet (issue 22 #6 and the design gap).

Each test runs real `elasticd serve` daemons on loopback sharing one store,
writes what a store writer could (the /store routes, with the cluster
token, bypassing every check of ``POST /jobs``) and shows that jobs
submitted as users do are still placed and run.
"""

from __future__ import annotations

import asyncio
import base64
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.cluster import LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def sleeper(job_id: str, seconds: float = 0.1) -> dict[str, Any]:
    return {
        "id": job_id,
        "entrypoint": sys.executable,
        "args": ["-c", "import sys, time; time.sleep(float(sys.argv[1]))", str(seconds)],
        "termination_grace": 2,
    }


def job_document(job_id: str, **spec: Any) -> dict[str, Any]:
    """A job document as the daemons store it, written by hand."""
    return {
        "id": job_id,
        "spec": {"id": job_id, **sleeper(job_id, 600), **spec},
        "state": "PENDING",
        "max_restarts": 0,
        "created_at": time.time() - 60,  # first in the queue
    }


async def store_put(c: httpx.AsyncClient, key: str, value: bytes, lease: int | None = None) -> None:
    body = {"key": key, "value": base64.b64encode(value).decode(), "lease": lease}
    r = await c.put("/store/kv", json=body)
    assert r.status_code == 200, r.text


async def until_state(c: httpx.AsyncClient, job_id: str, state: str, timeout: float = 60) -> None:
    async with asyncio.timeout(timeout):
        while (await c.get(f"/jobs/{job_id}")).json().get("state") != state:
            await asyncio.sleep(0.05)


async def queue_entry(c: httpx.AsyncClient, job_id: str, timeout: float = 30) -> dict[str, Any]:
    async with asyncio.timeout(timeout):
        while True:
            queue = (await c.get("/queue")).json()["queue"]
            entry = next((e for e in queue if e["job"] == job_id), None)
            if entry is not None:
                return dict(entry)
            await asyncio.sleep(0.05)


async def test_a_job_that_breaks_planning_does_not_stop_the_fleet(tmp_path: Path) -> None:
    """A stored job whose selector overflows the queue message is flagged; other jobs still run."""
    with LocalCluster(tmp_path) as cluster:
        await cluster.start_all("n0", "n1")
        async with cluster.client("n0") as c:
            # 40 labels of 100 characters: within the API's bounds, far past the queue
            # message's 2,000 characters (the old planner raised and its task died).
            wide = {f"label{i:02}": "v" * 100 for i in range(40)}
            await store_put(
                c, "job/wide", json.dumps(job_document("wide", node_selector=wide)).encode()
            )
            # And one whose selector value is 3,000 characters: refused as a job document.
            huge = job_document("huge", node_selector={"zone": "z" * 3000})
            await store_put(c, "job/huge", json.dumps(huge).encode())
            # Through the API, such a selector is a 422 naming the field.
            r = await c.post("/jobs", json={**sleeper("api"), "node_selector": {"z": "z" * 3000}})
            assert r.status_code == 422 and "node_selector" in r.text, r.text
            entry = await queue_entry(c, "wide")
            assert entry["reason"] == "unplaceable" and len(entry["message"]) <= 2000
            r = await c.post("/jobs", json=sleeper("after"))
            assert r.status_code == 201, r.text
            await until_state(c, "after", "SUCCEEDED")
            # Cancelled, the bad job leaves the queue and the fleet goes on placing.
            r = await c.post("/jobs/wide/cancel", json={})
            assert r.status_code == 200, r.text
            await until_state(c, "wide", "CANCELLED")
            r = await c.post("/jobs", json=sleeper("later"))
            assert r.status_code == 201, r.text
            await until_state(c, "later", "SUCCEEDED")
            assert "wide" not in {e["job"] for e in (await c.get("/queue")).json()["queue"]}
        logs = "".join(n.log.read_text() for n in cluster.nodes.values())
        assert "Traceback" not in logs and "pass failed" not in logs


async def test_a_squatted_leader_record_is_taken_over(tmp_path: Path) -> None:
    """sched/leader written by hand, without a lease, is replaced, and jobs are placed."""
    with LocalCluster(tmp_path) as cluster:
        await cluster.start_all("n0", "n1")
        async with cluster.client("n0") as c:
            await store_put(c, "sched/leader", b"n1")  # names a real node, but no lease
            r = await c.post("/jobs", json=sleeper("placed"))
            assert r.status_code == 201, r.text
            await until_state(c, "placed", "SUCCEEDED")
            async with asyncio.timeout(20):
                while True:
                    entry = (await c.get("/store/kv", params={"key": "sched/leader"})).json()
                    if entry["entry"] and entry["entry"]["lease"] is not None:
                        break
                    await asyncio.sleep(0.05)
            assert base64.b64decode(entry["entry"]["value"]).decode() in ("n0", "n1")


async def test_a_node_record_with_unbounded_slots_gets_no_job(tmp_path: Path) -> None:
    """A published node claiming a billion slots is ignored: every job runs on real nodes."""
    with LocalCluster(tmp_path) as cluster:
        await cluster.start_all("n0", "n1")
        async with cluster.client("n0") as c:
            lease = (await c.post("/store/leases", json={"ttl": 600})).json()["lease"]
            ghost = {
                "name": "ghost",
                "url": "http://127.0.0.1:9",
                "addr": "127.0.0.1",
                "labels": {},
                "slots": 10**9,
                "free_slots": 10**9,
                "version": "0",
                "started_at": time.time(),
            }
            await store_put(c, "nodes/ghost", json.dumps(ghost).encode(), lease)
            for i in range(3):
                r = await c.post("/jobs", json=sleeper(f"j{i}"))
                assert r.status_code == 201, r.text
            for i in range(3):
                await until_state(c, f"j{i}", "SUCCEEDED")
                events = (await c.get(f"/jobs/j{i}/events")).json()
                placed = [e["message"] for e in events if e["kind"] == "job.placed"]
                assert placed and not any("ghost" in m for m in placed), placed
        logs = "".join(n.log.read_text() for n in cluster.nodes.values())
        assert "ignoring the node record 'nodes/ghost'" in logs
