"""A full local disk must not hang jobs silently (issue 12, defect 2).

A real ``elasticd serve`` keeps its state folder (event log, embedded store)
and its log folder on a small tmpfs. The test fills the tmpfs until ENOSPC
while a worker prints continuously, then makes the worker exit 7. While the
disk is full the daemon must stay alive and answer, say "not ready" with a
reason that names the disk, and not show the dead worker as HEALTHY. Once the
filler is removed it must recover by itself (no restart): the job ends as its
worker decided (FAILED, exit code 7, not a daemon crash), the events of the
exit are there in order, and one event counts the log bytes it could not
write. A job submitted while the disk is full is refused with 507 and
nothing of it is left behind.

Needs root (``mount -t tmpfs``), as CI has.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.hardening.support import PY, Served, healthy_pids, pid_alive, script, serve

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(180),
    pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root"),
]

#: Big enough for the daemon's start and a job's first events, small enough to fill fast.
TMPFS_SIZE = "8m"

#: How long the disk stays full after the worker's exit (every write is retried meanwhile).
HOLD_S = 4.0


@contextlib.contextmanager
def tmpfs(folder: Path) -> Iterator[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs", str(folder)], check=True)  # fmt: skip
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def fill(folder: Path) -> Path:
    """Write a filler file until the filesystem says ENOSPC; returns its path."""
    filler = folder / "filler"
    chunk = b"\0" * 65536
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        while True:
            try:
                os.write(fd, chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                if len(chunk) == 1:
                    break
                chunk = chunk[: len(chunk) // 2]
    finally:
        os.close(fd)
    return filler


async def poll(predicate: Callable[[], Awaitable[Any]], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(httpx.TransportError):
            value = await predicate()
            if value:
                return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.1)


def chatty_worker(folder: Path) -> str:
    """Prints a line every 10 ms; exits with the code written to ``trigger`` once it exists."""
    return script(
        folder,
        "chatty.py",
        """
        import os, sys, time
        trigger = sys.argv[1]
        n = 0
        while True:
            if os.path.exists(trigger):
                code = int(open(trigger).read() or 0)
                print("exiting with", code, flush=True)
                sys.exit(code)
            n += 1
            print("line", n, "x" * 100, flush=True)
            time.sleep(0.01)
        """,
    )


async def events_of(c: httpx.AsyncClient, job_id: str) -> list[dict[str, Any]]:
    r = await c.get(f"/jobs/{job_id}/events")
    r.raise_for_status()
    return list(r.json())


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Served]:
    with tmpfs(tmp_path / "disk") as disk:
        served = serve(tmp_path, state_dir=disk / "state", verbose=True)
        try:
            yield served
        finally:
            served.stop()
            with contextlib.suppress(FileNotFoundError):
                (disk / "filler").unlink()


async def test_a_full_disk_degrades_readiness_and_the_daemon_recovers_by_itself(
    tmp_path: Path, daemon: Served
) -> None:
    """The worker's exit during a full disk ends the job as FAILED with its code, once space returns."""
    await daemon.wait_ready()
    disk = daemon.state_dir.parent
    trigger = tmp_path / "trigger"
    worker = chatty_worker(tmp_path)
    async with daemon.client() as c:
        r = await c.post(
            "/jobs",
            json={"id": "chatty", "entrypoint": PY, "args": ["-u", worker, str(trigger)],
                  "nproc_per_node": 1, "max_restarts": 0},
        )  # fmt: skip
        assert r.status_code == 201, r.text

        async def running() -> int | None:
            view = (await c.get("/jobs/chatty/workers")).json()
            for group in view.get("groups", []):
                if group["state"] == "HEALTHY" and group["workers"][0].get("pid"):
                    return int(group["workers"][0]["pid"])
            return None

        pid = await poll(running, 30, "the worker to run")
        filler = fill(disk)

        async def disk_named() -> str | None:
            r = await c.get("/readyz")
            reason = r.json().get("reason") or ""
            return reason if r.status_code == 503 and "disk" in reason.lower() else None

        # The worker's output can no longer be written: readiness says so.
        reason = await poll(disk_named, 20, "/readyz 503 naming the disk")
        (tmp_path / "trigger.tmp").write_text("7")
        os.replace(tmp_path / "trigger.tmp", trigger)  # never seen half-written
        await poll(lambda: _async(not pid_alive(pid)), 20, "the worker to exit")

        # Everything the daemon writes now fails: it must keep answering and supervising.
        async def not_healthy() -> dict[str, Any] | None:
            r = await c.get("/jobs/chatty/workers")
            if r.status_code != 200:
                return None
            view = r.json()
            workers = [w for g in view["groups"] for w in g["workers"]]
            if workers and all(w["state"] != "HEALTHY" for w in workers):
                return view
            return None

        view = await poll(not_healthy, 20, "/workers to stop showing the dead worker HEALTHY")
        assert any(w.get("exit_code") == 7 for g in view["groups"] for w in g["workers"]), view

        # The disk stays full for a while (every write retried meanwhile): alive, answering,
        # not ready, the job not ended by anyone but its worker.
        hold_until = time.monotonic() + HOLD_S
        while time.monotonic() < hold_until:
            assert daemon.proc.poll() is None, daemon.output()[-3000:]
            assert (await c.get("/healthz")).status_code == 200
            r = await c.get("/readyz")
            assert r.status_code == 503 and "disk" in (r.json().get("reason") or "").lower(), r.text
            r = await c.get("/jobs/chatty")
            assert r.status_code == 200 and r.json()["state"] in ("RUNNING", "RESTARTING"), r.text
            assert await not_healthy(), "the dead worker is shown HEALTHY again"
            await asyncio.sleep(0.2)

        # A new job now cannot be recorded: refused, clearly, and nothing of it is kept.
        r = await c.post(
            "/jobs", json={"id": "late", "entrypoint": PY, "args": ["-c", "pass"], "nproc_per_node": 1}
        )  # fmt: skip
        assert r.status_code == 507, r.text
        assert r.headers["content-type"].startswith("application/problem+json")
        assert "disk" in r.json()["detail"].lower() or "storage" in r.json()["detail"].lower()

        # Space comes back: the daemon recovers by itself, no restart.
        filler.unlink()
        started = time.monotonic()

        async def ready() -> bool:
            return (await c.get("/readyz")).status_code == 200

        await poll(ready, 30, "/readyz back to 200 without a restart")
        recovered_in = time.monotonic() - started

        async def failed() -> dict[str, Any] | None:
            job = (await c.get("/jobs/chatty")).json()
            return job if job["state"] == "FAILED" else None

        job = await poll(failed, 30, "the job to end FAILED")
        assert job["error"]["exit_code"] == 7, job
        assert "daemon" not in (job.get("reason") or ""), job
        assert daemon.proc.poll() is None, "the daemon must not have been restarted"

        events = await events_of(c, "chatty")
        kinds = [e["kind"] for e in events]
        assert not any(k in ("job.resumed", "daemon.stopped", "agent.error") for k in kinds), kinds
        exited = [e for e in events if e["kind"] == "worker.exited"]
        assert exited and exited[0]["exit_code"] == 7, exited
        # In order: the exit, then the job's end; no restart was left, none is announced
        # (issue 41).
        last = max(
            i for i, e in enumerate(events) if e["kind"] == "job.state" and e["state"] == "FAILED"
        )
        assert kinds.index("worker.exited") < last and "group.restarting" not in kinds, kinds
        # One event tells the job its node could not write for a while, after what it kept.
        assert kinds.index("worker.exited") < kinds.index("storage.back"), kinds
        assert "disk" in events[kinds.index("storage.back")]["message"]
        lost = [e for e in events if e["kind"] == "logs.lost"]
        assert lost, kinds
        assert lost[0]["bytes_lost"] > 0, lost[0]
        assert "late" not in {j["id"] for j in (await c.get("/jobs")).json()["jobs"]}
        log = daemon.output()
        assert "Task exception was never retrieved" not in log
        assert "Traceback" not in log, log[-3000:]
        print(
            f"recovered {recovered_in:.2f} s after the filler was removed; readyz said {reason!r}"
        )


