"""A daemon that stays small (issue 23 item 7): a crash-looping job's events and log folders stay
within the configured bounds on a real daemon, the first, last and failure events survive in
order, a running attempt's logs are never removed, and the embedded store's watch history holds
what watchers need only."""

from __future__ import annotations

import asyncio
import sqlite3
import sys
from pathlib import Path

import pytest

from elasticd.store.embedded import EmbeddedStore
from tests.conftest import asgi_client, make_daemon, wait_job
from tests.hardening.support import eventually, serve

pytestmark = pytest.mark.timeout(120)

FIRST, LAST, ATTEMPTS = 10, 20, 3
RETENTION = {
    "ELASTICD_EVENT_RETENTION_FIRST": str(FIRST),
    "ELASTICD_EVENT_RETENTION_LAST": str(LAST),
    "ELASTICD_LOG_RETENTION_ATTEMPTS": str(ATTEMPTS),
    "ELASTICD_LOG_RETENTION_INTERVAL": "0.3",
}


def local_events(state_dir: Path, job_id: str) -> list[tuple[int, str]]:
    conn = sqlite3.connect(f"file:{state_dir / 'elasticd.sqlite3'}?mode=ro", uri=True)
    try:
        rows = conn.execute(
            "SELECT seq, json_extract(doc, '$.kind') FROM events WHERE job_id = ? ORDER BY seq",
            (job_id,),
        ).fetchall()
    finally:
        conn.close()
    return [(int(s), str(k)) for s, k in rows]


async def test_a_crash_looping_job_stays_within_its_event_and_log_bounds(tmp_path: Path) -> None:
    """30 restarts (~16 events each) of one crash keep first + last + the first of the run of
    identical failures + one marker, in both the node's database and the store; the merged view
    keeps its order; 3 attempt folders are left."""
    daemon = serve(tmp_path, env=RETENTION)
    try:
        await daemon.wait_ready()
        async with daemon.client() as c:
            spec = {
                "id": "loop",
                "entrypoint": sys.executable,
                "args": ["-c", "import sys, time; time.sleep(0.05); sys.exit(3)"],
                "max_restarts": 30,
                "termination_grace": 1,
            }
            assert (await c.post("/jobs", json=spec)).status_code in (200, 201)
            async with asyncio.timeout(90):
                while (await c.get("/jobs/loop")).json()["state"] != "FAILED":
                    await asyncio.sleep(0.2)
            # Every failure is the same (rank 0 exits 3): the first worker.exited FAILED and
            # group.restarting stay, their 30 repeats between the first and the last events
            # are counted in the marker; the job's FAILED is kept.
            failures = 1 + 1 + 1
            bound = FIRST + LAST + failures + 1 + LAST // 4  # + the marker + one trim's cadence

            def settled() -> bool:
                return len(local_events(daemon.state_dir, "loop")) <= bound

            await eventually(settled, 20, "the node's events within the bound")
            events = (await c.get("/jobs/loop/events", params={"limit": 10_000})).json()
            stored = (await c.get("/store/list", params={"prefix": "ev/loop/"})).json()["entries"]
            assert len(stored) <= bound and len(events) <= bound
            seqs = [e["seq"] for e in events]
            assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
            kinds = [e["kind"] for e in events]
            assert kinds[0] == "job.submitted"
            tail = events[-LAST:]  # the last events, as they were emitted
            assert any(e["kind"] == "job.state" and e["state"] == "FAILED" for e in tail)
            assert tail[-1]["kind"] == "agent.finished"
            failed = [e for e in events if e["kind"] == "worker.exited" and e["state"] == "FAILED"]
            assert failed and all(e["exit_code"] == 3 for e in failed)
            # The first failure of the run stays (before the marker), the last ones too.
            first_failure = kinds.index("worker.exited")
            assert first_failure < kinds.index("events.trimmed"), kinds
            assert events[first_failure]["state"] == "FAILED", events[first_failure]
            assert 1 <= kinds.count("group.restarting") < 31
            markers = [e for e in events if e["kind"] == "events.trimmed"]
            assert len(markers) == 1 and markers[0]["count"] > 200
            assert "the same as the one of their kind before them" in markers[0]["message"]
            assert (await c.get("/jobs/loop")).json()["restart_count"] == 30
            # The marker stands where the gap begins: after the first FIRST events.
            assert kinds.index("events.trimmed") >= FIRST

            logs = daemon.state_dir / "logs" / "loop"

            def few_folders() -> bool:
                return len([p for p in logs.iterdir() if p.name.startswith("attempt_")]) <= ATTEMPTS

            await eventually(few_folders, 20, "log retention at the job's end")
            assert sorted(p.name for p in logs.iterdir() if p.name.startswith("attempt_")) == [
                "attempt_28",
                "attempt_29",
                "attempt_30",
            ]
    finally:
        daemon.stop()


