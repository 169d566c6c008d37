"""A node-side failure is never charged to the job (issue 23, item 2).

A real ``elasticd serve`` under a tiny descriptor limit (64/64) is flooded
with idle TCP connections (no token is needed to open one). Before issue 23
its 1,000-connection cap let the flood take every descriptor: a restarting
job went FAILED with restart_count 0 ("internal error in the agent ... Too
many open files") and new jobs failed at start-up. Now the daemon caps its
connections at half its limit, and a start the node cannot make (EMFILE) is
retried with a ``workers.spawn_retry`` event until the flood goes away; a
node that cannot start a job for ``node_failure_grace`` gives it back
(``agent.gave_back``) and takes it up again later, never charging it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import events_of, wait_job
from tests.hardening.support import (
    PY,
    Served,
    cgroup_home,
    daemon_subtree,
    eventually,
    script,
    serve,
)

#: Waits for ``go`` in its folder; the first attempt's rank 1 then exits 3 (a real crash,
#: one restart charged), every later attempt exits 0.
WAITER = """
import os, sys, time
here = os.path.dirname(os.path.abspath(__file__))
go = os.path.join(here, "go")
crash = sys.argv[1] == "crash" and os.environ["RANK"] == "1"
marker = os.path.join(here, "crashed")
if crash and os.path.exists(marker):
    sys.exit(0)
while not os.path.exists(go):
    time.sleep(0.02)
if crash:
    open(marker, "w").close()
    sys.exit(3)
"""


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def log_names(daemon: Served, job: str, *kinds: str) -> bool:
    """The daemon's log records an event of one of ``kinds`` for ``job``."""
    text = daemon.output()
    return any(f"job {job}: {kind} " in text for kind in kinds)


class Flood:
    """Keeps ``size`` idle TCP connections open to a port (reopens the ones the daemon closes)."""

    def __init__(self, port: int, size: int) -> None:
        self.port = port
        self.size = size
        self.open = 0
        self._tasks: list[asyncio.Task[None]] = []

    async def _hold(self) -> None:
        while True:
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
            except OSError:
                await asyncio.sleep(0.05)
                continue
            self.open += 1
            try:
                await reader.read()  # until the daemon closes it (refused, or its head timer)
            except OSError:
                pass
            finally:
                self.open -= 1
                writer.close()
            await asyncio.sleep(0.01)

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._hold()) for _ in range(self.size)]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def answers(url: str) -> int | None:
    """The status of ``GET /healthz`` on a fresh connection within 20 s (None: no answer)."""
    try:
        async with httpx.AsyncClient(timeout=20) as c:
            return (await c.get(url + "/healthz")).status_code
    except httpx.HTTPError:
        return None


