"""A job's own health check is contained (issue 22, finding 11): nothing it starts outlives it.

The check ran outside the attempt's cgroup, so a ``setsid`` child of it
survived the check, the job and the daemon's stop. Here a real root daemon
runs a job whose check starts a sleeper in a new session and exits 0; the
sleeper must be dead once the check is over, while the job's workers run,
with cgroups and in subreaper mode.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from elasticd.supervise.cgroup import Containment
from tests.conftest import events_of, wait_job
from tests.hardening.support import SLEEPER, eventually, healthy_pids, pid_alive, script, serve

PY3 = "/usr/bin/python3"


def cgroups_here(tmp: Path) -> bool:
    try:
        Containment.setup("cgroup", node="probe", state_dir=tmp).close()
    except OSError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.parametrize("containment", ["cgroup", "subreaper"])
async def test_a_setsid_child_of_a_jobs_health_check_dies_with_the_check(
    open_tmp: Path, containment: str
) -> None:
    """The check (as nobody) leaves ``setsid sleep 600`` and passes: the sleeper is killed when
    the check ends, before the job ends, and the check's event says one process was killed."""
    if containment == "cgroup" and not cgroups_here(open_tmp / "probe"):
        pytest.skip("no cgroup v2 can be made here")
    drop = open_tmp / "drop"
    drop.mkdir()
    drop.chmod(0o777)
    pid_file = drop / "sleeper.pid"
    check = (
        f"setsid /bin/sh -c 'echo $$ > {pid_file}; exec sleep 600' "
        "</dev/null >/dev/null 2>&1 & "
        f"while [ ! -s {pid_file} ]; do sleep 0.01; done; exit 0"
    )
    worker = script(open_tmp, "worker.py", SLEEPER)
    daemon = serve(
        open_tmp,
        "--run-as",
        "nobody",
        env={"ELASTICD_ALLOW_ROOT": "false", "ELASTICD_CONTAINMENT": containment},
    )
    try:
        async with asyncio.timeout(90), daemon.client() as c:
            await daemon.wait_ready()
            r = await c.post(
                "/jobs",
                json={
                    "id": "checked",
                    "entrypoint": PY3,
                    "args": [worker],
                    "health_check": ["/bin/sh", "-c", check],
                    "gpu_health_check": False,
                },
            )
            assert r.status_code == 201, r.text
            (worker_pid,) = await healthy_pids(c, "checked", 1)
            await eventually(pid_file.exists, 10, "the sleeper's pid")
            await eventually(lambda: pid_file.read_text().strip().isdigit(), 10, "its pid")
            sleeper = int(pid_file.read_text())
            await eventually(lambda: not pid_alive(sleeper), 10, "the check's sleeper to die")
            assert pid_alive(worker_pid), "the job's own worker must run on"
            passed = [e for e in await events_of(c, "checked") if e["kind"] == "health.passed"]
            assert any("killed 1 process(es)" in e["message"] for e in passed), passed
            await c.post("/jobs/checked/cancel", json={})
            await wait_job(c, "checked")
    finally:
        daemon.stop()
