"""Structured concurrency (issue 13 point 4): once a daemon has run jobs and shut down, none
of the tasks it (its agents, their races and watches) started is still running."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from api.app import create_app
from tests.conftest import PY, make_daemon, script, wait_job

pytestmark = pytest.mark.timeout(120)

CRASH_ONCE = """
import os, sys
if os.environ["LOCAL_RANK"] == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    sys.exit(3)
"""


async def test_a_daemon_that_ran_jobs_leaves_no_task_behind(tmp_path: Path) -> None:
    before = asyncio.all_tasks()
    daemon = make_daemon(tmp_path)
    async with asyncio.timeout(30):
        await daemon.start()
    try:
        transport = httpx.ASGITransport(app=create_app(daemon))
        async with httpx.AsyncClient(
            transport=transport,
            headers={"Authorization": f"Bearer {daemon.token}"},
            base_url="http://localhost",
        ) as c:
            crash = script(tmp_path, "crash.py", CRASH_ONCE)
            jobs = [
                # a restart, then success (races of monitor, hang watch and round watch)
                {"entrypoint": PY, "args": [crash], "nproc_per_node": 2, "progress_timeout": 30},
                # cancelled while running (the CLOSE path)
                {"entrypoint": PY, "args": ["-c", "import time; time.sleep(60)"]},
            ]
            ids = [(await c.post("/jobs", json=spec)).json()["id"] for spec in jobs]
            assert (await wait_job(c, ids[0]))["state"] == "SUCCEEDED"
            await wait_job(c, ids[1], {"RUNNING"})
            assert (await c.post(f"/jobs/{ids[1]}/cancel", json={})).status_code == 200
            assert (await wait_job(c, ids[1]))["state"] == "CANCELLED"
    finally:
        async with asyncio.timeout(60):
            await daemon.shutdown()
    # Anything the loop still has to run for the daemon is a task that outlived it.
    await asyncio.sleep(0)
    left = [t for t in asyncio.all_tasks() - before if t is not asyncio.current_task()]
    assert [t.get_name() for t in left if not t.done()] == []
