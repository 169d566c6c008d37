"""A restarted attempt resumes from the job's last checkpoint (ELASTICD_CHECKPOINT_STEP /
_PATH) on real `elasticd serve` daemons: after the node that reported it is lost (rank 0
moves to another node), and when the restart is warm (a prewarmed standby takes over)."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

from tests.conftest import events_of, wait_job
from tests.e2e.cluster import LocalCluster
from tests.e2e.test_prewarm import ready_standbys, served

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

ROOT = Path(__file__).resolve().parents[2]

#: Rank 0 checkpoints step 5 and both ranks wait; an attempt told of a checkpoint writes
#: what it was told, as which rank, and ends.
WORKER = r"""
import os, sys, threading
import elasticd.worker as w
out, rank = sys.argv[1], os.environ["RANK"]
told = os.environ.get("ELASTICD_CHECKPOINT_STEP")
if told is not None:
    with open(os.path.join(out, "told"), "w") as f:
        f.write(f"{rank} {told} {os.environ.get('ELASTICD_CHECKPOINT_PATH')}")
    sys.exit(0)
for step in range(6):
    w.ping(step=step)
if rank == "0":
    w.checkpointed(5, os.path.join(out, "ckpt-5"))
threading.Event().wait()
"""


async def test_the_checkpoint_outlives_the_node_of_rank_0(tmp_path: Path) -> None:
    """Kill the node of rank 0 after its checkpoint: the survivor's new attempt resumes from it."""
    with LocalCluster(tmp_path) as cluster:
        cluster.start("n0")  # the store's host; runs nothing of the job (no label)
        await cluster.wait_ready("n0")
        for name in ("n1", "n2"):
            cluster.start(name, "--labels", "train=1")
        await asyncio.gather(cluster.wait_ready("n1"), cluster.wait_ready("n2"))
        worker = tmp_path / "worker.py"
        worker.write_text(WORKER)
        async with cluster.client("n0") as c:
            r = await c.post(
                "/jobs",
                json={
                    "id": "moves",
                    "entrypoint": sys.executable,
                    "args": [str(worker), str(tmp_path)],
                    "env": {"PYTHONPATH": str(ROOT)},
                    "min_nodes": 1,
                    "max_nodes": 2,
                    "max_restarts": 3,
                    "node_selector": {"train": "1"},
                    "termination_grace": 2,
                },
            )
            assert r.status_code == 201, r.text
            async with asyncio.timeout(60):  # both nodes run it, and the checkpoint is in the job
                while True:
                    groups = (await c.get("/jobs/moves/workers")).json()["groups"]
                    job = (await c.get("/jobs/moves")).json()
                    if len(groups) == 2 and job["progress"]["checkpoint_step"] == 5:
                        break
                    await asyncio.sleep(0.1)
            assert job["progress"]["checkpoint_path"] == str(tmp_path / "ckpt-5")
            first = next(g for g in groups if g["workers"][0]["rank"] == 0)
            survivor = next(g["node"] for g in groups if g is not first)
            cluster.kill9(first["node"], [w["pid"] for w in first["workers"]])
            async with asyncio.timeout(90):
                while (job := (await c.get("/jobs/moves")).json())["state"] != "SUCCEEDED":
                    assert job["state"] not in ("FAILED", "CANCELLED"), (job, cluster.logs())
                    await asyncio.sleep(0.2)
        assert (tmp_path / "told").read_text() == f"0 5 {tmp_path / 'ckpt-5'}"
        assert job["progress"]["checkpoint_step"] == 5
        assert job["restart_count"] == 0  # a node loss is free
        print("rank 0 moved to", survivor)


#: Attempt 0 checkpoints step 5 and waits for $OUT/go, then fails; a later attempt writes
#: what it was told and ends.
WARM = r"""
import os, sys, time
import elasticd.worker as w
out = os.environ["OUT"]
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    for step in range(6):
        w.ping(step=step)
    w.checkpointed(5, os.path.join(out, "ckpt-5"))
    while not os.path.exists(os.path.join(out, "go")):
        time.sleep(0.02)
    sys.exit(3)
with open(os.path.join(out, "told"), "w") as f:
    f.write(f"{os.environ.get('ELASTICD_CHECKPOINT_STEP')} {os.environ.get('ELASTICD_CHECKPOINT_PATH')}")
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="a root daemon, as deployed")
async def test_a_warm_restart_resumes_from_the_checkpoint(tmp_path: Path) -> None:
    """A checkpoint since the standby started does not turn the restart cold, and the warm
    worker is told it."""
    out = tmp_path / "out"
    out.mkdir()
    worker = tmp_path / "warm.py"
    worker.write_text(WARM)
    async with served(tmp_path) as c:
        r = await c.post(
            "/jobs",
            json={
                "id": "warm",
                "entrypoint": sys.executable,
                "args": [str(worker)],
                "env": {"OUT": str(out), "PYTHONPATH": str(ROOT)},
                "max_restarts": 1,
                "gpu_health_check": False,
                "prewarm": ["json"],
            },
        )
        assert r.status_code == 201, r.text
        await ready_standbys(c, "warm", 1)
        async with asyncio.timeout(60):  # the checkpoint is in the job before the failure
            while (await c.get("/jobs/warm")).json()["progress"]["checkpoint_step"] != 5:
                await asyncio.sleep(0.05)
        (out / "go").touch()
        job = await wait_job(c, "warm")
        assert job["state"] == "SUCCEEDED", job
        kinds = [e["kind"] for e in await events_of(c, "warm")]
    assert "workers.warm_start" in kinds and "worker.cold_start" not in kinds, kinds
    assert (out / "told").read_text() == f"5 {out / 'ckpt-5'}"
