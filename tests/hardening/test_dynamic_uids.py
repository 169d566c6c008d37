"""Per-job uids (issue 22, finding 8): with ``run_as = "dynamic"`` one job cannot reach another.

Under one shared ``run_as`` user, job ``thief`` read job ``victim``'s
``/proc/<pid>/environ`` (its API key) and killed its workers. Here a real root
``elasticd serve --run-as dynamic`` runs both; the thief's worker tries both
and the kernel refuses.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
from pathlib import Path

import pytest

from tests.conftest import wait_job
from tests.hardening.support import healthy_pids, pid_alive, proc_uid, script, serve

#: System python: the job's uid (no passwd entry, no groups) may not read the project's venv.
PY3 = "/usr/bin/python3"

AS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")

THIEF = """
import json, os, signal, sys
victim = int(sys.argv[1])
tried = {"uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(),
         "home": os.environ.get("HOME")}
try:
    with open(f"/proc/{victim}/environ", "rb") as f:
        tried["environ"] = f.read().decode(errors="replace")
except OSError as exc:
    tried["environ"] = exc.errno
try:
    os.kill(victim, signal.SIGKILL)
    tried["kill"] = "sent"
except OSError as exc:
    tried["kill"] = exc.errno
print(json.dumps(tried), flush=True)
"""

VICTIM = """
import os, time
print(os.getuid(), flush=True)
time.sleep(600)
"""


@AS_ROOT
@pytest.mark.slow
async def test_a_job_cannot_read_or_kill_another_jobs_workers_under_dynamic_uids(
    open_tmp: Path,
) -> None:
    """Two jobs get different uids of the range; the thief's reads of the victim's environ
    and its SIGKILL are refused (EACCES, EPERM), the victim runs on, each job's logs are its
    uid's."""
    thief_py = script(open_tmp, "thief.py", THIEF)
    victim_py = script(open_tmp, "victim.py", VICTIM)
    key = secrets.token_hex(16)
    daemon = serve(
        open_tmp, "--run-as", "dynamic", env={"ELASTICD_ALLOW_ROOT": "false"}, node_name="dyn"
    )
    logs = open_tmp / "state" / "logs"
    try:
        async with asyncio.timeout(90), daemon.client() as c:
            await daemon.wait_ready()
            r = await c.post(
                "/jobs",
                json={
                    "id": "victim",
                    "entrypoint": PY3,
                    "args": [victim_py],
                    "env": {"API_KEY": key},
                },
            )
            assert r.status_code == 201, r.text
            (victim,) = await healthy_pids(c, "victim", 1)
            victim_uid = proc_uid(victim)
            r = await c.post(
                "/jobs", json={"id": "thief", "entrypoint": PY3, "args": [thief_py, str(victim)]}
            )
            assert r.status_code == 201, r.text
            job = await wait_job(c, "thief")
            assert job["state"] == "SUCCEEDED", job
            tried = json.loads((await c.get("/jobs/thief/logs")).text)
            assert pid_alive(victim), "the thief killed the victim"
            assert proc_uid(victim) == victim_uid
            await c.post("/jobs/victim/cancel", json={})
            await wait_job(c, "victim")
    finally:
        daemon.stop()
    thief_uid = tried["uid"]
    assert 61184 <= victim_uid <= 65519
    assert 61184 <= thief_uid <= 65519
    assert thief_uid != victim_uid
    assert (tried["gid"], tried["groups"], tried["home"]) == (thief_uid, [], "/nonexistent")
    assert tried["environ"] == 13, "the thief read the victim's environment"  # EACCES
    assert tried["kill"] == 1  # EPERM
    for job_id, uid in (("victim", victim_uid), ("thief", thief_uid)):
        worker = logs / job_id / "attempt_0" / "0"
        assert worker.stat().st_uid == uid, job_id
        assert (worker / "stdout.log").stat().st_uid == uid, job_id
        assert (worker / "stdout.log").stat().st_mode & 0o007 == 0, job_id
    assert key not in daemon.output()
