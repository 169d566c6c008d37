"""Zombies in subreaper mode (issue 22, finding 9): the daemon reaps the orphans it adopts.

With ``containment = "subreaper"`` (and ``auto`` where no cgroup can be made)
the daemon is a child subreaper: a job's orphans are re-parented to it. One
that exits on its own stayed a zombie child of the root daemon forever (200
of them after a job that double-forked 200 times). A real daemon runs such
a job here; its zombies must go, and the worker's own exit status must
still reach the job (a blanket ``waitpid(-1)`` would steal it from asyncio).
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest

from tests.conftest import wait_job
from tests.hardening.support import PY, eventually, proc_state, script, serve

ORPHANS = 200

#: Forks ORPHANS children that each fork a grandchild and exit at once: every grandchild
#: is orphaned (re-parented to the daemon, the subreaper) and exits shortly after. Then
#: the worker waits until they are gone and exits 7.
WORKER = f"""
import os, sys, time
r, w = os.pipe()
for _ in range({ORPHANS}):
    pid = os.fork()
    if pid == 0:
        if os.fork() == 0:
            os.close(r)
            time.sleep(0.2)  # an orphan by now
            os._exit(0)  # and a zombie of the daemon's
        os._exit(0)
    os.waitpid(pid, 0)
os.close(w)
os.read(r, 1)  # EOF once every grandchild has exited
print("orphans gone", flush=True)
sys.exit(7)
"""


def zombie_children(parent: int) -> list[int]:
    """The zombies whose parent is ``parent``, read from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
            if fields[0] == "Z" and fields[1] == str(parent):
                found.append(int(entry.name))
    return found


@pytest.mark.slow
async def test_orphans_of_a_job_in_subreaper_mode_are_reaped(tmp_path: Path) -> None:
    """200 orphans exit under a subreaper daemon: none stays its zombie, and the worker's own
    exit code (7) is still the one the job reports."""
    worker = script(tmp_path, "orphans.py", WORKER)
    daemon = serve(tmp_path, env={"ELASTICD_CONTAINMENT": "subreaper"})
    try:
        async with asyncio.timeout(90), daemon.client() as c:
            await daemon.wait_ready()
            r = await c.post(
                "/jobs",
                json={"id": "orphans", "entrypoint": PY, "args": [worker], "max_restarts": 0},
            )
            assert r.status_code == 201, r.text
            job = await wait_job(c, "orphans")
            assert "orphans gone" in (await c.get("/jobs/orphans/logs")).text
            assert job["state"] == "FAILED", job
            assert job["error"]["exit_code"] == 7, job["error"]
            pid = daemon.proc.pid
            await eventually(
                lambda: not zombie_children(pid), 10, "the daemon to reap its adopted zombies"
            )
            assert proc_state(pid) not in (None, "Z")
    finally:
        daemon.stop()
