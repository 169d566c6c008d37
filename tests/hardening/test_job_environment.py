"""A served daemon's environment is the operator's, not its jobs': the attack of issue 22's design
gap (a secret in the daemon's environment read by any user's worker) performed against a real
root `elasticd serve`, and the embedded daemon of `elasticd run` checked to still pass its
caller's environment on, as torchrun does."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import wait_job
from tests.hardening.support import serve

AS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="a root daemon, as deployed")

#: What the daemon's operator has in its environment and no job may see.
SECRET = {"AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI-daemon-only", "LD_PRELOAD": ""}


def _environ(text: str) -> dict[str, str]:
    """``env -0`` output as a dict (values may hold newlines)."""
    return dict(item.split("=", 1) for item in text.split("\0") if "=" in item)


@AS_ROOT
@pytest.mark.slow
async def test_a_served_daemons_secret_environment_never_reaches_a_job(open_tmp: Path) -> None:
    """The daemon runs with AWS_SECRET_ACCESS_KEY (and a locale and time zone) in its
    environment: a job's worker and its health check see PATH, the locale, TZ, the job's own
    env and the torchrun contract, and not the secret."""
    drop = open_tmp / "drop"
    drop.mkdir()
    daemon = serve(open_tmp, env={**SECRET, "TZ": "Europe/Paris", "LC_ALL": "C.UTF-8"})
    try:
        async with asyncio.timeout(90), daemon.client() as c:
            await daemon.wait_ready()
            r = await c.post(
                "/jobs",
                json={
                    "id": "env",
                    "entrypoint": "/usr/bin/env",
                    "args": ["-0"],
                    "env": {"MINE": "from-the-job"},
                    "health_check": ["/bin/sh", "-c", f"env -0 > {drop}/check"],
                    "gpu_health_check": False,
                    "max_restarts": 0,
                },
            )
            assert r.status_code == 201, r.text
            job = await wait_job(c, "env")
            assert job["state"] == "SUCCEEDED", job
            worker = _environ((await c.get("/jobs/env/logs")).text)
    finally:
        daemon.stop()
    check = _environ((drop / "check").read_text())
    for seen in (worker, check):
        assert not set(SECRET) & set(seen), sorted(seen)
        assert seen["MINE"] == "from-the-job" and seen["TZ"] == "Europe/Paris"
        assert seen["LC_ALL"] == "C.UTF-8" and seen["PATH"]
        assert seen["ELASTICD_JOB_ID"] == "env"
    assert worker["RANK"] == "0" and worker["TORCHELASTIC_RUN_ID"]


@AS_ROOT
@pytest.mark.slow
def test_elasticd_run_passes_its_callers_environment_on(tmp_path: Path) -> None:
    """`elasticd run` is the caller's own job: a variable of the caller's environment (here the
    same secret name) reaches the worker, as it would under torchrun."""
    out = tmp_path / "env"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICD_")}
    env.update({"ELASTICD_ALLOW_ROOT": "true", "AWS_SECRET_ACCESS_KEY": "the-callers-own"})
    done = subprocess.run(
        [sys.executable, "-m", "elasticd", "run", "--no-python", "--"]
        + ["/bin/sh", "-c", f"env -0 > {out}"],
        capture_output=True,
        text=True,
        timeout=90,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert _environ(out.read_text())["AWS_SECRET_ACCESS_KEY"] == "the-callers-own"
