"""Checked-in artefacts stay true: openapi.json matches the app, the systemd unit verifies."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from api.openapi import render
from elasticd.service import render_unit

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
    unit.write_text(render_unit(unit_text, exe))
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


#: The unit's `systemd-analyze security` exposure, as docs/hardening.md gives it (was 9.6).
UNIT_EXPOSURE = 7.5

#: Sandboxing the unit must have: none of them restricts a job.
UNIT_MUST_SET = {
    "ProtectKernelModules": "yes",
    "ProtectKernelLogs": "yes",
    "ProtectKernelTunables": "yes",
    "ProtectHostname": "yes",
    "LockPersonality": "yes",
    "SystemCallArchitectures": "native",
    "UMask": "0077",
    "StateDirectory": "elasticd",
    "LogsDirectory": "elasticd",
    "RuntimeDirectory": "elasticd",
    "Delegate": "yes",
}

#: Options that would restrict jobs (their workers share the unit's cgroup, namespaces and
#: bounding set), or break the daemon's delegated cgroups: never in the unit.
UNIT_MUST_NOT_SET = (
    "ProtectControlGroups",
    "ProtectClock",
    "ProtectSystem",
    "ProtectHome",
    "PrivateTmp",
    "PrivateDevices",
    "PrivateNetwork",
    "PrivateUsers",
    "NoNewPrivileges",
    "MemoryDenyWriteExecute",
    "RestrictAddressFamilies",
    "RestrictNamespaces",
    "DevicePolicy",
    "DeviceAllow",
    "DynamicUser",
    "User",
)


def _unit_settings(text: str) -> dict[str, str]:
    """The unit's ``Key=value`` lines, continuation lines joined (a key set twice: the last)."""
    settings: dict[str, str] = {}
    for line in text.replace("\\\n", " ").splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")) and "=" in line:
            key, value = line.split("=", 1)
            settings[key.strip()] = value.strip()
    return settings


