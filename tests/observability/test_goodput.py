"""GET /jobs/{id}/goodput on a real daemon, against workers whose steps, checkpoints and
crashes are known (they note each step's time in a file: the ground truth)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

import elasticd
from tests.conftest import PY, asgi_client
from tests.e2e.cluster import LocalCluster
from tests.hardening.support import script, serve
from tests.hardening.test_clock_skew import HOUR, SharedStore, SkewedClock
from tests.hardening.test_clock_skew import daemon as clock_daemon
from tests.observability.test_metrics import samples

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

#: A served daemon passes its jobs only a login shell's environment: the workers import
#: the elasticd under test.
JOB_ENV = {"PYTHONPATH": str(Path(elasticd.__file__).resolve().parents[1])}

#: The CLI under test, told nothing by the environment of the test's runner.
CLI_ENV = {
    **{k: v for k, v in os.environ.items() if not k.startswith("ELASTICD_")},
    **JOB_ENV,
}

TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")

#: Seconds per step of the workers below.
STEP_S = 0.05

# Attempt 1 runs steps 1..55, checkpointing every 20, and crashes after step 55;
# attempt 2 resumes from its own last checkpoint (40) and runs to 100, checkpointing
# every 20. Each step's wall time goes to notes.jsonl: the ground truth. Where the test
# made a file "hold", the first attempt stays at step HOLD_AT (pinging) until it is
# stopped (two minutes at most): a test that stops it there cannot be outrun by its end.
HOLD_AT = 35
WORKER = """
    import json, os, sys, time
    from pathlib import Path
    from elasticd.worker import checkpointed, ping

    here = Path(sys.argv[1])
    notes = (here / "notes.jsonl").open("a")
    ckpt = here / "ckpt"
    start = int(ckpt.read_text()) if ckpt.exists() else 0
    crash_at = None if (here / "crashed").exists() else 55
    hold_at = {hold_at} if start == 0 and (here / "hold").exists() else None
    for step in range(start + 1, 101):
        time.sleep({step_s})
        ping(step=step)
        notes.write(json.dumps({{"step": step, "t": time.time(), "start": start}}) + "\\n")
        notes.flush()
        held_until = time.monotonic() + 120
        while step == hold_at and time.monotonic() < held_until:
            time.sleep({step_s})
            ping(step=step)
        if step % 20 == 0:
            ckpt.write_text(str(step))
            checkpointed(step)
            notes.write(json.dumps({{"checkpoint": step, "t": time.time()}}) + "\\n")
        if step == crash_at:
            (here / "crashed").write_text("")
            sys.exit(3)
"""


async def run(*args: str) -> str:
    """A CLI command's output (it must succeed)."""
    proc = await asyncio.create_subprocess_exec(
        *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=CLI_ENV
    )
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    return out.decode()


async def succeeded(c: httpx.AsyncClient, spec: dict[str, Any]) -> str:
    """Submit the job and wait (bounded) until it ends; it must succeed. Its id."""
    job_id = str((await c.post("/jobs", json={**spec, "env": JOB_ENV})).json()["id"])
    async with asyncio.timeout(120):
        while (state := (await c.get(f"/jobs/{job_id}")).json()["state"]) not in TERMINAL:
            await asyncio.sleep(0.1)
    assert state == "SUCCEEDED"
    return job_id


def notes(folder: Path, name: str = "notes.jsonl") -> list[dict[str, Any]]:
    return [json.loads(line) for line in (folder / name).read_text().splitlines()]


