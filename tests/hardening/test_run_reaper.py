"""`kill -9` of `elasticd run` leaves nothing of its job running (issue 23, item 3).

The job's worker double-forks a `setsid sleep 600`, which the parent-death signal does not
reach and which, before the run reaper, ran on after the embedded daemon was killed (nothing
ever swept its temporary state). Now a reaper child that outlives `elasticd run` kills the
run's cgroup subtree (or, without cgroups, the processes whose environment names the run)
and removes its temporary state; a run that ends normally leaves no reaper behind.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from elasticd.supervise.reaper import REAPER_SOURCE
from tests.hardening.support import cgroup_home, daemon_subtree, eventually, pid_alive

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

#: ``$1``: where to write the pids. The grandchild leaves the worker's session at once.
WORKER = r"""#!/bin/sh
( setsid sleep 600 & echo $! > "$1/grandchild.pid" )
echo $$ > "$1/worker.pid"
exec sleep 600
"""


def _subtree(state_dir: Path) -> Path | None:
    home = cgroup_home()
    return None if home is None else daemon_subtree(home, "localhost", state_dir)


def _reapers(marker: str) -> list[int]:
    """Live reaper processes whose settings mention ``marker``."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            argv = Path(f"/proc/{name}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            len(argv) > 5
            and argv[4] == REAPER_SOURCE.encode()
            and marker.encode() in argv[5]
            and pid_alive(int(name))
        ):
            found.append(int(name))
    return found


