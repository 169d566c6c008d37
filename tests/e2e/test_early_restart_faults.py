"""Early restarts while the store host is kill -9'd and restarted (real daemons).

A one-node job on ``n1`` crash-loops: each restart starts its workers before
the store (hosted by ``n0``) has formed their round. ``n0`` is killed with
SIGKILL in the middle of that and started again on the same port and state
folder. What must hold: the job is never FAILED (its budget is far from
spent), it keeps restarting early once the store is back, every event is
still in order, and no worker of any attempt is left behind when it ends.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

from tests.e2e.cluster import LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

#: Each worker records its pid, lives a moment, and fails (rank 1) or waits for SIGTERM.
LOOP = """
import os, sys, time
open(os.path.join(sys.argv[1], str(os.getpid())), "w").close()
if os.environ["LOCAL_RANK"] == "1":
    time.sleep(0.05)  # a tight loop: most of the agent's time is the restart path
    sys.exit(1)
time.sleep(60)
"""


def alive(folder: Path) -> list[int]:
    out = []
    for p in folder.iterdir():
        try:
            os.kill(int(p.name), 0)
            out.append(int(p.name))
        except ProcessLookupError:
            pass
    return out


async def early_starts(c, job_id: str) -> int:
    events = (await c.get(f"/jobs/{job_id}/events", params={"limit": 10000})).json()
    return sum(1 for e in events if e["kind"] == "workers.started" and e.get("early"))


async def test_early_restarts_survive_a_kill_9_of_the_store_host(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    pids.mkdir()
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    (tmp_path / "cluster").mkdir()
    with LocalCluster(tmp_path / "cluster", lease_ttl=5.0) as cluster:
        cluster.start("n0")
        await cluster.wait_ready("n0")
        cluster.start("n1", "--labels", "pin=1")
        await cluster.wait_ready("n1")
        async with cluster.client("n1") as c:
            r = await c.post(
                "/jobs",
                json={
                    "id": "loop",
                    "entrypoint": sys.executable,
                    "args": [str(script), str(pids)],
                    "nproc_per_node": 2,
                    "max_restarts": 1000,
                    "termination_grace": 2,
                    "node_selector": {"pin": "1"},
                },
            )
            assert r.status_code == 201, r.text
            async with asyncio.timeout(60):
                while await early_starts(c, "loop") < 2:
                    await asyncio.sleep(0.1)
        port = cluster.nodes["n0"].port
        cluster.kill9("n0", [])  # the store host: n1's job is mid-restart or about to be
        await asyncio.sleep(1.0)
        store_url, cluster.store_url = cluster.store_url, None
        cluster.start("n0", port=port)  # same port, same state folder
        cluster.store_url = store_url
        await cluster.wait_ready("n0")
        async with cluster.client("n1") as c:
            before = await early_starts(c, "loop")
            async with asyncio.timeout(60):  # it goes on restarting early
                while await early_starts(c, "loop") < before + 2:
                    await asyncio.sleep(0.1)
            job = (await c.get("/jobs/loop")).json()
            assert job["state"] in ("RUNNING", "RESTARTING"), (job, cluster.logs())
            events = (await c.get("/jobs/loop/events", params={"limit": 10000})).json()
            assert all(e.get("state") != "FAILED" for e in events if e["kind"] == "job.state")
            assert [e["seq"] for e in events] == sorted(e["seq"] for e in events)
            # At most one attempt's workers at a time: the early ones never overlap.
            assert len(alive(pids)) <= 2
            assert (await c.post("/jobs/loop/cancel", json={})).status_code == 200
            async with asyncio.timeout(30):
                while (await c.get("/jobs/loop")).json()["state"] != "CANCELLED":
                    await asyncio.sleep(0.1)
        async with asyncio.timeout(30):
            while alive(pids):
                await asyncio.sleep(0.1)