async def test_goodput_matches_the_workers_ground_truth(tmp_path: Path) -> None:
    """One crash after checkpoint 40 at step 55: 15 lost steps (their time), one failure,
    checkpoint 100, and productive + badput = wall."""
    work = tmp_path / "work"
    work.mkdir()
    worker = script(tmp_path, "worker.py", WORKER.format(step_s=STEP_S, hold_at=HOLD_AT))
    daemon = serve(tmp_path)
    try:
        await daemon.wait_ready()
        async with daemon.client() as c:
            job_id = await succeeded(c, {"entrypoint": PY, "args": [worker, str(work)]})
            answer = await c.get(f"/jobs/{job_id}/goodput")
            scrape = (await c.get("/metrics")).text
        assert answer.status_code == 200, answer.text
        g = answer.json()
        cli = [PY, "-m", "elasticd", "goodput", job_id, "--url", daemon.url]
        cli += ["--token-file", str(tmp_path / f"auto-token-{daemon.port}")]
        table = await run(*cli)
        as_json = json.loads(await run(*cli, "--json"))
    finally:
        daemon.stop()

    truth = notes(work)
    steps = {(n["step"], n["start"]): n["t"] for n in truth if "step" in n}
    lost_s = steps[(55, 0)] - steps[(40, 0)]  # the crashed attempt's time past its checkpoint
    assert g["steps"] == {
        "max_step": 100,
        "checkpoint_step": 100,
        "lost_steps": 15,
        "failures": 1,
    }
    assert g["lost_work_known"] is True
    assert g["badput_s"]["lost_work"] == pytest.approx(lost_s, rel=0.25, abs=0.15)
    total = g["productive_s"] + sum(g["badput_s"].values())
    assert total == pytest.approx(g["wall_s"], rel=0.05)
    assert g["badput_s"]["recovery"] > 0
    assert g["badput_s"]["startup"] > 0
    assert [f["end"] for f in g["failures"]] == ["failed"]
    assert [c["step"] for c in g["checkpoints"]][-1] == 100
    assert g["series"] and g["series"][-1]["step"] == 100

    # The same figures on the other surfaces: Prometheus and the CLI.
    series = samples(scrape)
    assert series[("elasticd_job_goodput_ratio", (("job_id", job_id),))] == pytest.approx(
        g["goodput"]
    )
    lost = ("elasticd_job_badput_seconds_total", (("job_id", job_id), ("kind", "lost_work")))
    assert series[lost] == pytest.approx(g["badput_s"]["lost_work"])
    assert as_json["steps"] == g["steps"]
    assert f"job {job_id}: goodput" in table
    assert "lost_work" in table
    assert "steps: max 100, checkpoint 100, lost 15" in table


async def test_a_job_that_reports_no_steps_says_lost_work_is_unknown(tmp_path: Path) -> None:
    """A worker that pings without steps and crashes once: start-up and recovery are measured,
    lost work is unknown (null lost_steps), the time still adds up."""
    marker = tmp_path / "crashed"
    worker = script(
        tmp_path,
        "plain.py",
        f"""
        import os, sys, time
        from elasticd.worker import ping
        for _ in range(10):
            time.sleep(0.05)
            ping()
        if not os.path.exists({str(marker)!r}):
            open({str(marker)!r}, "w").close()
            sys.exit(3)
        """,
    )
    daemon = serve(tmp_path)
    try:
        await daemon.wait_ready()
        async with daemon.client() as c:
            job_id = await succeeded(c, {"entrypoint": PY, "args": [worker]})
            g = (await c.get(f"/jobs/{job_id}/goodput")).json()
            missing = await c.get("/jobs/no-such-job/goodput")
    finally:
        daemon.stop()
    assert missing.status_code == 404
    assert g["steps"]["failures"] == 1
    assert g["steps"]["lost_steps"] is None
    assert g["lost_work_known"] is False
    assert g["steps_reported"] is False
    assert g["badput_s"]["recovery"] > 0
    assert g["productive_s"] + sum(g["badput_s"].values()) == pytest.approx(g["wall_s"], rel=0.05)


