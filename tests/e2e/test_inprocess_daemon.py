"""In-process restart with the daemon as the external monitor (real torch gloo, 2 ranks)."""

from __future__ import annotations

import re

import pytest

from tests.conftest import PY, ROOT
from tests.e2e.cluster import LocalCluster, follow_until, job_ended

pytestmark = [pytest.mark.slow, pytest.mark.torch]
pytest.importorskip("torch")

TRAIN = str(ROOT / "examples" / "inprocess_train.py")


def enters(text: str) -> list[dict[str, str]]:
    return [
        dict(re.findall(r"(\w+)=(\S+)", line))
        for line in text.splitlines()
        if line.startswith("enter ")
    ]


async def test_killed_rank_is_reported_and_the_survivor_continues_in_process(tmp_path):
    """A rank's process dies; the daemon tells the survivor, which re-enters with world 1, same pid."""
    cluster = LocalCluster(tmp_path)
    try:
        await cluster.start_all("n0")
        async with cluster.client("n0") as c:
            r = await c.post(
                "/jobs",
                json={
                    "id": "ip",
                    "entrypoint": PY,
                    "args": [TRAIN],
                    "nproc_per_node": 2,
                    "max_restarts": 0,
                    "inprocess_restart": True,
                    "termination_grace": 3,
                    "env": {"FAULT": "exit", "FAULT_RANK": "1", "FAULT_STEP": "2", "STEPS": "4"},
                },
            )
            assert r.status_code == 201
            await follow_until(c, "ip", job_ended, 100)
            job = (await c.get("/jobs/ip")).json()
            assert job["state"] == "SUCCEEDED", cluster.logs()
            assert job["restart_count"] == 0  # no process restart was needed
            log = (await c.get("/jobs/ip/logs", params={"local_rank": 0})).text
            seen = enters(log)
            assert [e["iteration"] for e in seen] == ["0", "1"]
            assert [e["world"] for e in seen] == ["2", "1"]  # ShiftRanks drops the dead rank
            assert seen[0]["pid"] == seen[1]["pid"]  # restarted inside the same process
            assert "done result=" in log
            exits = [
                e for e in (await c.get("/jobs/ip/events")).json() if e["kind"] == "worker.exited"
            ]
            assert {e["rank"]: e["exit_code"] for e in exits} == {1: 3, 0: 0}
    finally:
        cluster.stop_all()
