"""A restarted daemon's recovery reads its own group view by which job of the id it was."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from api.app import create_app
from elasticd.keys import group_key
from elasticd.models import GroupView
from elasticd.states import WorkerState
from tests.conftest import PY, make_daemon

pytestmark = pytest.mark.timeout(120)

OLD = "0" * 32  # the tag of a deleted job of the id


async def test_a_deleted_jobs_group_view_does_not_resume_the_new_job_of_its_id(tmp_path):
    """This node's group view of a deleted job of the id, published late (its agent was
    cut off from the store when the id was taken again), is not this node running the
    new job: a restart does not say the new job resumed here, which never ran here.
    Before, ``recover`` took any view under the key as the job's and evented
    ``job.resumed`` (daemon crashed) for a job still waiting to be placed."""
    d = make_daemon(tmp_path, persistent=True)
    async with asyncio.timeout(90):
        await d.start()
        try:
            transport = httpx.ASGITransport(app=create_app(d))
            async with httpx.AsyncClient(
                transport=transport,
                headers={"Authorization": f"Bearer {d.token}"},
                base_url="http://localhost",
            ) as c:
                spec = {"id": "j", "entrypoint": PY, "node_selector": {"gpu": "none-here"}}
                assert (await c.post("/jobs", json=spec)).status_code == 201
                job = (await c.get("/jobs/j")).json()
                assert job["state"] == "PENDING"  # no node has the label: it waits
            old = GroupView(
                node=d.config.node_name,
                state=WorkerState.HEALTHY,
                role="default",
                group_rank=0,
                group_world_size=1,
                attempt=1,
                round=1,
                restart_count=0,
                updated_at=0.0,
                job_tag=OLD,
            )
            await d.store.put(group_key("j", d.config.node_name), old.model_dump_json().encode())
        finally:
            await d.shutdown()

        d2 = make_daemon(tmp_path, persistent=True)
        await d2.start()
        try:
            transport = httpx.ASGITransport(app=create_app(d2))
            async with httpx.AsyncClient(
                transport=transport,
                headers={"Authorization": f"Bearer {d2.token}"},
                base_url="http://localhost",
            ) as c:
                kinds = [e["kind"] for e in (await c.get("/jobs/j/events")).json()]
                job = (await c.get("/jobs/j")).json()
        finally:
            await d2.shutdown()
    assert job["state"] == "PENDING"
    assert "job.submitted" in kinds
    assert "job.resumed" not in kinds