async def _async(value: bool) -> bool:
    return value


async def test_sigterm_while_the_disk_is_full_exits_and_the_job_resumes_after(
    tmp_path: Path, daemon: Served
) -> None:
    """A stop while nothing can be written is bounded; restarted with space, the job goes on."""
    await daemon.wait_ready()
    disk = daemon.state_dir.parent
    worker = chatty_worker(tmp_path)
    async with daemon.client() as c:
        r = await c.post(
            "/jobs",
            json={"id": "kept", "entrypoint": PY, "args": ["-u", worker, str(tmp_path / "never")],
                  "nproc_per_node": 1, "max_restarts": 0},
        )  # fmt: skip
        assert r.status_code == 201, r.text

        await poll(lambda: healthy(c, "kept"), 30, "the worker to run")
        filler = fill(disk)

        async def not_ready() -> bool:
            return (await c.get("/readyz")).status_code == 503

        await poll(not_ready, 20, "/readyz 503")
    started = time.monotonic()
    daemon.proc.terminate()
    rc = await asyncio.to_thread(daemon.proc.wait, 60)
    stopped_in = time.monotonic() - started
    assert rc == 0, daemon.output()[-3000:]
    assert stopped_in < 30, stopped_in
    filler.unlink()
    again = serve(tmp_path, state_dir=daemon.state_dir, port=daemon.port, verbose=True)
    daemon.proc = again.proc  # the fixture stops this one
    await again.wait_ready()
    async with again.client() as c:
        await poll(lambda: healthy(c, "kept"), 30, "the job to run again after the restart")
        job = (await c.get("/jobs/kept")).json()
        assert job["state"] == "RUNNING" and job["restart_count"] == 0, job
        kinds = [e["kind"] for e in await events_of(c, "kept")]
        assert "job.resumed" in kinds or "daemon.stopped" in kinds, kinds
    assert "never retrieved" not in daemon.output()
    print(f"stopped in {stopped_in:.1f} s with the disk full")


