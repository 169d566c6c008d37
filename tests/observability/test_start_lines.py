"""What `elasticd serve` and `elasticd run` tell the user at start and at the end: the
dashboard's URL once, `/readyz`'s pid, and where a run's logs are (or that they are gone).

Real `elasticd serve` and `elasticd run` processes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hardening.support import serve

pytestmark = pytest.mark.timeout(120)


async def test_serve_prints_the_dashboard_url_once_and_readyz_reports_its_pid(tmp_path):
    """`elasticd serve` prints where its dashboard is, once; `/readyz` names the daemon's
    pid, as `/healthz` does."""
    served = serve(tmp_path)
    try:
        await served.wait_ready()
        async with served.client() as c:
            ready = (await c.get("/readyz")).json()
            assert ready["pid"] == served.proc.pid == (await c.get("/healthz")).json()["pid"]
            assert (await c.get("/ui")).status_code == 200
        line = f"elasticd dashboard at http://127.0.0.1:{served.port}/ui\n"
        assert served.output().count(line) == 1
    finally:
        served.stop()


def _run(tmp_path: Path, *flags: str, code: str) -> subprocess.CompletedProcess[str]:
    """`elasticd run` with its temporary folders under ``tmp_path`` (TMPDIR)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICD_")}
    env.update(ELASTICD_ALLOW_ROOT="true", TMPDIR=str(tmp_path))
    return subprocess.run(
        [sys.executable, "-m", "elasticd", "run", *flags, "--", "python3", "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
    )


def _log_folders(tmp_path: Path) -> list[Path]:
    return sorted(tmp_path.glob("elasticd-logs-*"))


def test_a_run_that_succeeds_removes_its_log_folder_and_names_the_dashboard(tmp_path):
    """A successful run leaves no /tmp/elasticd-logs-* folder; its first line names the
    dashboard's URL; --keep-logs keeps the folder and says where."""
    done = _run(tmp_path, code="print('hi')")
    assert done.returncode == 0, done.stderr
    assert "dashboard at http://127.0.0.1:" in done.stderr.splitlines()[0]
    assert done.stderr.count("/ui") == 1
    assert _log_folders(tmp_path) == []

    done = _run(tmp_path, "--keep-logs", code="print('hi')")
    assert done.returncode == 0, done.stderr
    (kept,) = _log_folders(tmp_path)
    assert f"the workers' logs are kept in {kept}/" in done.stderr
    assert list(kept.rglob("stdout.log"))


def test_a_run_that_fails_keeps_its_logs_and_says_where(tmp_path):
    """A failed run keeps its logs (the failed rank's stderr.log is the evidence) and its
    last lines say where they are, also with --quiet."""
    done = _run(tmp_path, "--quiet", code="import sys; sys.exit('boom')")
    assert done.returncode == 1, done.stderr
    (kept,) = _log_folders(tmp_path)
    assert f"the workers' logs are kept in {kept}/" in done.stderr.splitlines()[-1]
    assert any("boom" in p.read_text() for p in kept.rglob("stderr.log"))
