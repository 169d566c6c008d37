"""The merged /events view keeps each node's own order, with etcd (issue 12, defect 7).

Three daemons on a 3-member etcd cluster run a 3-node job whose workers crash
and are restarted until the budget is spent, and etcd is killed (every
member) and restarted meanwhile, so events pile up unpublished and go out
together. Afterwards each node's events in ``GET /jobs/{id}/events`` must be
exactly that node's own record (its SQLite), in its order: nothing lost,
nothing swapped.
"""

from __future__ import annotations

import asyncio
import sys

import pytest

from tests.e2e.cluster import job_ended
from tests.e2e.etcd_cluster import daemons_on, own_events, shown_events

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

LEASE_TTL = 3.0
NODES = ("n0", "n1", "n2")
#: A worker that runs a moment, then fails: every attempt is a burst of events.
CRASHER = "import time; time.sleep(1.5); raise SystemExit(3)"


@pytest.fixture
def cluster(tmp_path, etcd):
    with daemons_on(tmp_path, LEASE_TTL) as c:
        yield c


def out_of_order(shown: list[tuple[str, float, str]], own: list[tuple[str, float, str]]) -> int:
    """How many of ``shown`` come right after an event the node recorded later (a diagnostic)."""
    place = {event: i for i, event in enumerate(own)}
    ranks = [place.get(event, -1) for event in shown]
    return sum(1 for a, b in zip(ranks, ranks[1:], strict=False) if b < a)


async def test_each_nodes_events_keep_their_order_through_crashes_and_an_etcd_outage(cluster, etcd):
    """Workers crash 4 times on 3 nodes, etcd is down for 4 s in between: the merged view holds
    every node's events, each node's in its own order."""
    for i, name in enumerate(NODES):
        cluster.store_url = etcd.endpoints(first=i)
        cluster.start(name)
    await asyncio.gather(*(cluster.wait_ready(n) for n in NODES))
    async with cluster.client("n0") as c:
        r = await c.post(
            "/jobs",
            json={
                "id": "order",
                "entrypoint": sys.executable,
                "args": ["-c", CRASHER],
                "min_nodes": 3,
                "max_nodes": 3,
                "max_restarts": 4,
                "termination_grace": 1,
            },
        )
        assert r.status_code == 201, r.text
        async with asyncio.timeout(60):  # the first attempt has failed somewhere
            while not any(
                e["kind"] == "worker.exited" or e["kind"] == "job.restarting"
                for e in (await c.get("/jobs/order/events")).json()
            ):
                await asyncio.sleep(0.2)
        etcd.kill_all()  # events go on being recorded locally, unpublished
        await asyncio.sleep(4.0)  # the outage itself lasts this long
        etcd.start()

        async with asyncio.timeout(120):
            while True:
                r = await c.get("/jobs/order/events")
                if r.status_code == 200 and job_ended(r.json()):
                    break
                await asyncio.sleep(0.5)
            # Until every node's record has reached the store and the view is quiet.
            while True:
                merged = (await c.get("/jobs/order/events")).json()
                own = {n: own_events(cluster, n, "order") for n in NODES}
                shown = {n: shown_events(merged, n) for n in NODES}
                if all(len(shown[n]) >= len(own[n]) for n in NODES):
                    break
                await asyncio.sleep(0.5)
    seqs = [e["seq"] for e in merged]
    assert seqs == sorted(set(seqs)), "merged seqs must be unique and increasing"
    for n in NODES:
        assert shown[n] == own[n], f"{n}: {out_of_order(shown[n], own[n])} of {len(own[n])} swapped"
    assert sum(len(own[n]) for n in NODES) > 60  # the run produced what it was meant to