async def healthy(c: httpx.AsyncClient, job_id: str) -> bool:
    view = (await c.get(f"/jobs/{job_id}/workers")).json()
    return any(g["state"] == "HEALTHY" for g in view.get("groups", []))


#: Pings its heartbeat and counts, quietly (the disk stays full while it runs).
QUIET_COUNTER = """
import time
from elasticd.worker import ping
while True:
    ping()
    time.sleep(0.05)
"""


async def test_a_reload_on_a_full_disk_is_refused_and_the_daemon_stays(tmp_path: Path) -> None:
    """The state disk is full when SIGHUP asks for a reload: the pre-flight finds no room for
    the new image's first writes, so the daemon stays as it is (same image, same workers)
    and says why in ``daemon.reexec_refused``; it never exits (it used to exit 2, a status
    systemd does not restart, with every worker dead)."""
    worker = script(tmp_path, "quiet.py", QUIET_COUNTER)
    with tmpfs(tmp_path / "disk") as disk:
        served = serve(tmp_path, state_dir=disk / "state", env={"PYTHONPATH": str(ROOT)})
        try:
            async with asyncio.timeout(150), served.client() as c:
                await served.wait_ready()
                body = {
                    "id": "full",
                    "entrypoint": PY,
                    "args": [worker],
                    "env": {"PYTHONPATH": str(ROOT)},
                }
                assert (await c.post("/jobs", json=body)).status_code == 201
                pids = await healthy_pids(c, "full", 1)
                before = (await c.get("/healthz")).json()
                filler = fill(disk)
                served.proc.send_signal(signal.SIGHUP)
                await poll(lambda: _said(served, "re-exec refused"), 90, "the refusal")
                assert served.proc.poll() is None, served.output()[-3000:]
                filler.unlink()
                refused = await poll(lambda: _refusals(c, "full"), 60, "daemon.reexec_refused")
                assert "no room for the new image's first writes" in refused[0]["message"], refused
                assert (await c.get("/healthz")).json()["started_at"] == before["started_at"]
                assert await healthy_pids(c, "full", 1) == pids
                assert all(pid_alive(p) for p in pids)
        finally:
            served.stop()


async def _said(served: Served, text: str) -> bool:
    assert served.proc.poll() is None, served.output()[-3000:]
    return text in served.output()


async def _refusals(c: httpx.AsyncClient, job_id: str) -> list[dict[str, Any]]:
    return [e for e in await events_of(c, job_id) if e["kind"] == "daemon.reexec_refused"]
