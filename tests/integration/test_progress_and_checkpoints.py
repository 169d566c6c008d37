"""Steps and checkpoints reach the job, a restart resumes from them, and the progress policy:
max_no_progress_restarts, progress_timeout "auto" and checkpoint_timeout, on a real daemon."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import PY, events_of, script, wait_job

#: The workers import this tree's elasticd (not an installed one).
ENV = {"PYTHONPATH": str(Path(__file__).resolve().parents[2])}


async def run_script(
    client: httpx.AsyncClient,
    tmp_path: Path,
    body: str,
    *args: str,
    timeout: float = 60,
    **spec: Any,
) -> dict[str, Any]:
    """Submit ``python <body> args...`` with ``spec`` and wait for the job to end."""
    path = script(tmp_path, "worker.py", body)
    r = await client.post(
        "/jobs", json={"entrypoint": PY, "env": ENV, "args": [path, *args], **spec}
    )
    assert r.status_code in (200, 201), r.text
    return await wait_job(client, r.json()["id"], timeout=timeout)


#: Attempt 0 reports steps 0..9 and a checkpoint at 5, then crashes; attempt 1 writes
#: what it was told (ELASTICD_CHECKPOINT_STEP / _PATH) and succeeds.
RESUMES = """
import os, sys
import elasticd.worker as w
out = sys.argv[1]
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    for step in range(10):
        w.ping(step=step)
        if step == 5:
            w.checkpointing()
            w.checkpointed(5, out + ".ckpt-5")
    sys.exit(3)
with open(out, "w") as f:
    f.write(os.environ.get("ELASTICD_CHECKPOINT_STEP", "-") + " ")
    f.write(os.environ.get("ELASTICD_CHECKPOINT_PATH", "-"))
w.ping(step=6)
"""


async def test_a_restart_resumes_from_the_jobs_last_checkpoint(
    client: httpx.AsyncClient, tmp_path: Path
) -> None:
    """The checkpoint and steps reach the job document; the restarted attempt is told of them."""
    out = tmp_path / "told"
    job = await run_script(client, tmp_path, RESUMES, str(out), max_restarts=1)
    assert job["state"] == "SUCCEEDED" and job["restart_count"] == 1, job
    assert out.read_text() == f"5 {out}.ckpt-5"
    progress = job["progress"]
    assert progress["checkpoint_step"] == 5
    assert progress["checkpoint_path"] == f"{out}.ckpt-5"
    assert progress["max_step"] == 9  # attempt 0's, closed when its failure was charged
    assert progress["no_progress_restarts"] == 0
    # The attempt record of the succeeded attempt: started from 5.
    assert progress["attempt"]["started_from"] == 5 and progress["attempt"]["round"] >= 1


#: Every attempt starts from the checkpoint it is told of (or 0), steps on, and crashes;
#: only the first attempt checkpoints (``checkpoints``) — the rest make no progress.
CRASH_LOOP = """
import os, sys
import elasticd.worker as w
start = int(os.environ.get("ELASTICD_CHECKPOINT_STEP", "-1")) + 1
for step in range(start, start + 3):
    w.ping(step=step)
if sys.argv[1] == "checkpoints" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    w.checkpointed(start + 2)
sys.exit(1)
"""


@pytest.mark.parametrize("kind", ["checkpoints", "steps-only"])
async def test_a_crash_loop_without_progress_stops_after_max_no_progress_restarts(
    client: httpx.AsyncClient, tmp_path: Path, kind: str
) -> None:
    """A job that restarts without progress fails after max_no_progress_restarts restarts,
    long before its restart budget, and says why."""
    job = await run_script(
        client, tmp_path, CRASH_LOOP, kind, timeout=90, max_restarts=20, max_no_progress_restarts=2
    )
    assert job["state"] == "FAILED"
    assert job["restart_count"] == 2, job["reason"]
    assert "no progress in 2 restarts in a row (max_no_progress_restarts = 2)" in job["reason"]
    progress = job["progress"]
    assert progress["no_progress_restarts"] == 2
    if kind == "checkpoints":
        assert progress["checkpoint_step"] == 2 and "the last checkpoint is step 2" in job["reason"]
    else:
        assert progress["checkpoint_step"] is None and progress["max_step"] == 2
        assert "no checkpoint was reported; the highest step is 2" in job["reason"]


#: Fast steps (warm-up), one step of 4 s (slower than 4x the usual, under the floor), more
#: fast steps, then a real hang.
SLOW_THEN_HANG = """
import threading, time
import elasticd.worker as w
step = 0
def steps(n):
    global step
    for _ in range(n):
        w.ping(step=step)
        step += 1
        time.sleep(0.1)
steps(80)
time.sleep(4.0)  # a slow step
steps(20)
print("hanging", flush=True)
threading.Event().wait()
"""


@pytest.mark.slow
async def test_an_auto_timeout_spares_a_slow_step_and_catches_a_hang(
    client: httpx.AsyncClient, tmp_path: Path
) -> None:
    """progress_timeout "auto": a 4 s step among 0.1 s steps is not a hang; a real hang is
    caught within the sized timeout (floor 10 s, 4x the 95th percentile)."""
    job = await run_script(
        client,
        tmp_path,
        SLOW_THEN_HANG,
        timeout=110,
        progress_timeout="auto",
        max_restarts=0,
        termination_grace=1,
    )
    assert job["state"] == "FAILED" and "hung" in job["error"]["message"]
    hangs = [e for e in await events_of(client, job["id"]) if e["kind"] == "worker.hang"]
    assert len(hangs) == 1, [h["message"] for h in hangs]
    assert "progress_timeout = auto" in hangs[0]["message"]
    # Detected at the sized timeout: at least the floor, and well before the warm-up's 600 s.
    assert 10.0 <= hangs[0]["duration_s"] < 40.0


#: A checkpoint of 3 s while progress_timeout is 1 s; then (``hang``) one that never ends.
SLOW_CHECKPOINT = """
import sys, threading, time
import elasticd.worker as w
for step in range(5):
    w.ping(step=step)
    time.sleep(0.05)
w.checkpointing()
time.sleep(3.0)
w.checkpointed(4)
for step in range(5, 10):
    w.ping(step=step)
    time.sleep(0.05)
if sys.argv[1] == "hang":
    w.checkpointing()
    threading.Event().wait()
"""


@pytest.mark.parametrize("ending", ["ok", "hang"])
async def test_a_slow_checkpoint_is_not_a_hang(
    client: httpx.AsyncClient, tmp_path: Path, ending: str
) -> None:
    """A checkpoint longer than progress_timeout is judged by checkpoint_timeout: a 3 s one
    passes; one that never ends is a hang named after checkpoint_timeout."""
    job = await run_script(
        client,
        tmp_path,
        SLOW_CHECKPOINT,
        ending,
        progress_timeout=1.0,
        checkpoint_timeout=6.0,
        max_restarts=0,
        termination_grace=1,
    )
    hangs = [e for e in await events_of(client, job["id"]) if e["kind"] == "worker.hang"]
    if ending == "ok":
        assert job["state"] == "SUCCEEDED", job["reason"]
        assert hangs == []
    else:
        assert job["state"] == "FAILED"
        assert len(hangs) == 1 and "checkpoint_timeout" in hangs[0]["message"]
        assert 6.0 <= hangs[0]["duration_s"] < 15.0
    assert job["progress"]["checkpoint_step"] == 4
