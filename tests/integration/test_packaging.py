"""Checked-in artefacts stay true: openapi.json matches the app, the systemd unit verifies."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from api.openapi import render

ROOT = Path(__file__).resolve().parents[2]


def test_openapi_json_matches_the_app():
    """openapi.json is exactly what the app generates (run `make openapi` after an API change)."""
    checked_in = (ROOT / "openapi.json").read_text()
    assert checked_in == render(), "openapi.json drifted from the app: run `make openapi`"
    doc = json.loads(checked_in)
    for path in (
        "/jobs",
        "/jobs/{job_id}",
        "/jobs/{job_id}/workers",
        "/jobs/{job_id}/events",
        "/jobs/{job_id}/logs",
        "/jobs/{job_id}/cancel",
        "/healthz",
        "/readyz",
    ):
        assert path in doc["paths"], path


def _verify(unit_text: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("elasticd") or str(Path(sys.executable).parent / "elasticd")
    unit = tmp_path / "elasticd.service"
    unit.write_text(unit_text.replace("/usr/local/bin/elasticd", exe))
    return subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60
    )


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze missing")
def test_systemd_unit_verifies_without_warnings(tmp_path):
    """`systemd-analyze verify` accepts the unit with no output at all."""
    text = (ROOT / "systemd" / "elasticd.service").read_text()
    for needle in ("Type=notify", "KillMode=mixed", "Restart=on-failure", "TimeoutStopSec=90"):
        assert needle in text
    result = _verify(text, tmp_path)
    assert result.returncode == 0 and result.stdout + result.stderr == ""


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze missing")
def test_systemd_verify_would_catch_a_bad_unit(tmp_path):
    """The check above can fail: an unknown key makes verify complain."""
    text = (ROOT / "systemd" / "elasticd.service").read_text()
    result = _verify(text.replace("[Service]", "[Service]\nBogusKey=1"), tmp_path)
    assert "BogusKey" in result.stdout + result.stderr


def test_termination_grace_fits_in_timeout_stop_sec():
    """The unit's TimeoutStopSec exceeds the default worker grace."""
    from elasticd.models import JobSpec

    text = (ROOT / "systemd" / "elasticd.service").read_text()
    stop = int(text.split("TimeoutStopSec=")[1].split()[0])
    assert stop > JobSpec(entrypoint="x").termination_grace + 10


def test_daemon_side_never_imports_torch():
    """Importing the daemon, the API and the CLI pulls in no torch (start-up time, memory)."""
    code = (
        "import sys, elasticd.node.daemon, elasticd.cli, elasticd.node.jobs, api.app, api.openapi\n"
        "import elasticd.inprocess.keys, elasticd.agent.progress, elasticd.node.health\n"
        "api.app.create_app(None)\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