@pytest.mark.slow
async def test_a_connection_flood_under_a_low_fd_limit_never_fails_a_job(tmp_path: Path) -> None:
    """Under 64/64 descriptors and a flood of 200 idle connections, a restarting job and a job
    starting fresh are never FAILED: their starts are retried (``workers.spawn_retry``) and
    succeed once the flood goes away; only the job's own crash is charged; /healthz answers."""
    worker = script(tmp_path, "waiter.py", WAITER)
    daemon = serve(tmp_path, "--slots", "4", nofile=(64, 64))
    flood = Flood(daemon.port, 200)
    try:
        async with asyncio.timeout(150), daemon.client() as c:
            await daemon.wait_ready()

            async def submit(job_id: str, mode: str, restarts: int) -> None:
                spec = {
                    "id": job_id,
                    "entrypoint": PY,
                    "args": [worker, mode],
                    "nproc_per_node": 2,
                    "max_restarts": restarts,
                }
                r = await c.post("/jobs", json=spec)
                assert r.status_code == 201, r.text

            # "restarting" crashes once at "go" (its restart starts during the flood);
            # "blocker" ends at "go", and "fresh", queued behind it, starts during the flood.
            await submit("restarting", "crash", 3)
            await submit("blocker", "wait", 0)
            await wait_job(c, "restarting", {"RUNNING"})
            await wait_job(c, "blocker", {"RUNNING"})
            r = await c.post(
                "/jobs",
                json={"id": "fresh", "entrypoint": PY, "args": ["-c", "pass"], "nproc_per_node": 2},
            )
            assert r.status_code == 201, r.text
            assert (await c.get("/jobs/fresh")).json()["state"] == "PENDING"

            flood.start()
            pid = daemon.proc.pid
            # The flood holds what the daemon lets it: its cap (half the limit) now.
            await eventually(lambda: flood.open >= 30, 20, "the flood to hold its connections")
            assert open_fds(pid) <= 64
            (tmp_path / "go").touch()  # the crash and the fresh start happen under the flood
            await eventually(
                lambda: all(
                    log_names(daemon, j, "workers.spawn_retry", "agent.error", "job.state FAILED")
                    for j in ("restarting", "fresh")
                ),
                40,
                "both starts to meet the flood",
            )
            held_since = time.monotonic()
            while time.monotonic() - held_since < 2.0:  # a few more retries under the flood
                assert daemon.proc.poll() is None
                await asyncio.sleep(0.1)
            # A probe is served during the flood: it takes the place of the longest-idle
            # connection (before, the flood held the cap and the probe got 503).
            assert flood.open >= 30
            assert await answers(daemon.url) == 200
            await flood.stop()

            # Served again at once (under the flood a fresh connection may wait in the
            # listen queue behind it: the kernel's, not the daemon's, while it has no fd).
            assert await answers(daemon.url) == 200
            restarting = await wait_job(c, "restarting", timeout=60)
            fresh = await wait_job(c, "fresh", timeout=60)
            blocker = await wait_job(c, "blocker", timeout=60)
            for job in (restarting, fresh, blocker):
                assert job["state"] == "SUCCEEDED", job
            assert restarting["restart_count"] == 1, restarting  # its own crash only
            assert fresh["restart_count"] == 0, fresh
            for job_id in ("restarting", "fresh"):
                events = await events_of(c, job_id)
                retries = [e for e in events if e["kind"] == "workers.spawn_retry"]
                assert retries, [e["kind"] for e in events]
                assert all(e["cause"] == "EMFILE" for e in retries), retries
                kinds = {e["kind"] for e in events}
                assert not kinds & {"workers.spawn_failed", "agent.error"}, kinds
    finally:
        await flood.stop()
        daemon.stop()
    assert "descriptor limit 64 (hard 64); serving at most 32 connections" in daemon.output()


@pytest.mark.slow
async def test_the_daemon_raises_its_soft_fd_limit_to_the_hard_one(tmp_path: Path) -> None:
    """Started with a soft limit of 64 under a hard one of 4096, the daemon runs at 4096 and
    serves at most 1000 connections (half, capped), and says so in its log."""
    daemon = serve(tmp_path, nofile=(64, 4096))
    try:
        async with asyncio.timeout(60):
            await daemon.wait_ready()
            soft, hard = resource.prlimit(daemon.proc.pid, resource.RLIMIT_NOFILE)
            assert (soft, hard) == (4096, 4096)
    finally:
        daemon.stop()
    assert "descriptor limit 4096 (hard 4096); serving at most 1000 connections" in daemon.output()


@pytest.mark.slow
async def test_a_node_out_of_descriptors_gives_the_job_back_then_runs_it(tmp_path: Path) -> None:
    """The daemon's soft limit lowered under it (``prlimit``) to what it holds: the job's start
    fails with EMFILE, is retried for ``node_failure_grace`` (2 s), then given back
    (``agent.gave_back``): it waits PENDING with the reason, never FAILED. The limit restored,
    the node takes it up again and it SUCCEEDS with no restart spent."""
    daemon = serve(tmp_path, env={"ELASTICD_NODE_FAILURE_GRACE": "2"})
    pid = daemon.proc.pid
    try:
        async with asyncio.timeout(120), daemon.client() as c:
            await daemon.wait_ready()
            soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
            # Leave the daemon a few descriptors: its answer to this request, no worker.
            resource.prlimit(pid, resource.RLIMIT_NOFILE, (open_fds(pid) + 6, hard))
            try:
                r = await c.post(
                    "/jobs",
                    json={
                        "id": "starved",
                        "entrypoint": PY,
                        "args": ["-c", "pass"],
                        "nproc_per_node": 4,
                    },
                )
                assert r.status_code == 201, r.text
                await eventually(
                    lambda: log_names(
                        daemon, "starved", "agent.gave_back", "agent.error", "job.state FAILED"
                    ),
                    30,
                    "the node to give the job back",
                )
            finally:
                resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
            job = (await c.get("/jobs/starved")).json()
            assert job["state"] == "PENDING", job
            assert "gave the job back" in job["reason"], job
            done = await wait_job(c, "starved", timeout=60)
            assert done["state"] == "SUCCEEDED", done
            assert done["restart_count"] == 0, done
            events = await events_of(c, "starved")
            kinds = [e["kind"] for e in events]
            assert "workers.spawn_retry" in kinds, kinds
            assert "agent.gave_back" in kinds, kinds
            assert kinds.index("agent.gave_back") < kinds.index("workers.started"), kinds
            assert not {"workers.spawn_failed", "agent.error"} & set(kinds), kinds
    finally:
        daemon.stop()


