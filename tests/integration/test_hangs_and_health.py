"""Hang detection (progress heartbeats), health checks before every start, last_progress_at."""

from __future__ import annotations

import asyncio
import stat
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx

from api.app import create_app
from tests.conftest import PY, events_of, make_daemon, script, wait_job
from tests.e2e.fault_support import report

PING_THEN_BLOCK = """
import os, sys, threading, time
import elasticd.worker as w
w.ping()
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["LOCAL_RANK"] == "1":
    threading.Event().wait()  # alive but stuck: pings no more
# Rank 1 runs on, pinging, for 3 s after rank 0 ends: the agent reads the heartbeats (and
# so times recovery.first_progress) when a worker exits or a deadline comes, and a group
# whose workers all end at once may end before any read (it did on a loaded machine).
for _ in range(3 if os.environ["LOCAL_RANK"] == "0" else 60):
    w.ping()
    time.sleep(0.05)
"""


async def test_hung_worker_is_detected_dumped_and_restarted(client, tmp_path):
    """A worker that pings then blocks turns the group UNHEALTHY, gets its stacks dumped, restarts."""
    path = script(tmp_path, "hang.py", PING_THEN_BLOCK)
    r = await client.post(
        "/jobs",
        json={
            "entrypoint": PY,
            "args": [path],
            "nproc_per_node": 2,
            "progress_timeout": 1.0,
            "termination_grace": 2,
        },
    )
    job = await wait_job(client, r.json()["id"])
    assert job["state"] == "SUCCEEDED"
    assert job["restart_count"] == 1  # a hang spends one restart
    assert "hung" in job["error"]["message"] and job["error"]["rank"] == 1
    events = await events_of(client, job["id"])
    hang = next(e for e in events if e["kind"] == "worker.hang")
    assert hang["rank"] == 1 and hang["state"] == "UNHEALTHY"
    assert 1.0 <= hang["duration_s"] < 5 and "no progress" in hang["message"]
    report("worker hang", "last ping -> hang detected", hang["duration_s"])
    report("worker hang", "hang detected -> group respawned", job["last_recovery"]["total_s"])
    states = [e["state"] for e in events if e["kind"] == "group.state"]
    assert "UNHEALTHY" in states
    stacks = next(e for e in events if e["kind"] == "worker.stacks")
    assert stacks["rank"] == 1
    log = await client.get(
        f"/jobs/{job['id']}/logs", params={"local_rank": 1, "attempt": 0, "stream": "stderr"}
    )
    assert "File " in log.text or "py-spy" in stacks["message"]  # faulthandler's dump, or py-spy's
    kinds = [e["kind"] for e in events]
    assert "recovery.first_progress" in kinds


async def test_worker_that_never_pings_hits_the_startup_timeout(client, tmp_path):
    """With startup_timeout, a worker that never pings is declared hung."""
    path = script(tmp_path, "silent.py", "import time; time.sleep(600)\n")
    r = await client.post(
        "/jobs",
        json={
            "entrypoint": PY,
            "args": [path],
            "startup_timeout": 0.5,
            "max_restarts": 0,
            "termination_grace": 1,
        },
    )
    job = await wait_job(client, r.json()["id"])
    assert job["state"] == "FAILED"
    hang = next(e for e in await events_of(client, job["id"]) if e["kind"] == "worker.hang")
    assert "has not reported progress since it started" in hang["message"]


async def test_last_progress_at_is_published(client, tmp_path):
    """A worker that keeps pinging shows last_progress_at in GET /jobs/{id}/workers."""
    flag = tmp_path / "stop"
    path = script(
        tmp_path,
        "ping.py",
        f"""
        import os, time
        import elasticd.worker as w
        while not os.path.exists({str(flag)!r}):
            w.ping()
            time.sleep(0.05)
    """,
    )
    r = await client.post(
        "/jobs",
        json={
            "entrypoint": PY,
            "args": [path],
            "progress_timeout": 0.5,
            "termination_grace": 1,
        },
    )
    job_id = r.json()["id"]
    await wait_job(client, job_id, {"RUNNING"})
    import asyncio

    async with asyncio.timeout(20):
        while True:
            view = (await client.get(f"/jobs/{job_id}/workers")).json()
            worker = view["groups"][0]["workers"][0] if view["groups"] else {}
            if worker.get("last_progress_at"):
                break
            await asyncio.sleep(0.1)
    assert worker["last_progress_at"] > worker["started_at"] - 1
    flag.touch()
    assert (await wait_job(client, job_id))["state"] == "SUCCEEDED"


async def test_failing_health_check_spends_the_budget_then_fails(client, tmp_path):
    """A health check that fails before every start spends a restart each time, then FAILs the job."""
    r = await client.post(
        "/jobs",
        json={
            "entrypoint": PY,
            "args": ["-c", "pass"],
            "max_restarts": 1,
            "health_check": [PY, "-c", "import sys; print('disk full'); sys.exit(3)"],
        },
    )
    job = await wait_job(client, r.json()["id"])
    assert job["state"] == "FAILED" and job["restart_count"] == 1
    assert "health check failed" in job["reason"]
    kinds = [e["kind"] for e in await events_of(client, job["id"])]
    assert kinds.count("health.failed") == 2 and "workers.started" not in kinds


