"""A process that leaves its worker's process group (double fork + setsid) dies with the attempt.

Each test runs a real root `elasticd serve` whose job is a tiny `/bin/sh`
worker: it starts a grandchild in a session of its own (a subshell that
exits at once, so the grandchild is re-parented), which appends its pid to a
file and sleeps. The grandchild must be dead (polled under a deadline) and
reported in a ``workers.strays`` event after: the job's normal end, a cancel,
the daemon's SIGTERM, the daemon's ``kill -9`` and restart (the start-up
sweep), a job run as ``nobody`` (which also tries to leave its cgroup and is
refused), and with ``containment = "subreaper"`` (the fallback, which says
it is partial). Every cgroup a daemon made is gone at the end of each test.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pwd
import shutil
import sqlite3
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.hardening.support import (
    Served,
    cgroup_home,
    daemon_subtree,
    eventually,
    pid_alive,
    proc_state,
    proc_uid,
    serve,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


CGROUP_HOME = cgroup_home()
NEEDS_CGROUPS = pytest.mark.skipif(
    CGROUP_HOME is None, reason="needs root and a writable cgroup v2 (CI has both)"
)

#: ``$1`` a folder anyone may write, ``$2`` ``exit`` or ``sleep``. The grandchild keeps the
#: worker's stdout (so it also holds the log pipe), tries to leave its cgroup when ``$ESCAPE``
#: is set (only as nobody: a root job can always leave), then sleeps; the worker goes on
#: (exits or sleeps) only once the grandchild has done all that.
WORKER = r"""#!/bin/sh
drop=$1
( setsid /bin/sh -c '
    drop=$0 worker=$1
    echo $$ >> "$drop/strays"
    own=$(sed -n "s/^0:://p" /proc/self/cgroup)
    echo "$own" > "$drop/cgroup.$$"
    if [ -n "$ESCAPE" ]; then
        for target in "$CGROOT/cgroup.procs" "$CGROOT$(dirname "$own")/cgroup.procs"; do
            if echo $$ > "$target" 2>/dev/null; then echo "moved $target"; else echo denied; fi
        done > "$drop/escape.$$"
        if echo 1 > "$CGROOT$own/cgroup.freeze" 2>/dev/null; then
            echo wrote >> "$drop/escape.$$"
        fi
    else
        echo skipped > "$drop/escape.$$"
    fi
    : > "$drop/ready.$worker"
    exec sleep 100000' "$drop" $$ & )
while [ ! -e "$drop/ready.$$" ]; do sleep 0.05; done
echo worker started
if [ "$2" = sleep ]; then exec sleep 100000; fi
exit 0
"""


def _subtree(node: str, state_dir: Path) -> Path:
    assert CGROUP_HOME is not None
    return daemon_subtree(CGROUP_HOME, node, state_dir)


def _kill_subtree(path: Path) -> None:
    """Best-effort cleanup after a failed test: kill and remove every cgroup under ``path``."""
    if not path.exists():
        return
    for child in sorted((p for p in path.rglob("*") if p.is_dir()), reverse=True):
        with contextlib.suppress(OSError):
            (child / "cgroup.kill").write_text("1")
        for _ in range(200):
            with contextlib.suppress(OSError):
                child.rmdir()
                break
            os.sched_yield()
    with contextlib.suppress(OSError):
        path.rmdir()


@pytest.fixture
def open_tmp() -> Iterator[Path]:
    """A temporary folder other users can reach (pytest's own is 0700 under a 0700 parent)."""
    path = Path(tempfile.mkdtemp(prefix="elasticd-containment-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def drop(open_tmp: Path) -> Iterator[Path]:
    """A folder every user may write to, and the cleanup of what a failed test leaves."""
    folder = open_tmp / "drop"
    folder.mkdir()
    folder.chmod(0o777)
    (open_tmp / "worker.sh").write_text(WORKER)
    (open_tmp / "worker.sh").chmod(0o755)
    yield folder
    for pid in _stray_pids(folder):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)
    if CGROUP_HOME is not None:
        for sub in CGROUP_HOME.glob("elasticd.cg-*"):
            _kill_subtree(sub)


def _stray_pids(drop: Path) -> list[int]:
    path = drop / "strays"
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def _daemon(root: Path, node: str, *extra: str, env: dict[str, str] | None = None) -> Served:
    return serve(root, *extra, node_name=node, env=env)


def _cgroup_mount() -> str:
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        if right.split()[:1] == ["cgroup2"]:
            return left.split()[4]
    return "/nonexistent"


async def _submit(
    c: httpx.AsyncClient, root: Path, job_id: str, mode: str, *, escape: bool = False
) -> None:
    body = {
        "id": job_id,
        "entrypoint": "/bin/sh",
        "args": [str(root / "worker.sh"), str(root / "drop"), mode],
        "env": {"CGROOT": _cgroup_mount(), **({"ESCAPE": "1"} if escape else {})},
        "termination_grace": 2,
        "max_restarts": 0,
    }
    r = await c.post("/jobs", json=body)
    assert r.status_code == 201, r.text


async def _first_stray(drop: Path) -> int:
    await eventually(lambda: bool(_stray_pids(drop)), 30, "the grandchild to start")
    pid = _stray_pids(drop)[0]
    await eventually(lambda: (drop / f"escape.{pid}").exists(), 10, "its escape attempts")
    return pid


async def _events(c: httpx.AsyncClient, job_id: str) -> list[dict[str, Any]]:
    return list((await c.get(f"/jobs/{job_id}/events", params={"after": 0})).json())


async def _wait_event(c: httpx.AsyncClient, job_id: str, kind: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []

    async def poll() -> None:
        while True:
            found[:] = [e for e in await _events(c, job_id) if e["kind"] == kind]
            if found:
                return
            await asyncio.sleep(0.05)

    async with asyncio.timeout(30):
        await poll()
    return found


def _events_on_disk(state_dir: Path, job_id: str) -> list[dict[str, Any]]:
    db = sqlite3.connect(state_dir / "elasticd.sqlite3")
    try:
        rows = db.execute("SELECT doc FROM events WHERE job_id = ? ORDER BY seq", (job_id,))
        return [json.loads(doc) for (doc,) in rows]
    finally:
        db.close()


def _assert_reported(events: list[dict[str, Any]], pid: int) -> None:
    strays = [e for e in events if e["kind"] == "workers.strays"]
    assert any(pid in (e.get("pids") or []) for e in strays), strays or events
    assert all(e["count"] == len(e["pids"]) for e in strays)


def _assert_contained(drop: Path, pid: int) -> None:
    cgroup = (drop / f"cgroup.{pid}").read_text().strip()
    assert "/elasticd.cg-" in cgroup and "/a0." in cgroup, cgroup  # its attempt's cgroup


@NEEDS_CGROUPS
async def test_a_stray_dies_when_the_job_ends_normally(open_tmp: Path, drop: Path) -> None:
    """The worker exits 0 leaving a setsid grandchild: the job SUCCEEDS, the grandchild is
    killed with the attempt and reported; the daemon's cgroups are gone after its stop."""
    daemon = _daemon(open_tmp, "cg-end")
    try:
        await daemon.wait_ready()
        async with daemon.client() as c:
            await _submit(c, open_tmp, "ends", "exit")
            pid = await _first_stray(drop)
            _assert_contained(drop, pid)
            await _wait_event(c, "ends", "workers.strays")
            took = await eventually(lambda: not pid_alive(pid), 10, "the grandchild to die")
            events = await _events(c, "ends")
            # The strays are reported when the attempt's cgroup goes, before the job's end
            # is written: wait for the end (a stray's death must not fail the job).
            job = (await c.get("/jobs/ends")).json()
            async with asyncio.timeout(30):
                while job["state"] not in ("SUCCEEDED", "FAILED", "CANCELLED"):
                    await asyncio.sleep(0.05)
                    job = (await c.get("/jobs/ends")).json()
    finally:
        daemon.stop()
    assert job["state"] == "SUCCEEDED", job
    _assert_reported(events, pid)
    assert took < 10
    assert not _subtree("cg-end", daemon.state_dir).exists()


@NEEDS_CGROUPS
async def test_a_stray_dies_when_the_job_is_cancelled(open_tmp: Path, drop: Path) -> None:
    """Cancel of a running job: the grandchild that left the worker's group dies too."""
    daemon = _daemon(open_tmp, "cg-cancel")
    try:
        await daemon.wait_ready()
        async with daemon.client() as c:
            await _submit(c, open_tmp, "cancelled", "sleep")
            pid = await _first_stray(drop)
            r = await c.post("/jobs/cancelled/cancel", json={})
            assert r.status_code == 200, r.text
            await eventually(lambda: not pid_alive(pid), 15, "the grandchild to die")
            await _wait_event(c, "cancelled", "workers.strays")
            events = await _events(c, "cancelled")
    finally:
        daemon.stop()
    _assert_reported(events, pid)
    assert not _subtree("cg-cancel", daemon.state_dir).exists()


@NEEDS_CGROUPS
async def test_a_stray_dies_when_the_daemon_is_stopped(open_tmp: Path, drop: Path) -> None:
    """SIGTERM of the daemon (systemctl stop): it stops the attempt, grandchild included, and
    the strays event is in its event log before it exits 0."""
    daemon = _daemon(open_tmp, "cg-term")
    try:
        await daemon.wait_ready()
        async with daemon.client() as c:
            await _submit(c, open_tmp, "stopped", "sleep")
            pid = await _first_stray(drop)
    finally:
        daemon.stop()
    assert daemon.proc.returncode == 0, daemon.output()[-3000:]
    await eventually(lambda: not pid_alive(pid), 5, "the grandchild to die")
    _assert_reported(_events_on_disk(daemon.state_dir, "stopped"), pid)
    assert not _subtree("cg-term", daemon.state_dir).exists()


@NEEDS_CGROUPS
async def test_a_stray_left_by_a_killed_daemon_is_swept_at_its_restart(
    open_tmp: Path, drop: Path
) -> None:
    """kill -9 of the daemon: its worker dies (parent-death signal) but the grandchild does not;
    the restarted daemon finds it in its attempt cgroup, kills it before resuming the job, and
    reports it."""
    daemon = _daemon(open_tmp, "cg-kill")
    try:
        await daemon.wait_ready()
        async with daemon.client() as c:
            await _submit(c, open_tmp, "crashed", "sleep")
            pid = await _first_stray(drop)
        daemon.kill9()
        await asyncio.sleep(0.5)
        assert pid_alive(pid)  # the fault: nothing but the sweep can end it now
        restarted = serve(
            open_tmp,
            node_name="cg-kill",
            state_dir=daemon.state_dir,
        )
        try:
            await restarted.wait_ready()
            took = await eventually(lambda: not pid_alive(pid), 10, "the sweep to kill it")
            async with restarted.client() as c:
                swept = await _wait_event(c, "crashed", "workers.strays")
                await c.post("/jobs/crashed/cancel", json={})
        finally:
            restarted.stop()
    finally:
        daemon.kill9()
    assert took < 10
    assert pid in swept[0]["pids"] and swept[0]["source"] == "daemon", swept
    for later in _stray_pids(drop):  # the resumed attempt's grandchild went with the cancel
        await eventually(lambda p=later: not pid_alive(p), 10, f"stray {later} to die")
    assert not _subtree("cg-kill", daemon.state_dir).exists()


@NEEDS_CGROUPS
async def test_a_job_user_cannot_leave_its_cgroup_or_write_it(open_tmp: Path, drop: Path) -> None:
    """Run as nobody: the grandchild runs as nobody, cannot move itself to the root or the
    daemon's cgroup nor freeze its own, and dies at the cancel."""
    nobody = pwd.getpwnam("nobody")
    daemon = _daemon(
        open_tmp, "cg-nobody", "--run-as", "nobody", env={"ELASTICD_ALLOW_ROOT": "false"}
    )
    try:
        await daemon.wait_ready()
        async with daemon.client() as c:
            await _submit(c, open_tmp, "as-nobody", "sleep", escape=True)
            pid = await _first_stray(drop)
            uid = proc_uid(pid)
            _assert_contained(drop, pid)
            r = await c.post("/jobs/as-nobody/cancel", json={})
            assert r.status_code == 200, r.text
            await eventually(lambda: not pid_alive(pid), 15, "the grandchild to die")
            await _wait_event(c, "as-nobody", "workers.strays")
            events = await _events(c, "as-nobody")
    finally:
        daemon.stop()
    assert uid == nobody.pw_uid
    assert (drop / f"escape.{pid}").read_text().split() == ["denied", "denied"]
    _assert_reported(events, pid)
    assert not _subtree("cg-nobody", daemon.state_dir).exists()


async def test_the_subreaper_fallback_says_it_is_partial_and_still_kills_the_stray(
    open_tmp: Path, drop: Path
) -> None:
    """containment = subreaper: a containment.partial event (once), and the grandchild,
    re-parented to the daemon when its parent exited, is killed and reaped at the job's end."""
    daemon = _daemon(open_tmp, "cg-reaper", env={"ELASTICD_CONTAINMENT": "subreaper"})
    try:
        await daemon.wait_ready()
        async with daemon.client() as c:
            await _submit(c, open_tmp, "reaped", "exit")
            pid = await _first_stray(drop)
            await eventually(lambda: not pid_alive(pid), 15, "the grandchild to die")
            await _wait_event(c, "reaped", "workers.strays")
            events = await _events(c, "reaped")
            job = (await c.get("/jobs/reaped")).json()
    finally:
        daemon.stop()
    assert job["state"] == "SUCCEEDED", job
    partial = [e for e in events if e["kind"] == "containment.partial"]
    assert len(partial) == 1 and "subreaper" in partial[0]["message"], partial
    _assert_reported(events, pid)
    assert proc_state(pid) is None  # reaped by the daemon, not left a zombie
