"""A daemon restarted or stopped says nothing of a new job of a deleted job's id that it never ran."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from elasticd.keys import group_key, job_key
from elasticd.models import GroupView, Job, incarnation, incarnation_tag
from elasticd.node.daemon import Daemon
from elasticd.states import JobState, WorkerState
from tests.conftest import PY, asgi_client, make_daemon, script, wait_job

pytestmark = pytest.mark.timeout(120)

OLD = "0" * 32  # the tag of a deleted job of the id


#: A job no node can run (no node has the label): it waits to be placed.
WAITING = {"id": "j", "entrypoint": PY, "node_selector": {"gpu": "none-here"}}


async def _submit_waiting(d: Daemon) -> Job:
    async with asgi_client(d) as c:
        assert (await c.post("/jobs", json=WAITING)).status_code == 201
    return await d.jobs.documents.read("j")


async def _seen(d: Daemon, job: Job) -> None:
    """Until the daemon's look at the store shows ``job`` under its id."""
    while (known := d.jobs.reconciler.known.get(job.id)) is None or incarnation(
        known
    ) != incarnation(job):
        await asyncio.sleep(0.02)


async def _after_restart(tmp_path: Path) -> tuple[dict[str, Any], list[str]]:
    """Job ``j`` and its events' kinds, as the daemon of ``tmp_path`` started again serves them."""
    d = make_daemon(tmp_path, persistent=True)
    await d.start()
    try:
        async with asgi_client(d) as c:
            kinds = [e["kind"] for e in (await c.get("/jobs/j/events")).json()]
            return (await c.get("/jobs/j")).json(), kinds
    finally:
        await d.shutdown()


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
            assert (await _submit_waiting(d)).state is JobState.PENDING
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

        job, kinds = await _after_restart(tmp_path)
    assert job["state"] == "PENDING"
    assert "job.submitted" in kinds
    assert "job.resumed" not in kinds


async def test_a_daemon_stop_is_not_said_of_the_new_job_of_a_deleted_jobs_id(tmp_path):
    """The daemon stops while the agent of a deleted job still stops its workers, and the
    id names a new job, waiting to be placed, that never ran here: the stop is not the new
    job's. Before, ``stop_all`` read the id's document and evented ``daemon.stopped`` with
    the new job's tag (a RUNNING one would have been made RESTARTING)."""
    release = tmp_path / "release"
    ready = tmp_path / "ready"
    worker = script(
        tmp_path,
        "stubborn.py",
        f"""
        import os, signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # stops only when released
        open({str(ready)!r}, "w").close()
        while not os.path.exists({str(release)!r}):
            time.sleep(0.05)
        """,
    )
    d = make_daemon(tmp_path, persistent=True)
    async with asyncio.timeout(100):
        await d.start()
        stopping: asyncio.Task[object] | None = None
        try:
            async with asgi_client(d) as c:
                old = {"id": "j", "entrypoint": PY, "args": [worker], "termination_grace": 60}
                assert (await c.post("/jobs", json=old)).status_code == 201
                while not ready.exists():
                    await asyncio.sleep(0.05)
                assert (await c.post("/jobs/j/cancel", json={})).status_code in (200, 202)
                await wait_job(c, "j", {"CANCELLED"})
                assert (await c.delete("/jobs/j")).status_code in (200, 204)
                assert (await c.post("/jobs", json=WAITING)).status_code == 201
            supervisor = d.jobs.supervisor
            while not supervisor.agents["j"].orphaned:  # this node saw the delete
                await asyncio.sleep(0.05)
            assert "j" in supervisor.tasks  # the precondition: its workers still stop
            stopping = asyncio.create_task(d.shutdown())
            await asyncio.sleep(0)
        finally:
            release.touch()
            await (stopping or asyncio.create_task(d.shutdown()))

        job, kinds = await _after_restart(tmp_path)
    assert job["state"] == "PENDING"
    assert "job.submitted" in kinds
    assert "daemon.stopped" not in kinds


async def test_a_job_seen_replaced_between_two_looks_leaves_no_events_of_the_old_one_here(
    tmp_path,
):
    """A node that sees the id name another job without seeing the delete in between (one
    look at the store shows the old document, the next the new one) drops its events of
    the old job, as a delete it saw would have: before, they stayed in its database for
    as long as the new job was kept, and counted in its retention."""
    d = make_daemon(tmp_path)
    async with asyncio.timeout(60):
        await d.start()
        try:
            old = await _submit_waiting(d)
            await _seen(d, old)  # one look shows the old job
            # and the scheduler has said its word on it (no pass of it lands later)
            while "job.unschedulable" not in [e.kind for e in d.events.read("j")]:
                await asyncio.sleep(0.02)
            assert {e.job_tag for e in d.events.read("j")} == {incarnation_tag(old)}
            # Deleted and submitted again, as one change: the same key, a new job.
            new = old.model_copy(update={"created_at": old.created_at + 1.0})
            await d.store.put(job_key("j"), new.model_dump_json().encode())
            await _seen(d, new)  # the next the new one
            await d.db.backlog.wait_empty()
            left = [e.job_tag for e in d.events.read("j")]
        finally:
            await d.shutdown()
    assert incarnation_tag(old) not in left
