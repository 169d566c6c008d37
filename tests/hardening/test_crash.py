"""Crashes of the daemon: acknowledged events are never lost, SQLite is never left unreadable."""

from __future__ import annotations

import asyncio
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from elasticd.node.db import Database
from tests.hardening.support import make_token_file, serve

pytestmark = pytest.mark.slow

KILLS = 20


def integrity(path: Path) -> str:
    """``PRAGMA integrity_check`` of a database a killed process left (WAL recovered on open)."""
    db = sqlite3.connect(path, timeout=5)
    try:
        return str(db.execute("PRAGMA integrity_check").fetchone()[0])
    finally:
        db.close()


async def test_acknowledged_events_survive_twenty_sigkills(tmp_path: Path) -> None:
    """20 times: start the daemon, submit a job that crashes and restarts as fast as it can
    (a stream of event writes), read its events through the API for a random while, kill -9.
    After each kill both SQLite files pass integrity_check; at the end, every event the API
    ever returned is still there, identical."""
    rng = random.Random(6)
    token_file, _ = make_token_file(tmp_path)
    # What is tested is durability across kill -9, not retention: the jobs ended here (each
    # cancelled by the next) keep every event their retention would keep while running.
    keep = {
        "ELASTICD_EVENT_RETENTION_FINISHED_FIRST": "100",
        "ELASTICD_EVENT_RETENTION_FINISHED_LAST": "400",
        "ELASTICD_EVENT_RETENTION_FINISHED_TOTAL": "100000",
    }
    state = tmp_path / "state"
    acknowledged: dict[str, dict[int, dict[str, Any]]] = {}
    killed_during: list[int] = []
    async with asyncio.timeout(150):
        for i in range(KILLS):
            daemon = serve(tmp_path, token_file=token_file, state_dir=state, env=keep)
            try:
                await daemon.wait_ready()
                job_id = f"crash-{i}"
                async with daemon.client() as c:
                    if i > 0:  # it resumed after the kill: end it, or the jobs would pile up
                        r = await c.post(f"/jobs/crash-{i - 1}/cancel", json={})
                        assert r.status_code in (200, 202, 409), r.text
                    r = await c.post(
                        "/jobs",
                        json={
                            "id": job_id,
                            "entrypoint": "/bin/sh",
                            "args": ["-c", "exit 3"],
                            "max_restarts": 1000,  # the bound; never reached in 0.8 s
                            "termination_grace": 0,
                        },
                    )
                    assert r.status_code == 201, r.text
                    seen = acknowledged.setdefault(job_id, {})
                    deadline = time.monotonic() + rng.uniform(0.05, 0.8)
                    while time.monotonic() < deadline:
                        r = await c.get(f"/jobs/{job_id}/events")
                        assert r.status_code == 200
                        for event in r.json():
                            seen[event["seq"]] = event
            finally:
                daemon.kill9()
            killed_during.append(len(seen))
            for name in ("elasticd.sqlite3", "store.sqlite3"):
                assert integrity(state / name) == "ok", (i, name)
        final = serve(tmp_path, token_file=token_file, state_dir=state, env=keep)
        try:
            await final.wait_ready()
            async with final.client() as c:
                for job_id, events in acknowledged.items():
                    r = await c.get(f"/jobs/{job_id}/events", params={"limit": 10_000})
                    now = {e["seq"]: e for e in r.json()}
                    lost = [e for seq, e in events.items() if now.get(seq) != e]
                    assert lost == [], f"{job_id}: {len(lost)} acknowledged events lost/changed"
                    job = (await c.get(f"/jobs/{job_id}")).json()
                    # Never failed for the daemon's sake: the job resumes (or ran to its end).
                    assert (
                        job["state"] != "FAILED"
                        or job["restart_count"] == job["spec"]["max_restarts"]
                    ), job
        finally:
            final.stop()
    assert sum(killed_during) > KILLS * 5  # the kills landed while events were being written
    assert final.proc.returncode == 0


WRITER = """
import sys
from pathlib import Path
from elasticd.node.db import Database
from elasticd.models import Event
db = Database(Path(sys.argv[1])).open()
n = 0
while True:
    n += 1
    db.append_event(Event(seq=0, time=n, job_id="w", node="n", source="daemon", kind="k",
                          message="x" * (n % 500)))
    if n % 50 == 0:
        db.mark_published(range(n - 49, n + 1))
    print(n, flush=True)  # acknowledged: the insert returned
"""


def test_sigkill_during_sqlite_writes_never_leaves_the_event_log_unreadable(
    tmp_path: Path,
) -> None:
    """kill -9 of a process writing events in a tight loop, 10 times: the database opens, passes
    integrity_check, and holds every event the writer had acknowledged."""
    rng = random.Random(7)
    path = tmp_path / "events.sqlite3"
    total = 0
    for _ in range(10):
        proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout is not None
        acknowledged = int(proc.stdout.readline())  # writing has begun
        deadline = time.monotonic() + rng.uniform(0.01, 0.15)
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if line:
                acknowledged = int(line)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        for line in proc.stdout.read().split():
            acknowledged = int(line)  # printed before the kill landed
        proc.stdout.close()
        assert integrity(path) == "ok"
        db = Database(path).open()
        try:
            count = db.conn.execute("SELECT count(*) FROM events").fetchone()[0]
            assert db.list_events("w", 0, 1_000_000)[-1].seq == count
        finally:
            db.close()
        total += acknowledged
        assert count >= total
        total = count
    assert total > 100
