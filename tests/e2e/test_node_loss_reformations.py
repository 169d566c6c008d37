"""One node loss costs exactly one re-formation (issue 12, defect 4).

The workers stand in for a collective without torch: rank 0 listens on
``MASTER_PORT``, every other rank connects to it, and a worker exits 1 the
moment a peer's connection breaks, as a gloo or NCCL collective fails when a
peer dies. One node (not the store host) is killed with its workers; the
survivors must start their workers exactly twice in all (the first round and
one re-formation), also after the dead node's lease has run out; and that
re-formation must not wait out the last call for the dead node, whose lease
still lives (it never said it was leaving the round: presumed dead after
``ack_timeout``).
"""

from __future__ import annotations

import asyncio
import sys

import pytest

from tests.e2e.cluster import LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

WORKER = r"""
import os, socket, sys, time
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
if rank == 0:
    srv = socket.create_server((addr, port))
    peers = [srv.accept()[0] for _ in range(world - 1)]
    with open(os.path.join(sys.argv[1], f"formed-{world}"), "w"):
        pass  # the "collective" is up: a peer's death now fails it
else:
    deadline = time.monotonic() + 60
    while True:
        try:
            peers = [socket.create_connection((addr, port))]
            break
        except OSError:
            if time.monotonic() > deadline:
                sys.exit(2)
            time.sleep(0.05)
import selectors
sel = selectors.DefaultSelector()
for p in peers:
    sel.register(p, selectors.EVENT_READ)
while True:  # a peer's socket becomes readable only when it closes: the "collective" fails
    for key, _ in sel.select():
        if not key.fileobj.recv(1):
            sys.exit(1)
"""


@pytest.fixture
def cluster(tmp_path):
    with LocalCluster(tmp_path) as c:
        yield c


async def groups(c, job_id: str) -> dict[str, dict]:
    return {g["node"]: g for g in (await c.get(f"/jobs/{job_id}/workers")).json()["groups"]}


LAST_CALL = 5.0  # longer than the lease: waiting it out would show


async def rendezvous_times(c, job_id: str) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {}
    for e in (await c.get(f"/jobs/{job_id}/events", params={"limit": 10_000})).json():
        if e["kind"] == "rendezvous.complete":
            times.setdefault(e["node"], []).append(e["duration_s"])
    return times


async def starts(c, job_id: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for e in (await c.get(f"/jobs/{job_id}/events", params={"limit": 10_000})).json():
        if e["kind"] == "workers.started":
            counts[e["node"]] = counts.get(e["node"], 0) + 1
    return counts


@pytest.mark.parametrize(("nodes", "max_nodes"), [(3, 4), (5, 5)])
async def test_one_node_loss_costs_one_reformation(cluster, tmp_path, nodes, max_nodes):
    names = [f"n{i}" for i in range(nodes)]
    await cluster.start_all(*names)
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    async with cluster.client("n0") as c:
        r = await c.post(
            "/jobs",
            json={
                "id": "loss",
                "entrypoint": sys.executable,
                "args": [str(worker), str(tmp_path)],
                "min_nodes": 2,
                "max_nodes": max_nodes,
                "max_restarts": 5,
                "termination_grace": 2,
                "last_call_timeout": LAST_CALL,
            },
        )
        assert r.status_code == 201, r.text
        async with asyncio.timeout(60):
            while True:
                found = await groups(c, "loss")
                if len(found) == nodes and all(g["state"] == "HEALTHY" for g in found.values()):
                    break
                await asyncio.sleep(0.1)
        assert set((await starts(c, "loss")).values()) == {1}
        formed = tmp_path / f"formed-{nodes}"
        async with asyncio.timeout(30):
            while not formed.exists():
                await asyncio.sleep(0.05)
        victim = names[-1]
        cluster.kill9(victim, [w["pid"] for w in found[victim]["workers"]])
        survivors = set(names[:-1])
        async with asyncio.timeout(60):
            while True:
                found = await groups(c, "loss")
                healthy = {n for n, g in found.items() if g["state"] == "HEALTHY"}
                if healthy == survivors and all(
                    found[n]["group_world_size"] == nodes - 1 for n in survivors
                ):
                    break
                await asyncio.sleep(0.1)
        # Past the dead node's lease (2 s) and then some: no further re-formation.
        await asyncio.sleep(cluster.lease_ttl + 3)
        counts = await starts(c, "loss")
        assert {n: counts.get(n) for n in survivors} == dict.fromkeys(survivors, 2), (
            counts,
            cluster.logs(),
        )
        job = (await c.get("/jobs/loss")).json()
        assert job["state"] == "RUNNING", job
        # The re-formation did not wait out the last call (the old code took LAST_CALL).
        times = await rendezvous_times(c, "loss")
        print("re-formation rendezvous (s):", {n: round(times[n][1], 3) for n in survivors})
        assert all(len(times[n]) == 2 and times[n][1] < LAST_CALL / 2 for n in survivors), times
