"""The root cause a job reports is what its first failing rank died of (issue 37).

A plain DDP script, no ``@record``: after ``init_process_group`` torch prints
every traceback line with a ``[rankN]: `` prefix, and the job's error is still
the exception line of the failing rank's ``stderr.log`` (the last exception of
a chain), not "worker exited with code 1". Across nodes, the first failure in
time is the root cause and the survivors' ("connection reset by peer") are
labelled collateral. A hang's cause is the rank whose stack differs: asleep in
Python while the others wait in a gloo all-reduce.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.conftest import PY, ROOT, script, wait_job
from tests.e2e.cluster import LocalCluster, follow_until, job_ended

pytestmark = [pytest.mark.slow, pytest.mark.torch]
pytest.importorskip("torch")

DDP = """
import os
import sys
import time
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank = dist.get_rank()
model = DDP(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)

def train():
    for step in range(5):
        opt.zero_grad()
        model(torch.ones(8, 4)).sum().backward()
        opt.step()
        if rank == 1 and step == 2:
            CRASH


try:
    train()
except Exception:
    if not os.environ.get("EXIT_AT_ONCE"):
        raise
    sys.excepthook(*sys.exc_info())  # torch's: the lines rank-prefixed
    sys.stderr.flush()
    if rank == 1:
        time.sleep(1.0)  # a slow teardown: the culprit exits well after its error
    os._exit(1)  # the survivors die at once of losing it
print("done", flush=True)
"""

PLAIN = 'raise RuntimeError("rank 1 crashes at step 2")'
CHAINED = """try:
                {}["batch"]
            except KeyError as exc:
                raise RuntimeError("rank 1 crashes at step 2") from exc"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("crash", [PLAIN, CHAINED], ids=["plain", "chained"])
async def test_a_ddp_rank_that_raises_is_the_root_cause_without_record(client, tmp_path, crash):
    """The job's error is rank 1's exception line from its rank-prefixed stderr.log."""
    path = script(tmp_path, "ddp.py", DDP.replace("CRASH", crash))
    r = await client.post(
        "/jobs",
        json={"entrypoint": PY, "args": [path], "nproc_per_node": 2, "max_restarts": 0},
    )
    job = await wait_job(client, r.json()["id"], timeout=150)
    assert job["state"] == "FAILED", job
    error = job["error"]
    assert error["message"] == "RuntimeError: rank 1 crashes at step 2", error
    assert (error["rank"], error["source"]) == (1, "log")
    assert error["traceback"].startswith("Traceback (most recent call last):")
    assert "[rank1]" not in error["traceback"]
    if crash is CHAINED:
        assert "KeyError: 'batch'" in error["traceback"]
    log = await client.get(f"/jobs/{job['id']}/logs", params={"local_rank": 1, "stream": "stderr"})
    assert "[rank1]: RuntimeError: rank 1 crashes at step 2" in log.text


@pytest.fixture
def cluster(tmp_path):
    c = LocalCluster(tmp_path, slots=1)
    try:
        yield c
    finally:
        c.stop_all()


