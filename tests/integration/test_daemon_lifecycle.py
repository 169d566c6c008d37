"""The daemon's lifecycle (issue 13 point 5): a state enum, a start that rolls back what it
acquired when a step fails, and a spawn policy that is each daemon's own, passed in."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import httpx
import pytest

from api.app import create_app
from elasticd.errors import ConfigError, StoreUnavailable
from elasticd.node.daemon import DaemonState
from tests.conftest import PY, make_daemon, wait_job

pytestmark = pytest.mark.timeout(60)


async def test_a_start_that_fails_half_way_releases_what_it_took(tmp_path: Path) -> None:
    """The HTTP port is taken: start() fails after the database and the store are open; both
    are closed again, the state is CLOSED, and a daemon on the same state folder starts."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        daemon = make_daemon(tmp_path, persistent=True, port=port)
        daemon._serve_http = True  # the test daemons normally serve over ASGI only
        assert daemon.state is DaemonState.NEW
        with pytest.raises(ConfigError, match="cannot listen"):
            await daemon.start()
        assert daemon.state is DaemonState.CLOSED
        assert not daemon.db.is_open
        with pytest.raises(StoreUnavailable, match="closed"):
            await daemon.store.get("any")
        await daemon.shutdown()  # harmless after a rolled-back start
        with pytest.raises(RuntimeError, match="cannot start from state closed"):
            await daemon.start()
    finally:
        taken.close()
    again = make_daemon(tmp_path, persistent=True)
    async with again:
        assert again.state is DaemonState.RUNNING
        assert again.ready
    assert again.state is DaemonState.CLOSED


async def test_two_daemons_in_one_process_each_spawn_with_their_own_policy(
    tmp_path: Path,
) -> None:
    """Before, the policy was process-wide ("the most recently started daemon"): the workers
    of the first daemon were recorded in the second one's database."""
    first = make_daemon(tmp_path / "a", node_name="node-a")
    second = make_daemon(tmp_path / "b", node_name="node-b")
    async with first, second:
        transport = httpx.ASGITransport(app=create_app(first))
        async with httpx.AsyncClient(
            transport=transport,
            headers={"Authorization": f"Bearer {first.token}"},
            base_url="http://localhost",
        ) as c:
            spec = {"entrypoint": PY, "args": ["-c", "import time; time.sleep(60)"]}
            r = await c.post("/jobs", json=spec)
            assert r.status_code == 201, r.text
            job_id = r.json()["id"]
            await wait_job(c, job_id, {"RUNNING"})
            # The spawn was recorded (for the start-up sweep) by the daemon that made it.
            assert [w.job_id for w in first.db.recorded_workers()] == [job_id]
            assert second.db.recorded_workers() == []
            assert (await c.post(f"/jobs/{job_id}/cancel", json={})).status_code == 200
            assert (await wait_job(c, job_id))["state"] == "CANCELLED"


async def test_the_spawn_probes_run_at_start_not_at_the_first_spawn(tmp_path: Path) -> None:
    """``setpriv`` and (with cgroups) ``perl`` are each probed by running them: done once, in a
    thread while the daemon starts, so no worker's spawn blocks the event loop on it."""
    from elasticd.supervise.spawn import find_perl, find_setpriv

    find_setpriv.cache_clear()
    find_perl.cache_clear()
    daemon = make_daemon(tmp_path)
    async with asyncio.timeout(30):
        await daemon.start()
    try:
        assert find_setpriv.cache_info().currsize == 1
        expected = 1 if daemon.jobs.spawn_policy.containment is not None else 0
        assert find_perl.cache_info().currsize == expected
    finally:
        async with asyncio.timeout(60):
            await daemon.shutdown()
