"""The re-exec leaves no window open (issue 34): from the old image's decision to exec until the
new image has taken everything back (1 to 8.5 s on a loaded node, stretched here by
``ELASTICD_TEST_REEXEC_DELAY``), signals are held and honoured, the state folder stays locked,
a pre-flight that cannot start the new image keeps the old one, and no exit of it is one that
systemd would not restart."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import signal
import sqlite3
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.hardening.support import Served, eventually, healthy_pids, pid_alive, script
from tests.hardening.test_reexec import COUNTER, ROOT, health, kinds, running, submit

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.geteuid() != 0, reason="a root daemon")]

#: How long the re-executed image takes to start here, on top of its own start-up.
SLOW = "2"
ENV = {"PYTHONPATH": str(ROOT), "ELASTICD_TEST_REEXEC_DELAY": SLOW}

#: Pings and counts; on SIGTERM writes "term" to ``argv[1]``.<local rank> and exits 0.
TERMINABLE = """
import os, signal, sys, time
from elasticd.worker import ping
mark = f"{sys.argv[1]}.{os.environ['LOCAL_RANK']}"
def term(signum, frame):
    with open(mark, "w") as f:
        f.write("term")
    sys.exit(0)
signal.signal(signal.SIGTERM, term)
while True:
    ping()
    time.sleep(0.02)
"""


def lines(daemon: Served, text: str) -> int:
    """How many lines of the daemon's log hold ``text``."""
    return sum(text in line for line in daemon.output().splitlines())


async def in_the_window(daemon: Served, timeout: float = 90) -> None:
    """Return once the old image has said it execs now (the new image is not up yet)."""
    await eventually(lambda: lines(daemon, "exec'ing now") > 0, timeout, "the exec")


async def settled(daemon: Served, c: httpx.AsyncClient, timeout: float = 120) -> None:
    """Until the daemon has re-executed, every exec has come up as a ready image (each logs
    its window once) and the daemon is ready: ``/readyz`` is not ready while a reload is
    asked or checked (one held across the exec is asked as the image starts)."""
    deadline = time.monotonic() + timeout
    while True:
        assert daemon.proc.poll() is None, daemon.output()[-4000:]
        execs, ups = lines(daemon, "exec'ing now"), lines(daemon, "re-exec window:")
        with contextlib.suppress(httpx.TransportError):
            ready = execs == ups > 0 and (await c.get("/readyz", timeout=2)).status_code == 200
            if ready and lines(daemon, "re-executing in place") == execs:
                return
        assert time.monotonic() < deadline, daemon.output()[-4000:]
        await asyncio.sleep(0.1)


async def test_readyz_is_not_ready_from_a_reload_request_until_the_new_image(
    tmp_path: Path,
) -> None:
    """From a SIGHUP to the new image's ready, ``/readyz`` never says ready: while the reload
    is asked and its pre-flight checks the new program it says so (a caller that waits for
    ready, such as a storm's last held SIGHUP, is never told "ready" by an image that is about
    to exec)."""
    async with running(tmp_path, env=ENV, timeout=120) as (daemon, c):
        before = await health(c)
        daemon.proc.send_signal(signal.SIGHUP)
        # From when the daemon took the request (a poll sent with the signal may come first).
        await eventually(lambda: lines(daemon, "reload asked: checking") > 0, 60, "the request")
        said: list[tuple[int, str]] = []
        deadline = time.monotonic() + 90
        while True:
            assert daemon.proc.poll() is None, daemon.output()[-4000:]
            with contextlib.suppress(httpx.TransportError, ValueError):
                ready = await c.get("/readyz", timeout=2)
                if (await health(c))["started_at"] != before["started_at"]:
                    if ready.status_code == 200:
                        break  # the new image, ready
                else:
                    said.append((ready.status_code, ready.json().get("reason") or ""))
            assert time.monotonic() < deadline, (said, daemon.output()[-4000:])
            await asyncio.sleep(0.02)
        assert said and all(code == 503 for code, _ in said), said
        assert any("checking the new program" in reason for _, reason in said), said


async def test_a_sighup_storm_during_a_reload_coalesces(tmp_path: Path) -> None:
    """SIGHUP, then 9 more 0.2 s apart once the daemon says it re-executes (most land while
    the new image starts): the daemon lives through it, same pid; the running job keeps its
    worker pids, round and restart count; the held SIGHUPs coalesce (a few re-execs at most,
    not ten)."""
    worker = script(tmp_path, "counter.py", COUNTER)
    async with running(tmp_path, env=ENV, timeout=240) as (daemon, c):
        await submit(c, "storm", worker, nproc_per_node=2)
        pids = await healthy_pids(c, "storm", 2)
        before = await health(c)
        daemon.proc.send_signal(signal.SIGHUP)
        await eventually(lambda: lines(daemon, "re-executing in place") > 0, 90, "the re-exec")
        for _ in range(9):
            await asyncio.sleep(0.2)
            assert daemon.proc.poll() is None, daemon.output()[-4000:]
            daemon.proc.send_signal(signal.SIGHUP)
        await settled(daemon, c)
        after = await health(c)
        assert after["pid"] == before["pid"] == daemon.proc.pid
        assert after["started_at"] != before["started_at"]
        assert await healthy_pids(c, "storm", 2) == pids
        assert all(pid_alive(p) for p in pids)
        job = (await c.get("/jobs/storm")).json()
        assert (job["state"], job["restart_count"]) == ("RUNNING", 0), job
        seen = await kinds(c, "storm")
        assert 1 <= seen.count("daemon.reexec") <= 3, seen
        assert seen.count("daemon.reexec") == seen.count("job.readopted"), seen
        assert "workers.stopped" not in seen