def _subtree_or_skip(daemon: Served) -> Path:
    home = cgroup_home()
    if home is None:
        pytest.skip("needs root and a writable cgroup v2 folder (the daemon's containment)")
    subtree = daemon_subtree(home, "hard-node", daemon.state_dir)
    if not subtree.is_dir():
        pytest.skip(f"the daemon made no cgroup subtree ({subtree}): it runs as a subreaper")
    return subtree


@pytest.mark.slow
async def test_a_cgroup_subtree_removed_under_the_daemon_is_made_again(tmp_path: Path) -> None:
    """An operator's cleanup removes the daemon's (empty) cgroup subtree between jobs: the next
    start makes it again and the job runs, with nothing charged and no failed start."""
    daemon = serve(tmp_path)
    try:
        async with asyncio.timeout(90), daemon.client() as c:
            await daemon.wait_ready()
            subtree = _subtree_or_skip(daemon)
            await eventually(lambda: _only_files(subtree), 10, "the probe cgroup to go")
            subtree.rmdir()
            r = await c.post(
                "/jobs",
                json={"id": "after", "entrypoint": PY, "args": ["-c", "pass"], "nproc_per_node": 2},
            )
            assert r.status_code == 201, r.text
            done = await wait_job(c, "after", timeout=60)
            assert done["state"] == "SUCCEEDED", done
            assert done["restart_count"] == 0, done
            kinds = {e["kind"] for e in await events_of(c, "after")}
            assert not kinds & {"workers.spawn_failed", "agent.error"}, kinds
            assert subtree.is_dir()
    finally:
        daemon.stop()
    assert "cgroup subtree" in daemon.output() and "making it again" in daemon.output()


def _only_files(folder: Path) -> bool:
    """A cgroup folder with no child cgroups (its interface files only)."""
    return not any(entry.is_dir() for entry in folder.iterdir())


@pytest.mark.slow
async def test_a_cgroup_that_refuses_attempts_is_retried_never_charged(tmp_path: Path) -> None:
    """The daemon's subtree refuses new child cgroups (``cgroup.max.descendants`` 0: mkdir is
    EAGAIN): the start is the node's trouble, retried with ``workers.spawn_retry`` events; once
    the limit is lifted the job runs, SUCCEEDED with no restart spent and no failed start."""
    daemon = serve(tmp_path, env={"ELASTICD_NODE_FAILURE_GRACE": "60"})
    try:
        async with asyncio.timeout(90), daemon.client() as c:
            await daemon.wait_ready()
            subtree = _subtree_or_skip(daemon)
            limit = subtree / "cgroup.max.descendants"
            limit.write_text("0\n")
            try:
                r = await c.post(
                    "/jobs",
                    json={"id": "refused", "entrypoint": PY, "args": ["-c", "pass"]},
                )
                assert r.status_code == 201, r.text
                await eventually(
                    lambda: log_names(
                        daemon, "refused", "workers.spawn_retry", "agent.error", "job.state FAILED"
                    ),
                    30,
                    "the start to be retried",
                )
            finally:
                limit.write_text("max\n")
            done = await wait_job(c, "refused", timeout=60)
            assert done["state"] == "SUCCEEDED", done
            assert done["restart_count"] == 0, done
            events = await events_of(c, "refused")
            retries = [e for e in events if e["kind"] == "workers.spawn_retry"]
            assert retries and all(e["cause"] == "EAGAIN" for e in retries), retries
            kinds = {e["kind"] for e in events}
            assert not kinds & {"workers.spawn_failed", "agent.error"}, kinds
    finally:
        daemon.stop()
