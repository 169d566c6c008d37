"""Local scheduling: slots are allocated per job, jobs queue for free slots, selectors are honoured."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from api.app import create_app
from tests.conftest import PY, events_of, make_daemon, script, wait_job


@pytest.fixture
async def small(tmp_path):
    d = make_daemon(tmp_path, slots=2, labels="gpu=a100")
    async with asyncio.timeout(30):
        await d.start()
    transport = httpx.ASGITransport(app=create_app(d))
    try:
        async with httpx.AsyncClient(
            transport=transport,
            headers={"Authorization": f"Bearer {d.token}"},
            base_url="http://localhost",
        ) as c:
            yield c
    finally:
        async with asyncio.timeout(60):
            await d.shutdown()


async def test_jobs_queue_for_free_slots(small, tmp_path):
    """A job that needs slots held by another waits PENDING and starts when they free up."""
    sleeper = script(tmp_path, "sleep.py", "import time; time.sleep(600)\n")
    a = (
        await small.post(
            "/jobs",
            json={
                "id": "a",
                "entrypoint": PY,
                "args": [sleeper],
                "nproc_per_node": 2,
                "termination_grace": 1,
            },
        )
    ).json()
    await wait_job(small, a["id"], {"RUNNING"})
    b = (
        await small.post(
            "/jobs", json={"id": "b", "entrypoint": PY, "args": ["-c", "pass"], "nproc_per_node": 1}
        )
    ).json()
    assert (await small.get("/jobs/b")).json()["state"] == "PENDING"
    await small.post("/jobs/a/cancel", json={})
    assert (await wait_job(small, "a"))["state"] == "CANCELLED"
    assert (await wait_job(small, b["id"]))["state"] == "SUCCEEDED"


async def test_job_larger_than_the_fleet_is_flagged_not_failed(small):
    """nproc_per_node above every node's slots: flagged unplaceable with the numbers, never FAILED.

    Nodes may join later; a job fails only for its own workers or its budget.
    """
    r = await small.post("/jobs", json={"id": "big", "entrypoint": PY, "nproc_per_node": 3})
    assert r.status_code == 201
    async with asyncio.timeout(10):
        while True:
            job = (await small.get("/jobs/big")).json()
            if job["queue"] is not None:
                break
            await asyncio.sleep(0.02)
    assert job["state"] == "PENDING"
    assert job["queue"]["reason"] == "unplaceable"
    assert "needs 1 node with 3 slots" in job["queue"]["message"]
    assert "the cluster has 0 such nodes" in job["queue"]["message"]
    kinds = [e["kind"] for e in await events_of(small, "big")]
    assert kinds.count("job.unschedulable") == 1
    queue = (await small.get("/queue")).json()
    assert [e["job"] for e in queue["queue"]] == ["big"]
    await small.post("/jobs/big/cancel", json={})


async def test_node_selector_is_honoured(small):
    """A job whose selector matches runs; one that does not stays PENDING (another node may take it)."""
    ok = await small.post(
        "/jobs", json={"entrypoint": PY, "args": ["-c", "pass"], "node_selector": {"gpu": "a100"}}
    )
    assert (await wait_job(small, ok.json()["id"]))["state"] == "SUCCEEDED"
    other = await small.post("/jobs", json={"entrypoint": PY, "node_selector": {"gpu": "h100"}})
    assert (await small.get(f"/jobs/{other.json()['id']}")).json()["state"] == "PENDING"
    cancelled = await small.post(f"/jobs/{other.json()['id']}/cancel", json={})
    assert cancelled.json()["state"] == "CANCELLED"