# Two nodes, one worker each, both stepping. Rank 0 checkpoints every 20 steps; in the
# first attempt both stop at step 55 (rank 1 crashes once rank 0 is there, rank 0 waits
# to be stopped), so exactly 15 steps are past checkpoint 40; the second attempt resumes
# from 40 on whichever node rank 0 now is and runs to 100.
TWO_NODE_WORKER = """
    import json, os, sys, threading, time
    from pathlib import Path
    from elasticd.worker import checkpointed, ping

    here, rank = Path(sys.argv[1]), int(os.environ["RANK"])
    ckpt = here / "ckpt"
    start = int(ckpt.read_text()) if ckpt.exists() else 0
    first = not (here / "crashed").exists()
    notes = (here / f"notes-{{rank}}.jsonl").open("a")
    for step in range(start + 1, 101):
        time.sleep({step_s})
        ping(step=step)
        notes.write(json.dumps({{"step": step, "t": time.time(), "first": first}}) + "\\n")
        notes.flush()
        if rank == 0 and step % 20 == 0:
            ckpt.write_text(str(step))
            checkpointed(step)
        if first and step == 55:
            if rank == 0:
                (here / "rank0-at-55").write_text("")
                threading.Event().wait()  # no step past 55: stopped with the group
            while not (here / "rank0-at-55").exists():
                time.sleep(0.01)
            (here / "crashed").write_text("")
            sys.exit(3)
"""


async def test_goodput_joins_the_nodes_records(tmp_path: Path) -> None:
    """A two-node job read from the node it was not submitted to: every node's record in
    the store joined by round gives the ground truth's failure, lost steps and checkpoint."""
    work = tmp_path / "work"
    work.mkdir()
    worker = script(tmp_path, "two.py", TWO_NODE_WORKER.format(step_s=STEP_S))
    with LocalCluster(tmp_path) as cluster:
        await cluster.start_all("n0", "n1")
        spec = {"entrypoint": PY, "args": [worker, str(work)], "min_nodes": 2, "max_nodes": 2}
        async with cluster.client("n0") as c0:
            job_id = await succeeded(c0, spec)
        async with cluster.client("n1") as c1:
            g = (await c1.get(f"/jobs/{job_id}/goodput")).json()
    assert g["steps"] == {"max_step": 100, "checkpoint_step": 100, "lost_steps": 15, "failures": 1}
    steps = {n["step"]: n["t"] for n in notes(work, "notes-0.jsonl") if n["first"]}
    assert g["badput_s"]["lost_work"] == pytest.approx(steps[55] - steps[40], rel=0.25, abs=0.15)
    assert g["productive_s"] + sum(g["badput_s"].values()) == pytest.approx(g["wall_s"], rel=0.05)


async def test_goodput_survives_a_daemon_restart(tmp_path: Path) -> None:
    """The daemon stops mid-job and comes back: the first attempt's facts are read back
    from the store, the time it was down is badput (other), and the job's steps are whole."""
    work = tmp_path / "work"
    work.mkdir()
    worker = script(tmp_path, "worker.py", WORKER.format(step_s=STEP_S, hold_at=HOLD_AT))
    (work / "crashed").write_text("")  # no crash in this one
    (work / "hold").write_text("")  # the first attempt waits for the stop at HOLD_AT
    daemon = serve(tmp_path)
    try:
        await daemon.wait_ready()
        async with daemon.client() as c:
            spec = {"entrypoint": PY, "args": [worker, str(work)], "env": JOB_ENV}
            job_id = (await c.post("/jobs", json=spec)).json()["id"]
            await reached_step(work, HOLD_AT)
        daemon.stop()  # the job waits, RESTARTING, for this node to come back
        daemon = serve(tmp_path, state_dir=daemon.state_dir, port=daemon.port)
        await daemon.wait_ready()
        async with daemon.client() as c:
            async with asyncio.timeout(120):
                while (await c.get(f"/jobs/{job_id}")).json()["state"] not in TERMINAL:
                    await asyncio.sleep(0.1)
            g = (await c.get(f"/jobs/{job_id}/goodput")).json()
    finally:
        daemon.stop()
    assert g["attempts"] == 2
    assert g["steps"] == {"max_step": 100, "checkpoint_step": 100, "lost_steps": 0, "failures": 0}
    assert g["badput_s"]["other"] > 0  # from the stop to the new attempt's spawn
    first_attempt = [p for p in g["series"] if p["step"] <= 30]
    assert first_attempt, "the first attempt's samples were read back"
    assert g["productive_s"] + sum(g["badput_s"].values()) == pytest.approx(g["wall_s"], rel=0.05)


