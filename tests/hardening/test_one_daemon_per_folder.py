"""One daemon per state folder: a second `elasticd serve` (or `elasticd run --state-dir`) on a
live daemon's folder exits 2 naming the holder's pid, and the first daemon's job is untouched
(issue 23, item 1). Before the lock, the second daemon's start-up sweep killed the first one's
worker as an orphan and its stop removed the first one's cgroup subtree."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elasticd.errors import ConfigError
from elasticd.node.statelock import LOCK_FILE, StateLock, busy_message
from tests.hardening.support import (
    PY,
    SLEEPER,
    cgroup_home,
    daemon_subtree,
    eventually,
    healthy_pids,
    pid_alive,
    script,
    serve,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _second(args: list[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICD_")}
    env["ELASTICD_ALLOW_ROOT"] = "true"
    return subprocess.run(
        args, env=env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )


async def test_a_second_daemon_on_a_live_folder_exits_2_and_leaves_the_first_alone(
    tmp_path: Path,
) -> None:
    """The first daemon runs a job; `elasticd serve` and `elasticd run --state-dir` on its
    folder each exit 2 with one line naming its pid; its worker is the same live pid, no
    restart charged, no orphan killed, its cgroup subtree still there."""
    sleeper = script(tmp_path, "sleeper.py", SLEEPER)
    node = "lock-node"
    first = serve(tmp_path, node_name=node)
    try:
        async with asyncio.timeout(90):
            await first.wait_ready()
            async with first.client() as c:
                r = await c.post("/jobs", json={"id": "held", "entrypoint": PY, "args": [sleeper]})
                assert r.status_code == 201, r.text
                (pid,) = await healthy_pids(c, "held", 1)
            home = cgroup_home()
            subtree = daemon_subtree(home, node, first.state_dir) if home else None
            if subtree is not None:
                assert subtree.is_dir()

            started = time.monotonic()
            second = serve(tmp_path, node_name=node, state_dir=first.state_dir)
            try:
                await eventually(
                    lambda: second.proc.poll() is not None, 30, "the second daemon to refuse"
                )
            finally:
                second.stop()
            print(
                f"second daemon refused (exit {second.proc.returncode}) after "
                f"{time.monotonic() - started:.2f} s"
            )
            said = second.output()
            assert second.proc.returncode == 2, said
            assert "Traceback" not in said, said
            line = next(ln for ln in said.splitlines() if "in use by another elasticd" in ln)
            assert f"pid {first.proc.pid}" in line and str(first.state_dir) in line, said

            run = await asyncio.to_thread(
                _second,
                [sys.executable, "-m", "elasticd", "run", "--state-dir", str(first.state_dir)]
                + ["--", PY, "-c", "pass"],
            )
            assert run.returncode == 2, run.stderr
            assert "Traceback" not in run.stderr, run.stderr
            assert f"pid {first.proc.pid}" in run.stderr, run.stderr
            assert not (first.state_dir / "run-token").exists()  # refused before writing

            assert pid_alive(pid)
            if subtree is not None:
                assert subtree.is_dir()
            async with first.client() as c:
                job = (await c.get("/jobs/held")).json()
                events = (await c.get("/jobs/held/events", params={"after": 0})).json()
                assert await healthy_pids(c, "held", 1) == [pid]
                await c.post("/jobs/held/cancel", json={})
    finally:
        first.stop()
    assert job["state"] == "RUNNING" and job["restart_count"] == 0, job
    kinds = [e["kind"] for e in events]
    assert "worker.orphan_killed" not in kinds and "workers.strays" not in kinds, kinds
    assert kinds.count("workers.started") == 1, kinds
    assert first.proc.returncode == 0


async def test_the_lock_goes_with_its_holder_even_after_kill_9(tmp_path: Path) -> None:
    """kill -9 of the holder leaves no stale lock: the next daemon on the folder starts."""
    first = serve(tmp_path, node_name="lock-kill")
    try:
        await first.wait_ready()
        assert (first.state_dir / LOCK_FILE).read_text().strip() == str(first.proc.pid)
    finally:
        first.kill9()
    again = serve(tmp_path, node_name="lock-kill", state_dir=first.state_dir)
    try:
        await again.wait_ready()
        assert (first.state_dir / LOCK_FILE).read_text().strip() == str(again.proc.pid)
    finally:
        again.stop()
    assert again.proc.returncode == 0, again.output()[-2000:]


def test_the_lock_refuses_a_second_holder_and_names_the_first(tmp_path: Path) -> None:
    """In one process too (two open descriptions): the second acquire is a ConfigError with the
    pid; once the first lets go, it succeeds; the descriptor is not inherited across exec."""
    with StateLock(tmp_path / "state") as held:
        with pytest.raises(ConfigError, match=f"pid {os.getpid()}"):
            StateLock(tmp_path / "state").acquire()
        assert held.held
        fd = held._fd
        assert fd is not None and not os.get_inheritable(fd)
    with StateLock(tmp_path / "state"):
        pass
    assert "has not written" in busy_message(tmp_path, "")
