"""A rendezvous closed while its job still runs: it is opened again, the job runs on.

Whoever ends a job writes its end before closing its rendezvous, so a closed rendezvous of
a job still active was closed by something else: the late close of an agent of a deleted
job of the same id (on any node: it lands after the delete and the new submission), or a
writer of the store. Before, every agent of the job then ended as for a finished job, and
the job stayed RUNNING with nothing running it, for ever.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import httpx
import pytest

from elasticd.rendezvous.layout import state_key
from elasticd.store.codec import decode_entry, encode_value
from tests.conftest import wait_job
from tests.hardening.support import serve

pytestmark = [pytest.mark.slow]

#: Each attempt writes its pid to $OUT/pid.<restart count>, then waits for $OUT/done.
WAITS_FOR_DONE = r"""
import os, sys, time
out = os.environ["OUT"]
with open(f"{out}/pid.{os.environ['TORCHELASTIC_RESTART_COUNT']}.{os.getpid()}", "w"):
    pass
while not os.path.exists(f"{out}/done"):
    time.sleep(0.02)
"""


async def _healthy_pids(c: httpx.AsyncClient, job_id: str) -> list[int]:
    view = (await c.get(f"/jobs/{job_id}/workers")).json()
    return [
        w["pid"] for g in view.get("groups", []) if g["state"] == "HEALTHY" for w in g["workers"]
    ]


async def _until_healthy(c: httpx.AsyncClient, job_id: str, other_than: set[int]) -> list[int]:
    deadline = time.monotonic() + 60
    while True:
        pids = await _healthy_pids(c, job_id)
        if pids and not set(pids) & other_than:
            return pids
        assert time.monotonic() < deadline, f"no new HEALTHY workers of {job_id}: {pids}"
        await asyncio.sleep(0.05)


async def test_a_running_jobs_rendezvous_closed_by_another_is_opened_again(
    tmp_path: Path,
) -> None:
    """A running job's rendezvous is closed behind its back (as an old agent's late close
    writes it): its agent opens it again as it was, its workers run on (the same pids,
    one attempt), and the job then succeeds, charged nothing; the daemon logs why."""
    out = tmp_path / "out"
    out.mkdir()
    probe = tmp_path / "probe.py"
    probe.write_text(WAITS_FOR_DONE)
    daemon = serve(tmp_path)
    try:
        await daemon.wait_ready(60)
        async with asyncio.timeout(150), daemon.client() as c:
            body = {
                "id": "reopened",
                "entrypoint": sys.executable,
                "args": [str(probe)],
                "env": {"OUT": str(out)},
                "gpu_health_check": False,
                "max_restarts": 0,
            }
            assert (await c.post("/jobs", json=body)).status_code == 201
            first = await _until_healthy(c, "reopened", set())
            deadline = time.monotonic() + 30  # HEALTHY once spawned: its first line may lag
            while not list(out.glob("pid.*")):
                assert time.monotonic() < deadline, "the worker never wrote its pid"
                await asyncio.sleep(0.05)

            key = state_key("reopened")
            answer = await c.get("/store/kv", params={"key": key})
            assert answer.status_code == 200, answer.text
            entry = decode_entry(answer.json()["entry"])
            doc = json.loads(entry.value)
            assert doc["closed"] is False
            doc["closed"] = True  # what an old job's agent's close writes
            closed = {"key": key, "value": encode_value(json.dumps(doc).encode())}
            assert (await c.put("/store/kv", json=closed)).status_code == 200

            deadline = time.monotonic() + 60
            while True:  # the agent saw the closure, and opened it again as it was
                answer = await c.get("/store/kv", params={"key": key})
                again = json.loads(decode_entry(answer.json()["entry"]).value)
                if not again["closed"]:
                    break
                assert time.monotonic() < deadline, "the rendezvous stayed closed"
                await asyncio.sleep(0.05)
            assert again["round"] == doc["round"], again
            assert await _healthy_pids(c, "reopened") == first  # nothing restarted
            assert len(list(out.glob("pid.*"))) == 1
            job = (await c.get("/jobs/reopened")).json()
            assert job["state"] == "RUNNING", job
            (out / "done").touch()
            job = await wait_job(c, "reopened", timeout=60)
            assert job["state"] == "SUCCEEDED", job
            assert job["restart_count"] == 0, job
    finally:
        daemon.stop()
    assert "was closed while it runs: opening it again" in daemon.output()