async def test_the_running_attempts_logs_are_never_removed(tmp_path: Path) -> None:
    """A byte bound far below what the running attempt wrote, passes every 0.3 s: the old
    attempts go (but the newest finished one), the running attempt's folder and file stay."""
    env = {**RETENTION, "ELASTICD_LOG_RETENTION_ATTEMPTS": "1", "ELASTICD_LOG_RETENTION_BYTES": "1"}
    daemon = serve(tmp_path, env=env)
    body = (
        "import os, sys, time\n"
        "if int(os.environ['TORCHELASTIC_RESTART_COUNT']) < 3: sys.exit(1)\n"
        "print('x' * 100_000, flush=True)\n"
        "time.sleep(60)\n"
    )
    try:
        await daemon.wait_ready()
        async with daemon.client() as c:
            spec = {
                "id": "live",
                "entrypoint": sys.executable,
                "args": ["-c", body],
                "max_restarts": 5,
                "termination_grace": 1,
            }
            assert (await c.post("/jobs", json=spec)).status_code in (200, 201)
            logs = daemon.state_dir / "logs" / "live"
            running = logs / "attempt_3" / "0" / "stdout.log"

            def written() -> bool:
                return running.exists() and running.stat().st_size >= 100_000

            await eventually(written, 30, "the running attempt's output")

            def trimmed() -> bool:
                return sorted(p.name for p in logs.iterdir() if p.name.startswith("attempt_")) == [
                    "attempt_3"
                ]

            await eventually(trimmed, 20, "the finished attempts removed")
            await asyncio.sleep(1.0)  # three more passes: still there
            assert written()
            assert (await c.get("/jobs/live")).json()["state"] == "RUNNING"
            await c.post("/jobs/live/cancel", json={})
    finally:
        daemon.stop()


async def test_the_embedded_stores_history_holds_what_watchers_need(tmp_path: Path) -> None:
    """After a crash-looping job in an in-process daemon on its embedded store, the watch
    history holds a few thousand changes at most, not every change since the start."""
    daemon = make_daemon(tmp_path, persistent=True, allow_root=True, store_history_seconds=1.0)
    async with asyncio.timeout(100):
        await daemon.start()
        try:
            assert isinstance(daemon.store, EmbeddedStore)
            async with asgi_client(daemon) as c:
                spec = {
                    "id": "loop",
                    "entrypoint": sys.executable,
                    "args": ["-c", "import sys; sys.exit(3)"],
                    "max_restarts": 60,
                    "termination_grace": 1,
                }
                await c.post("/jobs", json=spec)
                await wait_job(c, "loop", {"FAILED"}, timeout=90)
            await asyncio.sleep(1.5)  # past the window of the last listings and watches
            await daemon.store.put("probe", b"x")  # a change: the history is trimmed
            changes, size = daemon.store.history_size()
            revision = daemon.store.revision
            assert revision > 1500  # the job made more changes than the history holds
            assert changes <= 1000 + 1 and size < 1 << 20
        finally:
            await daemon.shutdown()


async def test_finished_jobs_shrink_to_their_bounds_and_logs_go_as_attempts_end(
    tmp_path: Path,
) -> None:
    """Issue 34: a job that ended keeps its own first 2 and last 4 events (and its distinct
    failures), the finished jobs together at most ``event_retention_finished_total`` (the
    oldest then keeps its last event and the marker); with the periodic log pass an hour
    away, a crash loop's attempt folders never pile up past the bound and the running one."""
    env = {
        **RETENTION,
        "ELASTICD_EVENT_RETENTION_FINISHED_FIRST": "2",
        "ELASTICD_EVENT_RETENTION_FINISHED_LAST": "4",
        "ELASTICD_EVENT_RETENTION_FINISHED_TOTAL": "15",
        "ELASTICD_LOG_RETENTION_INTERVAL": "3600",
    }
    daemon = serve(tmp_path, env=env)
    try:
        await daemon.wait_ready()
        async with daemon.client() as c:
            most = 0
            for job_id in ("old", "new"):
                spec = {
                    "id": job_id,
                    "entrypoint": sys.executable,
                    "args": ["-c", "import sys, time; time.sleep(0.05); sys.exit(3)"],
                    "max_restarts": 12,
                    "termination_grace": 1,
                }
                assert (await c.post("/jobs", json=spec)).status_code in (200, 201)
                logs = daemon.state_dir / "logs" / job_id
                async with asyncio.timeout(90):
                    while (await c.get(f"/jobs/{job_id}")).json()["state"] != "FAILED":
                        if logs.is_dir():
                            folders = [p for p in logs.iterdir() if p.name.startswith("attempt_")]
                            most = max(most, len(folders))
                        await asyncio.sleep(0.05)
                # The finished policy: first 2 + last 4 + the 3 distinct failures + the
                # marker, and what the agent said after the end was seen (a few events).
                bound = 2 + 4 + 3 + 1 + 6

                def shrunk(job_id: str = job_id, bound: int = bound) -> bool:
                    return len(local_events(daemon.state_dir, job_id)) <= bound

                await eventually(shrunk, 20, f"{job_id}'s events shrunk to the finished policy")

            # Together over 15: the job that ended first keeps its last event and the marker
            # (and what landed after that trim).
            def summarised() -> bool:
                return len(local_events(daemon.state_dir, "old")) <= 2 + 4

            await eventually(summarised, 20, "the oldest finished job summarised")
            kinds = [k for _, k in local_events(daemon.state_dir, "old")]
            assert kinds[0] == "events.trimmed", kinds
            stored = (await c.get("/store/list", params={"prefix": "ev/old/"})).json()["entries"]
            assert len(stored) <= 2 + 4
            # At most the bound and the attempt being started (retention at each attempt end).
            assert most <= ATTEMPTS + 2, most
    finally:
        daemon.stop()
