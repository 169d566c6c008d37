"""A daemon that dies leaves no worker behind: the parent-death signal, then the start-up sweep."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest

from elasticd.supervise.records import WorkerRecord
from elasticd.supervise.sweep import boot_id, process_start_time
from tests.conftest import make_daemon
from tests.hardening.support import (
    PY,
    SLEEPER,
    eventually,
    healthy_pids,
    make_token_file,
    pid_alive,
    script,
    serve,
)

pytestmark = pytest.mark.slow


async def test_sigkill_of_the_daemon_kills_its_four_workers_and_the_job_resumes(
    tmp_path: Path,
) -> None:
    """kill -9 of `elasticd serve` with 4 workers: none is alive 2 s later; after a restart the
    job resumes as a new attempt (no restart charged), its events name the crash."""
    token_file, _ = make_token_file(tmp_path)
    sleeper = script(tmp_path, "sleeper.py", SLEEPER)
    daemon = serve(tmp_path, token_file=token_file)
    try:
        async with asyncio.timeout(60):
            await daemon.wait_ready()
            async with daemon.client() as c:
                r = await c.post(
                    "/jobs",
                    json={"id": "four", "entrypoint": PY, "args": [sleeper], "nproc_per_node": 4},
                )
                assert r.status_code == 201, r.text
                pids = await healthy_pids(c, "four", 4)
            db = sqlite3.connect(daemon.state_dir / "elasticd.sqlite3")
            recorded = {row[0] for row in db.execute("SELECT pid FROM workers")}
            db.close()
            assert recorded == set(pids)  # the sweep's record, written at spawn
            daemon.kill9()
            took = await eventually(
                lambda: not any(pid_alive(p) for p in pids), 2.0, "the workers to die"
            )
            assert took < 2.0
            restarted = serve(tmp_path, token_file=token_file, state_dir=daemon.state_dir)
            try:
                await restarted.wait_ready()
                async with restarted.client() as c:
                    # The view published before the crash is marked STOPPED at start-up:
                    # the dead pids are never shown HEALTHY again.
                    again = await healthy_pids(c, "four", 4)
                    job = (await c.get("/jobs/four")).json()
                    events = (await c.get("/jobs/four/events")).json()
                    view = (await c.get("/jobs/four/workers")).json()
            finally:
                restarted.stop()
    finally:
        daemon.kill9()
    assert not set(again) & set(pids)
    assert job["state"] == "RUNNING" and job["restart_count"] == 0, job
    resumed = [e for e in events if e["kind"] == "job.resumed"]
    assert len(resumed) == 1 and "crashed or was killed" in resumed[0]["message"]
    assert view["groups"][0]["attempt"] == 1  # a new attempt: attempt_0's logs stay as they were
    assert restarted.proc.returncode == 0
    # Nothing was left to sweep: the kernel had killed every worker.
    assert "worker.orphan_killed" not in [e["kind"] for e in events]


def _survivor(tmp_path: Path) -> tuple[subprocess.Popen[bytes], int]:
    """A worker that outlived its daemon: a session leader with a child in its group."""
    ready = tmp_path / "child.pid"
    leader = subprocess.Popen(
        ["/bin/sh", "-c", f"sleep 300 & echo $! > {ready}; exec sleep 300"],
        start_new_session=True,
    )
    deadline = time.monotonic() + 10
    while not ready.exists() or not ready.read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return leader, int(ready.read_text())


def _bystander() -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sleep", "300"], start_new_session=True)


def _record(db_path: Path, record: WorkerRecord) -> None:
    db = sqlite3.connect(db_path)
    with db:
        db.execute(
            "INSERT INTO workers (pid, start_time, boot_id, job_id, attempt, local_rank)"
            " VALUES (?, ?, ?, ?, ?, ?)",
            (
                record.pid,
                record.start_time,
                record.boot_id,
                record.job_id,
                record.attempt,
                record.local_rank,
            ),
        )
    db.close()


async def test_start_up_sweep_kills_recorded_survivors_and_only_them(tmp_path: Path) -> None:
    """A recorded worker still alive with its start time is killed with its whole group and
    evented; a recorded pid now used by another process, or from another boot, is left alone."""
    first = make_daemon(tmp_path)
    async with asyncio.timeout(30):
        await first.start()
        await first.shutdown()  # creates the database, with its workers table
    leader, child = _survivor(tmp_path)
    bystander = _bystander()
    try:
        start = process_start_time(leader.pid)
        assert start is not None
        db_path = tmp_path / "state" / "elasticd.sqlite3"
        _record(db_path, WorkerRecord(leader.pid, start, boot_id(), "job-x", 2, 1))
        # The bystander's pid, recorded with another start time: a reused pid, not ours.
        other_start = process_start_time(bystander.pid)
        assert other_start is not None
        _record(db_path, WorkerRecord(bystander.pid, other_start - 1, boot_id(), "job-x", 2, 0))
        # The test's own pid with its real start time, but from an earlier boot.
        mine = process_start_time(os.getpid())
        assert mine is not None
        _record(db_path, WorkerRecord(os.getpid(), mine, "another-boot", "job-y", 0, 0))

        daemon = make_daemon(tmp_path)
        async with asyncio.timeout(30):
            await daemon.start()
            try:
                await eventually(
                    lambda: not pid_alive(leader.pid) and not pid_alive(child), 2.0, "the sweep"
                )
                events = daemon.events.read("job-x")
                assert daemon.db.recorded_workers() == []
            finally:
                await daemon.shutdown()
        assert pid_alive(bystander.pid)
        killed = [e for e in events if e.kind == "worker.orphan_killed"]
        assert len(killed) == 1
        assert (killed[0].pid, killed[0].local_rank, killed[0].attempt) == (leader.pid, 1, 2)
        assert "2 process(es)" in killed[0].message
    finally:
        for proc in (leader, bystander):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        if pid_alive(child):
            os.kill(child, signal.SIGKILL)
