"""Bearer auth on every endpoint but /healthz; jobs and events survive a daemon restart."""

from __future__ import annotations

import asyncio
import os

import httpx

from api.app import create_app
from tests.conftest import PY, make_daemon, script, wait_job


async def test_token_required_everywhere_but_healthz(tmp_path):
    """Without the token every endpoint but /healthz is 401 problem+json; with it, 2xx."""
    d = make_daemon(tmp_path, token="s3cret")
    async with asyncio.timeout(60):
        await d.start()
        try:
            transport = httpx.ASGITransport(app=create_app(d))
            async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
                assert (await c.get("/healthz")).status_code == 200
                for method, path in [
                    ("GET", "/jobs"),
                    ("POST", "/jobs"),
                    ("GET", "/readyz"),
                    ("GET", "/jobs/x/workers"),
                    ("GET", "/jobs/x/events"),
                    ("POST", "/jobs/x/cancel"),
                    ("GET", "/store/kv?key=a"),
                ]:
                    r = await c.request(method, path, json={"entrypoint": PY})
                    assert r.status_code == 401, path
                    assert r.headers["content-type"].startswith("application/problem+json")
                    assert "Bearer" in r.json()["detail"]
                wrong = await c.get("/jobs", headers={"Authorization": "Bearer nope"})
                assert wrong.status_code == 401 and "not valid" in wrong.json()["detail"]
                ok = await c.get("/jobs", headers={"Authorization": "Bearer s3cret"})
                assert ok.status_code == 200
        finally:
            await d.shutdown()


async def test_restart_keeps_finished_jobs_and_resumes_running_ones(tmp_path):
    """After a restart finished jobs and events read back identically; a running job resumes."""
    sleeper = script(tmp_path, "sleep.py", "import time; time.sleep(600)\n")
    d = make_daemon(tmp_path, persistent=True)
    async with asyncio.timeout(90):
        await d.start()
        transport = httpx.ASGITransport(app=create_app(d))
        async with httpx.AsyncClient(
            transport=transport,
            headers={"Authorization": f"Bearer {d.token}"},
            base_url="http://localhost",
        ) as c:
            r = await c.post("/jobs", json={"id": "done", "entrypoint": PY, "args": ["-c", "pass"]})
            await wait_job(c, "done")
            before_job = (await c.get("/jobs/done")).json()
            before_events = (await c.get("/jobs/done/events")).json()
            before_workers = (await c.get("/jobs/done/workers")).json()
            r = await c.post(
                "/jobs",
                json={"id": "live", "entrypoint": PY, "args": [sleeper], "termination_grace": 1},
            )
            assert r.status_code == 201
            await wait_job(c, "live", {"RUNNING"})
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
                assert (await c.get("/jobs/done")).json() == before_job
                assert (await c.get("/jobs/done/events")).json() == before_events
                assert (await c.get("/jobs/done/workers")).json() == before_workers
                while True:  # the first attempt's events are there; wait for the second's
                    kinds = [e["kind"] for e in (await c.get("/jobs/live/events")).json()]
                    if kinds.count("workers.started") == 2:
                        break
                    await asyncio.sleep(0.05)
                assert "daemon.stopped" in kinds and "job.resumed" in kinds
                live = (await c.get("/jobs/live")).json()
                assert live["restart_count"] == 0 and live["state"] in ("RUNNING", "RESTARTING")
        finally:
            await d2.shutdown()


async def test_readyz_reflects_accepting_jobs(daemon, client):
    """/readyz is 200 while the daemon accepts jobs and 503 once it stops accepting; POST /jobs
    too. Either way it reports the daemon's pid and start, as /healthz does."""
    ready = await client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["pid"] == os.getpid()
    assert ready.json()["started_at"] == (await client.get("/healthz")).json()["started_at"]
    daemon.jobs.stop_accepting()
    stopping = await client.get("/readyz")
    assert stopping.status_code == 503 and stopping.json()["pid"] == os.getpid()
    r = await client.post("/jobs", json={"entrypoint": PY})
    assert r.status_code == 503 and "shutting down" in r.json()["detail"]