async def reached_step(folder: Path, step: int) -> None:
    """Until the worker noted ``step`` (bounded)."""
    async with asyncio.timeout(60):
        while not any(n.get("step") == step for n in notes_so_far(folder)):
            await asyncio.sleep(0.05)


def notes_so_far(folder: Path) -> list[dict[str, Any]]:
    """The notes written whole so far (the worker may be writing the last line)."""
    path = folder / "notes.jsonl"
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]


async def test_a_preemption_is_its_own_badput(tmp_path: Path) -> None:
    """A higher-priority job takes the only slot mid-run: the wait until the job is back is
    `preempted`, the steps past its checkpoint are lost work, and no failure is counted."""
    work = tmp_path / "work"
    work.mkdir()
    worker = script(tmp_path, "worker.py", WORKER.format(step_s=STEP_S, hold_at=HOLD_AT))
    (work / "crashed").write_text("")  # no crash in this one
    (work / "hold").write_text("")  # the first attempt waits for the preemption at HOLD_AT
    with LocalCluster(tmp_path, slots=1) as cluster:
        await cluster.start_all("n0")
        async with cluster.client("n0") as c:
            low = {"id": "low", "entrypoint": PY, "args": [worker, str(work)], "env": JOB_ENV}
            assert (await c.post("/jobs", json=low)).status_code == 201
            await reached_step(work, HOLD_AT)
            high = {"entrypoint": PY, "args": ["-c", "import time; time.sleep(1)"], "priority": 5}
            await succeeded(c, high)
            async with asyncio.timeout(120):
                while (await c.get("/jobs/low")).json()["state"] not in TERMINAL:
                    await asyncio.sleep(0.1)
            g = (await c.get("/jobs/low/goodput")).json()
    first = []  # the first attempt's notes: before the first step of a resumed one
    for n in notes(work):
        if n.get("start", 0) != 0:
            break
        first.append(n)
    reached = max(n["step"] for n in first if "step" in n)
    saved = max((n["checkpoint"] for n in first if "checkpoint" in n), default=0)
    assert (reached, saved) == (HOLD_AT, 20)
    assert g["attempts"] == 2
    assert g["steps"] == {
        "max_step": 100,
        "checkpoint_step": 100,
        "lost_steps": reached - saved,
        "failures": 0,
    }
    assert g["badput_s"]["preempted"] >= 1.0  # at least the other job's second
    assert g["productive_s"] + sum(g["badput_s"].values()) == pytest.approx(g["wall_s"], rel=0.05)


async def test_a_job_that_reports_no_progress_is_never_called_productive(tmp_path: Path) -> None:
    """A worker that never pings crashes once and restarts: while the restarted attempt runs
    (no progress, ever) its time is recovery, not productive; nothing is productive, and the
    API and the CLI say plainly that the job reports no progress."""
    marker, go = tmp_path / "crashed", tmp_path / "go"
    worker = script(
        tmp_path,
        "silent.py",
        f"""
        import os, sys, time
        if not os.path.exists({str(marker)!r}):
            time.sleep(0.3)
            open({str(marker)!r}, "w").close()
            sys.exit(3)
        deadline = time.monotonic() + 120
        while not os.path.exists({str(go)!r}) and time.monotonic() < deadline:
            time.sleep(0.05)
        """,
    )
    daemon = serve(tmp_path)
    try:
        await daemon.wait_ready()
        async with daemon.client() as c:
            spec = {"entrypoint": PY, "args": [worker], "env": JOB_ENV}
            job_id = (await c.post("/jobs", json=spec)).json()["id"]
            # The restarted attempt runs, silent, for a second past the failure's detection.
            async with asyncio.timeout(60):
                while True:
                    g = (await c.get(f"/jobs/{job_id}/goodput")).json()
                    if g["attempts"] == 2 and g["as_of"] - g["failures"][0]["t"] >= 1.0:
                        break
                    await asyncio.sleep(0.1)
            since_failure = g["as_of"] - g["failures"][0]["t"]
            go.write_text("")
            async with asyncio.timeout(60):
                while (await c.get(f"/jobs/{job_id}")).json()["state"] not in TERMINAL:
                    await asyncio.sleep(0.1)
            done = (await c.get(f"/jobs/{job_id}/goodput")).json()
        cli = [PY, "-m", "elasticd", "goodput", job_id, "--url", daemon.url]
        table = await run(*cli, "--token-file", str(tmp_path / f"auto-token-{daemon.port}"))
    finally:
        daemon.stop()
    for figures in (g, done):
        assert figures["productive_s"] == 0, figures
        assert figures["goodput"] == 0
        assert figures["progress_reported"] is False
        assert figures["steps_reported"] is False
        assert figures["steps"]["failures"] == 1
        total = figures["productive_s"] + sum(figures["badput_s"].values())
        assert total == pytest.approx(figures["wall_s"], rel=0.05)
    # The doc: recovery lasts from the detection until the next attempt's first progress.
    assert g["badput_s"]["recovery"] == pytest.approx(since_failure, abs=0.05)
    assert done["badput_s"]["recovery"] >= since_failure
    assert "the job reports no progress" in table
    assert "productive  0.0" in table