def _pid(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    return int(text) if text.isdigit() else None


def _run(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICD_")}
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "elasticd", "run", *args],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


async def test_kill_9_of_elasticd_run_kills_its_setsid_grandchild_and_cleans_up(
    tmp_path: Path,
) -> None:
    """kill -9 of `elasticd run`: the worker and its setsid grandchild are dead within 5 s,
    the run's cgroup subtree and temporary state folder are gone, and so is the reaper."""
    drop = tmp_path / "drop"
    drop.mkdir()
    (tmp_path / "worker.sh").write_text(WORKER)
    log = tmp_path / "run.log"
    run = _run(["--run-id", "reaped", "--", "/bin/sh", str(tmp_path / "worker.sh"), str(drop)], log)
    worker = grandchild = None
    try:
        await eventually(
            lambda: _pid(drop / "grandchild.pid") is not None and _pid(drop / "worker.pid"),
            30,
            "the worker and its grandchild",
        )
        worker, grandchild = _pid(drop / "worker.pid"), _pid(drop / "grandchild.pid")
        assert worker and grandchild
        found = re.search(r"token in (\S+)/run-token", log.read_text())
        assert found, log.read_text()
        state_dir = Path(found.group(1))
        subtree = _subtree(state_dir)
        if subtree is not None:
            assert subtree.is_dir()
        reapers = _reapers(str(subtree) if subtree else "reaped")
        killed = time.monotonic()
        run.send_signal(signal.SIGKILL)
        run.wait(10)
        await eventually(
            lambda: not pid_alive(worker) and not pid_alive(grandchild), 5, "the job to die"
        )
        took = time.monotonic() - killed
        await eventually(lambda: not state_dir.exists(), 5, "the temporary state to go")
        assert len(reapers) == 1, reapers
        await eventually(lambda: not pid_alive(reapers[0]), 5, "the reaper to exit")
        if subtree is not None:
            await eventually(lambda: not subtree.exists(), 5, "the cgroup subtree to go")
        print(f"kill -9 -> job dead {took:.3f} s; all clean {time.monotonic() - killed:.3f} s")
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
        for pid in (worker, grandchild):
            if pid and pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


async def test_a_run_that_ends_normally_leaves_no_reaper_and_its_job_succeeds(
    tmp_path: Path,
) -> None:
    """A job that exits 0 (leaving a setsid grandchild, which the daemon kills): `elasticd run`
    exits 0 and, the moment it has, no reaper of it is left; the --state-dir stays."""
    drop = tmp_path / "drop"
    drop.mkdir()
    body = '( setsid sleep 600 & echo $! > "$1/grandchild.pid" ); exit 0'
    state_dir = tmp_path / "state"
    log = tmp_path / "run.log"
    args = ["--state-dir", str(state_dir), "--run-id", "clean-exit-run"]
    run = _run([*args, "--", "/bin/sh", "-c", body, "sh", str(drop)], log)
    try:
        rc = await asyncio.to_thread(run.wait, 60)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert rc == 0, log.read_text()
    assert _reapers("clean-exit-run") == []
    subtree = _subtree(state_dir)
    assert _reapers(str(subtree)) == [] if subtree else True
    grandchild = _pid(drop / "grandchild.pid")
    assert grandchild is not None and not pid_alive(grandchild)
    assert state_dir.is_dir()  # given by the caller: kept
    if subtree is not None:
        assert not subtree.exists()


def _spawn(argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    return subprocess.Popen(argv, start_new_session=True, **kwargs)


HELPER = """
import sys, time
from elasticd.supervise.reaper import RunReaper
reaper = RunReaper(cgroup=None, match={"ELASTICD_URL": sys.argv[1], "ELASTICD_JOB_ID": "marked"})
reaper.start()
print(reaper.proc.pid, flush=True)
time.sleep(600)
"""


async def test_without_cgroups_the_reaper_kills_the_runs_processes_by_their_environment(
    tmp_path: Path,
) -> None:
    """The subreaper fallback: after kill -9 of the process that started the reaper, every
    process whose environment names the run (ELASTICD_URL and ELASTICD_JOB_ID) dies, setsid
    or not; a process of another job with the same URL is left alone; the reaper exits."""
    url = f"http://127.0.0.1:1/{os.getpid()}-{time.monotonic_ns()}"
    env = {**os.environ, "ELASTICD_URL": url}
    pids = tmp_path / "pids"
    start = f'setsid sleep 600 & echo $! >> "{pids}"; sleep 600 & echo $! >> "{pids}"; wait'
    marked = _spawn(["/bin/sh", "-c", start], env={**env, "ELASTICD_JOB_ID": "marked"})
    other = _spawn(["sleep", "600"], env={**env, "ELASTICD_JOB_ID": "another"})
    helper = _spawn([sys.executable, "-c", HELPER, url], stdout=subprocess.PIPE)
    try:
        assert helper.stdout is not None
        reaper = int(await asyncio.to_thread(helper.stdout.readline))
        await eventually(
            lambda: pids.exists() and len(pids.read_text().split()) == 2, 10, "the children"
        )
        children = [int(p) for p in pids.read_text().split()]
        helper.send_signal(signal.SIGKILL)
        helper.wait(10)
        await eventually(
            lambda: not any(pid_alive(p) for p in [marked.pid, *children]), 5, "the run to die"
        )
        await eventually(lambda: not pid_alive(reaper), 5, "the reaper to exit")
        assert other.poll() is None  # another job's: untouched
    finally:
        for proc in (marked, other, helper):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        if helper.stdout is not None:
            helper.stdout.close()


LAUNCHED = """
import os, subprocess, sys, time
import elasticd

def train(drop):
    grandchild = subprocess.Popen(["setsid", "sleep", "600"])
    with open(os.path.join(drop, "grandchild.pid"), "w") as f:
        f.write(str(grandchild.pid))
    with open(os.path.join(drop, "worker.pid"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)

if __name__ == "__main__":
    elasticd.launch(train, nproc_per_node=1, max_restarts=0)(sys.argv[1])
"""


async def test_kill_9_of_a_program_inside_elasticd_launch_kills_its_workers_too(
    tmp_path: Path,
) -> None:
    """elasticd.launch() embeds the same daemon in the caller's program: kill -9 of that
    program kills the launched worker and its setsid grandchild too."""
    drop = tmp_path / "drop"
    drop.mkdir()
    program = tmp_path / "launched.py"
    program.write_text(LAUNCHED)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICD_")}
    proc = _spawn([sys.executable, str(program), str(drop)], env=env, cwd=str(tmp_path))
    worker = grandchild = None
    try:
        await eventually(
            lambda: _pid(drop / "grandchild.pid") is not None and _pid(drop / "worker.pid"),
            60,
            "the launched worker and its grandchild",
        )
        worker, grandchild = _pid(drop / "worker.pid"), _pid(drop / "grandchild.pid")
        assert worker and grandchild
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        await eventually(
            lambda: not pid_alive(worker) and not pid_alive(grandchild), 5, "the job to die"
        )
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in (worker, grandchild):
            if pid and pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