def _security(unit_text: str, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    unit = tmp_path / "elasticd.service"
    unit.write_text(unit_text)
    return subprocess.run(
        ["systemd-analyze", "security", "--offline=true", *extra, str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_unit_sandboxes_what_jobs_never_need_and_nothing_they_do():
    """The unit sets every sandboxing option that spares jobs, and none of those that do not."""
    settings = _unit_settings((ROOT / "systemd" / "elasticd.service").read_text())
    for key, value in UNIT_MUST_SET.items():
        assert settings.get(key) == value, (key, settings.get(key))
    for key in UNIT_MUST_NOT_SET:
        assert key not in settings, f"{key}= restricts jobs or breaks the delegated cgroups"
    assert settings["CapabilityBoundingSet"].startswith("~"), settings["CapabilityBoundingSet"]
    dropped = settings["CapabilityBoundingSet"][1:].split()
    for cap in ("CAP_SYS_MODULE", "CAP_SYS_BOOT", "CAP_SYS_TIME"):
        assert cap in dropped, cap
    # What starting workers as their users, cgroups and job folders need stays.
    for cap in ("CAP_SETUID", "CAP_SETGID", "CAP_KILL", "CAP_CHOWN", "CAP_SYS_ADMIN"):
        assert cap not in dropped, cap
    # The private folders are the ones the daemon is told to use.
    assert "--state-dir /var/lib/elasticd" in settings["ExecStart"]
    assert "--log-dir /var/log/elasticd" in settings["ExecStart"]
    assert "--unix-socket /run/elasticd/" in settings["ExecStart"]


def _has_offline_security() -> bool:
    if shutil.which("systemd-analyze") is None:
        return False
    probe = subprocess.run(
        ["systemd-analyze", "security", "--help"], capture_output=True, text=True, timeout=60
    )
    return "--offline" in probe.stdout


@pytest.mark.skipif(not _has_offline_security(), reason="needs systemd-analyze security --offline")
def test_systemd_analyze_security_scores_the_unit_at_most_as_documented(tmp_path):
    """`systemd-analyze security --offline` rates the unit at most UNIT_EXPOSURE, with the checks."""
    text = (ROOT / "systemd" / "elasticd.service").read_text()
    result = _security(text, tmp_path)
    overall = [line for line in result.stdout.splitlines() if "Overall exposure level" in line]
    assert overall, result.stdout + result.stderr
    score = float(overall[0].split(":")[-1].split()[0])
    assert score <= UNIT_EXPOSURE, overall[0]
    assert f"{UNIT_EXPOSURE}" in (ROOT / "docs" / "hardening.md").read_text()
    checks = {
        c["json_field"]: c["set"]
        for c in json.loads(_security(text, tmp_path, "--json=short").stdout)
    }
    for field in (
        "ProtectKernelModules", "ProtectKernelLogs", "ProtectKernelTunables", "ProtectHostname",
        "LockPersonality", "SystemCallArchitectures", "UMask", "CapabilityBoundingSet_CAP_SYS_MODULE",
        "CapabilityBoundingSet_CAP_SYS_BOOT", "CapabilityBoundingSet_CAP_SYS_TIME",
    ):  # fmt: skip
        assert checks[field] is True, field
    for field in ("ProtectControlGroups", "ProtectClock", "PrivateDevices", "NoNewPrivileges"):
        assert checks[field] is False, field
    # One option less scores worse: the score measures this unit's sandbox.
    bare = "\n".join(
        line for line in text.splitlines() if line.split("=")[0] not in {"ProtectKernelModules"}
    )
    assert score < _score(_security(bare, tmp_path))


def _score(result: subprocess.CompletedProcess[str]) -> float:
    line = next(x for x in result.stdout.splitlines() if "Overall exposure level" in x)
    return float(line.split(":")[-1].split()[0])


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


def _pins(path: Path) -> dict[str, str]:
    """name -> version of a requirements file's ``name==version`` lines."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[name.strip().lower().replace("_", "-")] = version.strip()
    return pins


def test_the_demo_installs_the_runtime_and_torch_not_the_test_toolchain():
    """requirements.txt pins every runtime dependency and torch 2.13.0, and nothing else;
    requirements-dev.txt adds the toolchain on top of it without pinning anything twice."""
    import tomllib

    runtime = _pins(ROOT / "requirements.txt")
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {d.split(">=")[0].split(";")[0].strip().lower().replace("_", "-") for d in declared}
    assert names <= set(runtime), names - set(runtime)
    assert runtime["torch"] == "2.13.0"
    # starlette: fastapi's, pinned with it; numpy: torch's, which warns in every worker
    # without it, and is in the torch extra too.
    assert set(runtime) - names == {"torch", "starlette", "numpy"}
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "numpy" in extra["optional-dependencies"]["torch"]
    dev_text = (ROOT / "requirements-dev.txt").read_text()
    assert "-r requirements.txt" in dev_text.splitlines()
    assert not set(_pins(ROOT / "requirements-dev.txt")) & set(runtime)
    for toolchain in ("pytest", "playwright", "schemathesis", "transformers"):
        assert toolchain not in runtime


@pytest.mark.skipif(shutil.which("make") is None, reason="make missing")
def test_make_demo_installs_requirements_txt_with_progress(tmp_path):
    """`make demo` on a fresh venv installs requirements.txt only, and lets pip show progress."""
    plan = subprocess.run(
        ["make", "-n", "-C", str(ROOT), "demo", f"VENV={tmp_path / 'venv'}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert plan.returncode == 0, plan.stderr
    installs = [line for line in plan.stdout.splitlines() if "pip install" in line]
    assert len(installs) == 2, plan.stdout
    assert "-r requirements.txt" in installs[0] and "--no-deps -e ." in installs[1]
    assert "requirements-dev.txt" not in plan.stdout
    assert all(" -q" not in line for line in installs)


def test_the_demo_prints_the_serve_command_it_runs(monkeypatch, capsys, tmp_path):
    """`make demo` says `== starting: elasticd serve ...`: the very arguments it starts the
    daemon with (as root --allow-root and the node name too), not a shorter line."""
    import importlib.util
    import shlex

    spec = importlib.util.spec_from_file_location("demo", ROOT / "examples" / "demo.py")
    assert spec is not None and spec.loader is not None
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    ran: list[list[str]] = []

    class Started(Exception):
        pass

    def popen(argv, **_kwargs):  # stands for the daemon: records what would run, no more
        ran.append(list(argv))
        raise Started

    monkeypatch.setattr(demo.subprocess, "Popen", popen)
    monkeypatch.setattr(demo.tempfile, "mkdtemp", lambda prefix: str(tmp_path))
    with pytest.raises(Started):
        demo.main()
    printed = next(x for x in capsys.readouterr().out.splitlines() if "== starting:" in x)
    (argv,) = ran
    assert argv[:3] == [sys.executable, "-m", "elasticd"]
    assert shlex.split(printed.split("== starting: ", 1)[1]) == ["elasticd", *argv[3:]]
    assert "--node-name" in argv and ("--allow-root" in argv) == (os.geteuid() == 0)
