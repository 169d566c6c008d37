"""Attacks found by the review of the issue-11 fixes, each closed at its cause."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from elasticd.errors import RendezvousError
from elasticd.rendezvous.protocol import MAX_LOCAL_WORLD_SIZE, State
from tests.hardening.support import serve

pytestmark = pytest.mark.timeout(60)


@pytest.mark.skipif(os.geteuid() != 0, reason="running jobs as another user needs root")
async def test_a_daemon_that_runs_jobs_as_other_users_is_never_tokenless(tmp_path: Path) -> None:
    """Loopback is no boundary between the operator and the jobs: a job's processes could
    use a tokenless API as the daemon's client. A daemon given no token makes its own
    (<state_dir>/token, 0600) and answers 401 to a client without it."""
    daemon = serve(tmp_path, "--run-as", "nobody", token_file=False)
    try:
        token_file = daemon.state_dir / "token"
        deadline = time.monotonic() + 30
        while not token_file.exists():
            assert daemon.proc.poll() is None, daemon.output()
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        assert token_file.stat().st_mode & 0o777 == 0o600
        daemon.token = token_file.read_text().strip()
        await daemon.wait_ready()
        async with httpx.AsyncClient(base_url=daemon.url, timeout=30) as anonymous:
            assert (await anonymous.get("/jobs")).status_code == 401
            r = await anonymous.post("/jobs", json={"entrypoint": "/bin/true"})
            assert r.status_code == 401
    finally:
        daemon.stop()


@pytest.mark.parametrize(
    "node",
    [
        {"addr": "h", "role": "default", "lws": MAX_LOCAL_WORLD_SIZE + 1, "port": 1},
        {"addr": "h", "role": "default", "lws": 0, "port": 1},
        {"addr": "h", "role": "default", "lws": 1, "port": 70000},
        {"addr": "h" * 300, "role": "default", "lws": 1, "port": 1},
    ],
)
def test_a_rendezvous_document_cannot_ask_for_unbounded_workers(node: dict[str, object]) -> None:
    """The round document is store data anyone with store access can write: its join infos
    are bounded before anything is started from them (the agent also refuses a round that
    gives this node another number of workers than the job's nproc_per_node)."""
    doc = (
        b'{"round": 0, "complete": true, "closed": false, "deadline": null,'
        b' "participants": {"a": 0}, "wait_list": [], "redundancy_list": [], "nodes": {"a": '
        + __import__("json").dumps(node).encode()
        + b"}}"
    )
    with pytest.raises(RendezvousError, match="malformed"):
        State.decode(doc)


@pytest.mark.skipif(os.geteuid() != 0, reason="running jobs as another user needs root")
def test_a_log_root_a_job_user_could_write_is_refused(tmp_path: Path) -> None:
    """A log_dir owned by the job user would let a job plant `<log_dir>/<job id>` as a link
    and make root create folders wherever it points: such a daemon refuses to start."""
    logs = tmp_path / "logs"
    logs.mkdir()
    os.chown(logs, 65534, 65534)  # nobody's
    token = tmp_path / "token"
    token.write_text("t" * 32)
    token.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICD_")}
    proc = subprocess.run(
        [sys.executable, "-m", "elasticd", "serve", "--port", "0", "--state-dir",
         str(tmp_path / "state"), "--log-dir", str(logs), "--run-as", "nobody",
         "--token-file", str(token)],
        env=env, capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert f"log_dir {logs} must be a folder of the daemon's own user" in proc.stderr
    assert not any(logs.iterdir())
