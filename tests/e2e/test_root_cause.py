"""The root cause a job reports is what its first failing rank died of (issue 37).

A plain DDP script, no ``@record``: after ``init_process_group`` torch prints
every traceback line with a ``[rankN]: `` prefix, and the job's error is still
the exception line of the failing rank's ``stderr.log`` (the last exception of
a chain), not "worker exited with code 1". Across nodes, the first failure in
time is the root cause and the survivors' ("connection reset by peer") are
labelled collateral.
"""

from __future__ import annotations

import pytest

from tests.conftest import PY, script, wait_job

pytestmark = [pytest.mark.slow, pytest.mark.torch]
pytest.importorskip("torch")

DDP = """
import os
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank = dist.get_rank()
model = DDP(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(5):
    opt.zero_grad()
    model(torch.ones(8, 4)).sum().backward()
    opt.step()
    if rank == 1 and step == 2:
        CRASH
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