@asynccontextmanager
async def daemon_client(tmp_path: Path, **config: Any) -> AsyncIterator[httpx.AsyncClient]:
    """A daemon with ``config`` and a client over ASGI."""
    d = make_daemon(tmp_path, **config)
    async with asyncio.timeout(30):
        await d.start()
    try:
        transport = httpx.ASGITransport(app=create_app(d))
        async with httpx.AsyncClient(
            transport=transport,
            headers={"Authorization": f"Bearer {d.token}"},
            base_url="http://localhost",
        ) as c:
            yield c
    finally:
        async with asyncio.timeout(60):
            await d.shutdown()


async def test_fake_nvidia_smi_reporting_a_bad_gpu_quarantines_the_node(tmp_path):
    """The built-in GPU check runs the operator's nvidia-smi (config `nvidia_smi`); a bad GPU
    fails the check, which quarantines the node (issue 37): the job is not charged and does
    not fail for the node's trouble, it waits in the queue for a healthy node."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "nvidia-smi"
    fake.write_text(
        "#!/bin/sh\necho 'Unable to determine the device handle for GPU0: GPU is lost'\nexit 15\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    async with daemon_client(tmp_path, nvidia_smi=str(fake)) as client:
        r = await client.post(
            "/jobs", json={"entrypoint": PY, "args": ["-c", "pass"], "max_restarts": 0}
        )
        job_id = r.json()["id"]
        async with asyncio.timeout(30):
            while (await client.get("/nodes")).json()[0]["state"] != "quarantined":
                await asyncio.sleep(0.05)
            while (job := (await client.get(f"/jobs/{job_id}")).json())["queue"] is None:
                await asyncio.sleep(0.05)
        (node,) = (await client.get("/nodes")).json()
        failed = [e for e in await events_of(client, job_id) if e["kind"] == "health.failed"]
    assert failed and "gpu" in failed[0]["message"].lower()
    assert "GPU is lost" in node["reason"], node
    assert (job["state"], job["restart_count"]) == ("PENDING", 0), job


async def test_an_xid_in_the_kernel_log_fails_the_gpu_check_and_quarantines_the_node(tmp_path):
    """nvidia-smi says the GPU is healthy, but the driver logged Xid 79 (fallen off the bus)
    after the daemon started: the GPU check fails on it, naming it, and the node is
    quarantined; the job before the Xid ran."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho '0, 00000000:3B:00.0, NVIDIA H100, 0, No'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    kmsg = tmp_path / "kmsg"
    kmsg.write_text("3,1,1,-;NVRM: Xid (PCI:0000:3b:00): 79, before the daemon: handled\n")
    async with daemon_client(tmp_path, nvidia_smi=str(fake), kernel_log=str(kmsg)) as client:
        spec = {"entrypoint": PY, "args": ["-c", "pass"], "max_restarts": 0}
        first = await wait_job(client, (await client.post("/jobs", json=spec)).json()["id"])
        assert first["state"] == "SUCCEEDED", first
        with kmsg.open("a") as log:
            log.write(
                "3,2,2,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=7, GPU has fallen off the bus.\n"
            )
        job_id = (await client.post("/jobs", json=spec)).json()["id"]
        async with asyncio.timeout(30):
            while (node := (await client.get("/nodes")).json()[0])["state"] != "quarantined":
                await asyncio.sleep(0.05)
        failed = [e for e in await events_of(client, job_id) if e["kind"] == "health.failed"]
        job = (await client.get(f"/jobs/{job_id}")).json()
    assert "Xid 79 on PCI:0000:3b:00 (GPU has fallen off the bus)" in failed[0]["message"]
    assert "Xid 79" in node["reason"], node
    assert job["state"] == "PENDING", job


async def test_gpu_check_is_skipped_with_an_event_without_nvidia_smi(tmp_path):
    """Where nvidia-smi is absent the GPU check is skipped, with an event saying so."""
    async with daemon_client(tmp_path, nvidia_smi=str(tmp_path / "no" / "nvidia-smi")) as client:
        r = await client.post("/jobs", json={"entrypoint": PY, "args": ["-c", "pass"]})
        job = await wait_job(client, r.json()["id"])
        assert job["state"] == "SUCCEEDED"
        events = await events_of(client, job["id"])
    skipped = [e for e in events if e["kind"] == "health.skipped"]
    assert skipped and "is not there" in skipped[0]["message"]


async def test_inprocess_job_has_only_the_hung_rank_killed(client, tmp_path):
    """With inprocess_restart, a rank past its progress deadline is killed alone; the rest finish."""
    path = script(
        tmp_path,
        "one_hangs.py",
        """
        import os, threading, time
        import elasticd.worker as w
        w.ping()
        if os.environ["LOCAL_RANK"] == "1":
            threading.Event().wait()  # stuck; the daemon must kill this rank only
        for _ in range(40):
            w.ping()
            time.sleep(0.05)
    """,
    )
    r = await client.post(
        "/jobs",
        json={
            "entrypoint": PY,
            "args": [path],
            "nproc_per_node": 2,
            "progress_timeout": 0.6,
            "inprocess_restart": True,
            "max_restarts": 0,
            "termination_grace": 1,
        },
    )
    job = await wait_job(client, r.json()["id"])
    assert job["state"] == "SUCCEEDED" and job["restart_count"] == 0
    events = await events_of(client, job["id"])
    hang = next(e for e in events if e["kind"] == "worker.hang")
    assert hang["rank"] == 1 and "killing this rank only" in hang["message"]
    exits = {e["rank"]: e for e in events if e["kind"] == "worker.exited"}
    assert exits[1]["signal"] == 9 and exits[0]["exit_code"] == 0
    assert [e["kind"] for e in events].count("workers.started") == 1  # no group restart