def marks(mark: Path, ranks: int) -> list[str | None]:
    """What each rank wrote at its SIGTERM (None: it got none)."""
    found = [mark.with_name(f"{mark.name}.{rank}") for rank in range(ranks)]
    return [path.read_text() if path.exists() else None for path in found]


def daemon_events(state_dir: Path, job_id: str) -> list[dict[str, object]]:
    """A stopped daemon's own record of a job's events (read-only from its SQLite)."""
    path = state_dir / "elasticd.sqlite3"
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        rows = db.execute("SELECT doc FROM events WHERE job_id = ? ORDER BY seq", (job_id,))
        return [json.loads(doc) for (doc,) in rows.fetchall()]


async def test_a_sigterm_during_a_reload_is_the_normal_stop(tmp_path: Path) -> None:
    """SIGTERM while the new image starts: it is held across the exec and honoured by the new
    image as a normal stop: the workers get SIGTERM (and the grace), the daemon exits 0 and
    writes ``daemon.stopped`` on the job, as for any stop."""
    mark = tmp_path / "term"
    worker = script(tmp_path, "terminable.py", TERMINABLE)
    async with running(tmp_path, env=ENV, timeout=180) as (daemon, c):
        await submit(c, "term", worker, str(mark), nproc_per_node=2, termination_grace=10)
        pids = await healthy_pids(c, "term", 2)
        daemon.proc.send_signal(signal.SIGHUP)
        await in_the_window(daemon)
        daemon.proc.send_signal(signal.SIGTERM)
        await eventually(lambda: daemon.proc.poll() is not None, 90, "the daemon's stop")
        assert daemon.proc.returncode == 0, daemon.output()[-4000:]
        await eventually(lambda: not any(pid_alive(p) for p in pids), 10, "the workers' end")
        assert marks(mark, 2) == ["term", "term"], daemon.output()[-4000:]
        said = [e["kind"] for e in daemon_events(daemon.state_dir, "term")]
        assert "daemon.stopped" in said, said
        assert "daemon.reexec" in said, said  # the new image took the job up, then stopped it


def try_lock(path: Path) -> bool:
    """Whether the state folder's lock can be taken now (released at once if it was)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # closing drops a lock this took
    return True


async def test_a_second_serve_never_gets_the_state_lock_during_a_reload(tmp_path: Path) -> None:
    """From the SIGHUP until the new image is ready, the state folder's lock is never free
    (probed every 2 ms), and a second ``elasticd serve`` on the same folder, started again
    and again meanwhile, is refused every time (exit 2, naming the holder); the new image
    serves, with the job's workers untouched."""
    worker = script(tmp_path, "counter.py", COUNTER)
    async with running(tmp_path, env=ENV, timeout=240) as (daemon, c):
        await submit(c, "locked", worker)
        pids = await healthy_pids(c, "locked", 1)
        lock = daemon.state_dir / "elasticd.lock"
        assert not try_lock(lock)
        second = [*daemon.args]
        port = second.index("--port") + 1
        second[port] = "0"
        free: list[float] = []
        refusals: list[tuple[int, str]] = []
        done = asyncio.Event()

        async def probe() -> None:
            while not done.is_set():
                if try_lock(lock):
                    free.append(time.monotonic())
                await asyncio.sleep(0.002)

        async def rival() -> None:
            while not done.is_set():
                proc = await asyncio.create_subprocess_exec(
                    *second,
                    env=daemon.environ,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
                out, _ = await proc.communicate()
                refusals.append((proc.returncode or 0, out.decode(errors="replace")))
                if proc.returncode != 2:
                    return

        before = await health(c)
        tasks = [asyncio.create_task(probe()), asyncio.create_task(rival())]
        daemon.proc.send_signal(signal.SIGHUP)
        try:
            await settled(daemon, c)
        finally:
            done.set()
            await asyncio.gather(*tasks)
        assert not free, f"the lock was free {len(free)} time(s) during the reload"
        assert refusals, "the second serve never ran"
        assert all(
            code == 2 and "is in use by another elasticd" in out for code, out in refusals
        ), refusals[-1]
        assert (await health(c))["started_at"] != before["started_at"]
        assert await healthy_pids(c, "locked", 1) == pids
        assert "job.readopted" in await kinds(c, "locked")
        assert not try_lock(lock)


async def test_a_failed_start_of_the_new_image_is_an_exit_systemd_restarts(tmp_path: Path) -> None:
    """The new image cannot start (its token file went away after the pre-flight): it exits 1,
    which the unit restarts (2 is its RestartPreventExitStatus), never 2."""
    worker = script(tmp_path, "counter.py", COUNTER)
    async with running(tmp_path, env=ENV, timeout=180) as (daemon, c):
        await submit(c, "gone", worker)
        await healthy_pids(c, "gone", 1)
        token = daemon.args[daemon.args.index("--token-file") + 1]
        daemon.proc.send_signal(signal.SIGHUP)
        await in_the_window(daemon)
        os.unlink(token)
        await eventually(lambda: daemon.proc.poll() is not None, 60, "the new image's end")
        assert daemon.proc.returncode == 1, daemon.output()[-3000:]
        assert "the re-executed daemon cannot start" in daemon.output()
