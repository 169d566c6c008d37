"""Real torch gloo jobs: the env contract with init_process_group + all_reduce, and @record error files."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from tests.conftest import PY, ROOT, events_of, script, wait_job

pytestmark = [pytest.mark.slow, pytest.mark.torch]
pytest.importorskip("torch")

CRASH_ONCE = str(ROOT / "examples" / "train_crash_once.py")


async def test_gloo_job_recovers_and_root_cause_comes_from_the_error_file(client):
    """A 2-worker gloo job all-reduces, rank 1's @record error reaches events and the job; retry succeeds."""
    r = await client.post(
        "/jobs",
        json={"entrypoint": PY, "args": [CRASH_ONCE], "nproc_per_node": 2, "termination_grace": 5},
    )
    job = await wait_job(client, r.json()["id"], timeout=120)
    assert job["state"] == "SUCCEEDED", job
    assert job["restart_count"] == 1
    assert job["error"]["message"] == "RuntimeError: rank 1 crashes on purpose on the first attempt"
    assert "Traceback" in job["error"]["traceback"] and job["error"]["rank"] == 1
    exited = [
        e for e in await events_of(client, job["id"]) if e["kind"] == "worker.exited" and e["error"]
    ]
    assert exited and exited[0]["error"]["message"].startswith("RuntimeError: rank 1 crashes")
    for rank in (0, 1):
        log = await client.get(f"/jobs/{job['id']}/logs", params={"local_rank": rank})
        assert f"rank {rank}/2 attempt 1: all_reduce sum 3 (ok)" in log.text


async def test_failed_torch_job_reports_the_earliest_failure(client, tmp_path):
    """With several ranks failing, the job's error is the first failure by error-file timestamp."""
    path = script(
        tmp_path,
        "both_fail.py",
        """
        import os, time
        from torch.distributed.elastic.multiprocessing.errors import record

        @record
        def main():
            rank = int(os.environ["RANK"])
            if rank == 0:
                time.sleep(2.5)  # error-file timestamps have one-second resolution
            raise ValueError(f"rank {rank} failed")

        main()
    """,
    )
    r = await client.post(
        "/jobs", json={"entrypoint": PY, "args": [path], "nproc_per_node": 2, "max_restarts": 0}
    )
    job = await wait_job(client, r.json()["id"], timeout=120)
    assert job["state"] == "FAILED"
    assert job["error"]["message"] == "ValueError: rank 1 failed"
    assert job["error"]["rank"] == 1


async def test_elasticd_run_is_torchrun_standalone(tmp_path):
    """`elasticd run -- python train.py` streams rank-prefixed output and exits with the job's result."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "elasticd",
        "run",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "2",
        "--termination-grace",
        "5",
        "--tee",
        "3",
        "--log-dir",
        str(tmp_path / "logs"),
        "--",
        PY,
        CRASH_ONCE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=ROOT,
    )
    async with asyncio.timeout(120):
        out, err = await proc.communicate()
    text, errtext = out.decode(), err.decode()
    assert proc.returncode == 0, errtext
    # Teed: torchrun's prefix, role and local rank.
    assert "[default0]:rank 0/2 attempt 1: all_reduce sum 3 (ok)" in text
    assert "[default1]:rank 1/2 attempt 1: all_reduce sum 3 (ok)" in text
    assert "SUCCEEDED after 1 restart" in errtext


def test_elasticd_run_exits_nonzero_when_the_job_fails(tmp_path):
    """A job that fails past its budget makes `elasticd run` exit 1 with the root cause."""
    bad = script(tmp_path, "bad.py", "raise SystemExit('boom')\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "elasticd",
            "run",
            "--log-dir",
            str(tmp_path / "logs"),
            "--",
            PY,
            bad,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert proc.returncode == 1
    # Not teed: the worker's output bare, as torchrun prints it.
    assert "FAILED" in proc.stderr and "\nboom\n" in proc.stderr