async def _run_on_three(
    cluster: LocalCluster, job_id: str, path: str, timeout: float, **spec: Any
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Start 3 daemons, run ``path`` on them, one worker each, no restart: its events until
    it ended, and the job then."""
    await cluster.start_all("n0", "n1", "n2")
    async with cluster.client("n0") as c:
        r = await c.post(
            "/jobs",
            json={
                "id": job_id, "entrypoint": PY, "args": [path], "nproc_per_node": 1,
                "min_nodes": 3, "max_nodes": 3, "max_restarts": 0, **spec,
            },
        )  # fmt: skip
        assert r.status_code == 201, r.text
        events = await follow_until(c, job_id, job_ended, timeout)
        return events, (await c.get(f"/jobs/{job_id}")).json()


@pytest.mark.timeout(240)
async def test_across_nodes_the_first_failure_is_the_cause_and_the_others_collateral(
    cluster, tmp_path
):
    """3 nodes, rank 1 raises: it is `error`; the survivors' gloo errors are `collateral`.

    The culprit prints its traceback and exits a second later (a slow teardown); the
    survivors die at once of losing it, before their agents see the round change, so all
    three exits are reaped together and the survivors' are recorded first: the culprit's
    error, a second earlier, still comes first."""
    path = script(tmp_path, "ddp.py", DDP.replace("CRASH", PLAIN))
    _, job = await _run_on_three(
        cluster, "ddp3", path, 200, termination_grace=3, env={"EXIT_AT_ONCE": "1"}
    )
    assert job["state"] == "FAILED", cluster.logs()
    error = job["error"]
    assert (error["rank"], error["message"]) == (1, "RuntimeError: rank 1 crashes at step 2")
    assert error["collateral"] is False
    collateral = job["collateral"]
    assert collateral, job  # the survivors' "connection closed" failures
    assert all(c["collateral"] and c["node"] != error["node"] for c in collateral)
    assert all(c["since_round_s"] >= error["since_round_s"] for c in collateral)
    proc = await asyncio.create_subprocess_exec(
        PY, "-m", "elasticd", "status", "ddp3", "--url", cluster.nodes["n2"].url,
        "--token-file", str(cluster.token_file),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=ROOT,
    )  # fmt: skip
    async with asyncio.timeout(60):
        out, err = await proc.communicate()
    text = out.decode()
    assert proc.returncode == 0, err.decode()
    assert "root cause  rank 1" in text and "rank 1 crashes at step 2" in text
    assert text.count("collateral") == len(collateral), text


HUNG = """
import time
import torch
import torch.distributed as dist
import elasticd.worker as w

dist.init_process_group("gloo")
rank = dist.get_rank()


def slow_step():
    time.sleep(600)  # alive, in Python, and no progress: the others wait for it


def train():
    t = torch.ones(4)
    for step in range(1000):
        w.ping(step=step)
        if rank == 1 and step == 3:
            slow_step()
        dist.all_reduce(t)
        time.sleep(0.1)


train()
"""


@pytest.mark.timeout(150)
@pytest.mark.parametrize("recorder", [False, True], ids=["stacks", "flight-recorder"])
async def test_a_hung_rank_is_named_with_its_stack(cluster, tmp_path, recorder):
    """3 nodes, rank 1 sleeps while ranks 0 and 2 wait in all_reduce: every rank goes silent,
    every node dumps its ranks' stacks, and the job's error names rank 1, on its node, in
    slow_step; the ranks in all_reduce are not the cause. With torch's flight recorder on
    (the job's `TORCH_FR_BUFFER_SIZE`), rank 1 is named as behind in collectives: it
    issued 3, the others 4."""
    path = script(tmp_path, "hung.py", HUNG)
    env = {"TORCH_FR_BUFFER_SIZE": "200"} if recorder else {}
    events, job = await _run_on_three(
        cluster, "hung3", path, 120, progress_timeout=5 if recorder else 3,
        termination_grace=2, env=env,
    )  # fmt: skip
    assert job["state"] == "FAILED", cluster.logs()
    error = job["error"]
    assert error["rank"] == 1 and error["local_rank"] == 0, error
    if recorder:
        assert error["message"].startswith(
            f"rank 1 on {error['node']} is behind in collectives (3 issued, "
        ), error
        assert "at up to 4): it hung in slow_step" in error["message"], error
        assert any(s["rank"] == 1 and s["collectives"] == 3 for s in error["stacks"]), error
    else:
        assert "slow_step" in error["message"] and "all_reduce" in error["message"], error
        assert error["message"].startswith(f"rank 1 on {error['node']} hung in slow_step"), error
    stacks = [e for e in events if e["kind"] == "worker.stacks"]
    # Every node dumps its ranks when it sees the hang; one whose rank died first of a
    # peer's stop (a loaded machine) has none to dump, and the others' still decide.
    assert 1 in {e["rank"] for e in stacks} and len(stacks) >= 2, stacks
    slept = next(e for e in stacks if e["rank"] == 1)
    assert slept["node"] == error["node"] and "slow_step" in slept["message"], slept
    assert any(s["rank"] == 1 and "slow_step" in s["stack"] for s in error["stacks"]), error
    assert all(c["rank"] != 1 and c["collateral"] for c in job["collateral"]), job["collateral"]
    assert "rank 1 on" in job["reason"] and "slow_step" in job["reason"], job["reason"]
