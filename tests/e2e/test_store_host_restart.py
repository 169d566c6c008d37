"""Restarting the daemon that hosts the embedded store fails no job (issue 12, defect 1).

``n0`` hosts the store and runs one of the three nodes of a job. It is
killed with SIGKILL (its worker dies with it) and started again on the same
port and state folder. The store keeps its leases across the restart, so
the other two nodes, still alive, stay members: the job carries on, ``n0``
comes back into it as an arriving node, and nothing is failed.
"""

from __future__ import annotations

import asyncio
import signal
import sys

import pytest

from tests.e2e.cluster import LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

LEASE_TTL = 5.0


@pytest.fixture
def cluster(tmp_path):
    with LocalCluster(tmp_path, lease_ttl=LEASE_TTL) as c:
        yield c


async def groups(c, job_id: str) -> dict[str, dict]:
    view = (await c.get(f"/jobs/{job_id}/workers")).json()
    return {g["node"]: g for g in view["groups"]}


async def running_on(c, job_id: str, nodes: set[str], timeout: float) -> None:
    async with asyncio.timeout(timeout):
        while True:
            found = await groups(c, job_id)
            if all(found.get(n, {}).get("state") == "HEALTHY" for n in nodes):
                return
            await asyncio.sleep(0.1)


@pytest.mark.parametrize(("how", "downtime"), [("kill", 1.0), ("term", 1.0), ("kill", 30.0)])
async def test_a_restart_of_the_store_host_fails_no_job(cluster, how, downtime):
    """SIGKILL or SIGTERM of n0, back 1 s or 30 s later: the job is never failed, n0 rejoins."""
    await cluster.start_all("n0", "n1", "n2")
    async with cluster.client("n1") as c:
        r = await c.post(
            "/jobs",
            json={
                "id": "carry-on",
                "entrypoint": sys.executable,
                "args": ["-c", "import time; time.sleep(600)"],
                "min_nodes": 2,
                "max_nodes": 3,
                "termination_grace": 2,
            },
        )
        assert r.status_code == 201, r.text
        await running_on(c, "carry-on", {"n0", "n1", "n2"}, 40)
        pids = [w["pid"] for w in (await groups(c, "carry-on"))["n0"]["workers"]]
    port = cluster.nodes["n0"].port
    if how == "kill":
        cluster.kill9("n0", pids)
    else:
        cluster.nodes["n0"].proc.send_signal(signal.SIGTERM)
        assert cluster.nodes["n0"].proc.wait(30) == 0
    await asyncio.sleep(downtime)  # the outage itself
    store_url, cluster.store_url = cluster.store_url, None
    cluster.start("n0", port=port)  # same port, same state folder
    cluster.store_url = store_url
    await cluster.wait_ready("n0")
    async with cluster.client("n1") as c:
        # n0 comes back into the job; the others never stop being members.
        await running_on(c, "carry-on", {"n0", "n1", "n2"}, 60)
        job = (await c.get("/jobs/carry-on")).json()
        assert job["state"] in ("RUNNING", "RESTARTING"), (job, cluster.logs())
        events = (await c.get("/jobs/carry-on/events")).json()
        kinds = [e["kind"] for e in events]
        assert "job.orphaned" not in kinds, cluster.logs()
        assert all(e.get("state") != "FAILED" for e in events if e["kind"] == "job.state")