async def test_a_step_of_the_daemons_wall_clock_bends_no_figure(tmp_path: Path) -> None:
    """The daemon's wall clock runs an hour ahead, then is stepped back mid-attempt (after
    checkpoint 20): wall time and every kind stay non-negative and add up to the time the
    job really took, the last checkpoint is 100 and the crash at step 55 lost its 15 steps
    past checkpoint 40."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "hold").write_text("")  # the first attempt waits at HOLD_AT for "released"
    worker = script(
        tmp_path,
        "worker.py",
        WORKER.format(step_s=STEP_S, hold_at=HOLD_AT).replace(
            "time.monotonic() < held_until",
            "time.monotonic() < held_until and not (here / 'released').exists()",
        ),
    )
    clock = SkewedClock(offset=HOUR)
    store = SharedStore()
    node = clock_daemon(tmp_path, "node", store, clock)
    try:
        async with asyncio.timeout(120):
            await node.start()
            async with asgi_client(node) as c:
                began = time.monotonic()
                spec = {"entrypoint": PY, "args": [worker, str(work)], "env": JOB_ENV}
                r = await c.post("/jobs", json=spec)
                assert r.status_code == 201, r.text
                job_id = r.json()["id"]
                while True:  # checkpoint 20 recorded, the attempt holding at step HOLD_AT
                    g = (await c.get(f"/jobs/{job_id}/goodput")).json()
                    if [p["step"] for p in g["checkpoints"]] == [20]:
                        break
                    await asyncio.sleep(0.05)
                await reached_step(work, HOLD_AT)
                clock.offset -= HOUR  # the clock corrected: one step back
                (work / "released").write_text("")
                while (await c.get(f"/jobs/{job_id}")).json()["state"] not in TERMINAL:
                    await asyncio.sleep(0.1)
                took = time.monotonic() - began
                job = (await c.get(f"/jobs/{job_id}")).json()
                g = (await c.get(f"/jobs/{job_id}/goodput")).json()
    finally:
        async with asyncio.timeout(60):
            await node.shutdown()
            await store.really_close()
    assert job["state"] == "SUCCEEDED"
    assert job["finished_at"] - job["created_at"] < 0  # the fault was really there
    assert 0 < g["wall_s"] <= took + 0.5, (g["wall_s"], took)
    assert g["wall_s"] >= took - 1.0, (g["wall_s"], took)
    assert all(v >= 0 for v in g["badput_s"].values()), g["badput_s"]
    assert 0 < g["productive_s"] <= g["wall_s"]
    assert 0.2 < g["goodput"] <= 1.0
    assert g["productive_s"] + sum(g["badput_s"].values()) == pytest.approx(g["wall_s"], rel=0.01)
    assert g["steps"] == {"max_step": 100, "checkpoint_step": 100, "lost_steps": 15, "failures": 1}
    assert g["badput_s"]["lost_work"] < 5.0  # 15 steps, not an hour
