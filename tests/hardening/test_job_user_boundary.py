"""Everything the daemon starts for a job runs as the job's user, and nothing of the job's
reaches a process with more privilege: each attack is performed against a real root
`elasticd serve` that runs jobs as `nobody`, and the safe outcome asserted."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import pwd
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from elasticd.errors import WorkerSpawnError
from elasticd.models import Job, JobSpec
from elasticd.security import lookup_user
from elasticd.states import JobState
from elasticd.supervise.spawn import start_process
from tests.conftest import events_of, wait_job
from tests.hardening.support import Served, make_token_file, serve

AS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")

#: Jobs run as nobody: the daemon refuses root jobs as a production daemon does.
AS_NOBODY = {"ELASTICD_ALLOW_ROOT": "false"}


def _nobody() -> pwd.struct_passwd:
    return pwd.getpwnam("nobody")


def _drop(root: Path) -> Path:
    """A folder anyone may write to: where the job's (and the attacker's) programs report."""
    drop = root / "drop"
    drop.mkdir()
    drop.chmod(0o777)
    return drop


def _secret(root: Path) -> Path:
    """A folder only root may enter (0700), holding an executable and a sub-folder."""
    secret = root / "secret"
    secret.mkdir(mode=0o700)
    secret.chmod(0o700)
    (secret / "inside").mkdir()
    prog = secret / "prog"
    prog.write_text("#!/bin/sh\nexit 0\n")
    prog.chmod(0o755)
    return secret


def _executable(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body)
    path.chmod(0o755)
    return path


def _config(root: Path, **settings: Any) -> Path:
    path = root / "elasticd.toml"
    path.write_text("".join(f"{key} = {json.dumps(value)}\n" for key, value in settings.items()))
    return path


def _uid_lines(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


async def _submit(c: httpx.AsyncClient, spec: dict[str, Any]) -> dict[str, Any]:
    r = await c.post("/jobs", json=spec)
    assert r.status_code == 201, r.text
    return await wait_job(c, spec["id"])


def _kinds(events: list[dict[str, Any]]) -> list[str]:
    return [e["kind"] for e in events]


async def _run(daemon: Served, *specs: dict[str, Any]) -> list[tuple[dict[str, Any], list[Any]]]:
    """Submit each job, wait for its end; (job, events) for each. Stops the daemon."""
    out = []
    try:
        async with asyncio.timeout(90), daemon.client() as c:
            await daemon.wait_ready()
            for spec in specs:
                job = await _submit(c, spec)
                out.append((job, await events_of(c, spec["id"])))
    finally:
        daemon.stop()
    return out


# -- finding 1: a job's health check runs as the job ----------------------------------


@AS_ROOT
@pytest.mark.slow
async def test_a_jobs_health_check_runs_as_the_job_user_and_cannot_write_as_root(
    open_tmp: Path,
) -> None:
    """`health_check: sh -c 'id -u > drop; id -u > /root-only/x'` with run_as nobody: the
    check runs as nobody, with the job's env and HOME, in the job's cwd; the root-only write
    fails, so the check fails and the job with it; nothing lands in the root-only folder."""
    nobody = _nobody()
    drop, secret = _drop(open_tmp), _secret(open_tmp)
    check = (
        f'id -u > {drop}/check-uid; echo "$HOME $JOB_MARK $(pwd)" > {drop}/check-env; '
        f"id -u > {secret}/pwned"
    )
    daemon = serve(open_tmp, "--run-as", "nobody", env=AS_NOBODY)
    [(job, events)] = await _run(
        daemon,
        {
            "id": "hc",
            "entrypoint": "/bin/true",
            "cwd": str(drop),
            "env": {"JOB_MARK": "from-the-job"},
            "health_check": ["/bin/sh", "-c", check],
            "gpu_health_check": False,
            "max_restarts": 0,
        },
    )
    assert not (secret / "pwned").exists()
    assert _uid_lines(drop / "check-uid") == [str(nobody.pw_uid)]
    assert (drop / "check-env").read_text().split() == [nobody.pw_dir, "from-the-job", str(drop)]
    assert job["state"] == "FAILED"
    assert "health_check" in job["reason"] and "Permission denied" in job["reason"]
    assert "workers.started" not in _kinds(events)


@AS_ROOT
@pytest.mark.slow
async def test_a_refused_user_fails_the_job_before_its_health_check_runs(
    open_tmp: Path,
) -> None:
    """A root daemon with no run_as, no service user and no allow_root refuses root jobs:
    submitted to it, one is refused at once (403, nothing runs); written into the store by
    another node (or a store writer) it reaches the agent, which fails it with the reason and
    the fix before its health check runs (as root)."""
    try:
        pwd.getpwnam("elasticd")
        pytest.skip("an 'elasticd' user exists here: jobs would run as it")
    except KeyError:
        pass
    drop = _drop(open_tmp)
    daemon = serve(open_tmp, env=AS_NOBODY)
    spec = JobSpec(
        id="refused",
        entrypoint="/bin/true",
        health_check=["/bin/sh", "-c", f"id -u > {drop}/ran"],
        max_restarts=3,
    )
    try:
        async with asyncio.timeout(90), daemon.client() as c:
            await daemon.wait_ready()
            r = await c.post("/jobs", json=spec.model_dump(exclude_none=True))
            assert r.status_code == 403 and "allow_root = true" in r.json()["detail"]
            doc = Job(
                id="refused",
                spec=spec,
                state=JobState.PENDING,
                max_restarts=3,
                created_at=time.time(),
            )
            value = base64.b64encode(doc.model_dump_json().encode()).decode()
            r = await c.put("/store/kv", json={"key": "job/refused", "value": value})
            assert r.status_code == 200
            job = await wait_job(c, "refused")
            events = await events_of(c, "refused")
    finally:
        daemon.stop()
    assert not (drop / "ran").exists()
    assert job["state"] == "FAILED"
    assert "refusing to run the job as root" in job["reason"]
    assert "allow_root = true" in job["reason"]
    assert not {"health.passed", "health.failed", "health.skipped"} & set(_kinds(events))


# -- finding 1: the operator's checks never see the job's PATH or LD_PRELOAD ----------


def _preload_library(folder: Path, marker: Path) -> Path:
    """A shared library whose constructor appends its process's uid to ``marker``."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the LD_PRELOAD library")
    source = folder / "evil.c"
    source.write_text(
        "#include <fcntl.h>\n#include <stdio.h>\n#include <string.h>\n#include <unistd.h>\n"
        "__attribute__((constructor)) static void evil(void) {\n"
        f'  int fd = open("{marker}", O_WRONLY | O_APPEND | O_CREAT, 0666);\n'
        "  if (fd < 0) return;\n"
        '  char line[32]; snprintf(line, sizeof line, "%u\\n", (unsigned)getuid());\n'
        "  write(fd, line, strlen(line)); close(fd);\n}\n"
    )
    library = folder / "evil.so"
    subprocess.run(
        [cc, "-shared", "-fPIC", "-o", str(library), str(source)], check=True, timeout=60
    )
    library.chmod(0o755)
    return library


@AS_ROOT
@pytest.mark.slow
async def test_a_planted_nvidia_smi_and_ld_preload_never_run_as_root(open_tmp: Path) -> None:
    """The job puts a fake `nvidia-smi` first on its PATH and an LD_PRELOAD library in its
    env; the built-in GPU check resolves nvidia-smi from the daemon's PATH only, so the
    fake never runs, and the library is loaded only into the job's own (nobody) processes."""
    nobody = _nobody()
    drop = _drop(open_tmp)
    marker = drop / "preloaded"
    marker.touch()
    marker.chmod(0o666)
    library = _preload_library(drop, marker)
    planted = drop / "bin"
    _executable(
        planted / "nvidia-smi",
        f'#!/bin/sh\nid -u >> {drop}/planted-ran\necho "0, 00000000:18:00.0, Fake GPU, 0, No"\n',
    )
    daemon = serve(open_tmp, "--run-as", "nobody", env=AS_NOBODY)
    [(job, events)] = await _run(
        daemon,
        {
            "id": "gpu",
            "entrypoint": "/bin/true",
            "env": {
                "PATH": f"{planted}:/usr/bin:/bin",
                "LD_PRELOAD": str(library),
            },
            "health_check": ["/bin/true"],
            "gpu_health_check": True,
        },
    )
    assert not (drop / "planted-ran").exists()
    loaded = set(_uid_lines(marker))
    assert "0" not in loaded
    assert loaded == {str(nobody.pw_uid)}  # the attack was live: the job's own processes
    assert job["state"] == "SUCCEEDED", job
    gpu = [e for e in events if e["message"].startswith("gpu on ")]
    assert gpu and "Fake GPU" not in gpu[0]["message"]


@AS_ROOT
@pytest.mark.slow
async def test_the_operators_node_check_gets_the_daemons_env_not_the_jobs(open_tmp: Path) -> None:
    """The node `health_check` (a name, looked up on PATH) runs with the daemon's own
    environment: the job's PATH (with a planted program of the same name), LD_PRELOAD and
    other variables never reach it, and the real check runs."""
    drop = _drop(open_tmp)
    marker = drop / "preloaded"
    marker.touch()
    marker.chmod(0o666)
    library = _preload_library(drop, marker)
    operator_bin = open_tmp / "operator-bin"
    _executable(
        operator_bin / "elasticd-node-check",
        f"#!/bin/sh\nid -u > {drop}/operator-ran\nenv > {drop}/operator-env\n",
    )
    _executable(drop / "bin" / "elasticd-node-check", f"#!/bin/sh\nid -u >> {drop}/planted-ran\n")
    daemon_path = f"{operator_bin}:{os.environ.get('PATH', '/usr/bin:/bin')}"
    config = _config(open_tmp, health_check=["elasticd-node-check"])
    daemon = serve(
        open_tmp,
        "--run-as",
        "nobody",
        "--config",
        str(config),
        env={**AS_NOBODY, "PATH": daemon_path},
    )
    [(job, _)] = await _run(
        daemon,
        {
            "id": "node",
            "entrypoint": "/bin/true",
            "env": {
                "PATH": f"{drop / 'bin'}:/usr/bin:/bin",
                "LD_PRELOAD": str(library),
                "JOB_MARK": "from-the-job",
            },
            "gpu_health_check": False,
        },
    )
    assert job["state"] == "SUCCEEDED", job
    assert not (drop / "planted-ran").exists()
    assert _uid_lines(drop / "operator-ran") == ["0"]
    env = dict(
        line.split("=", 1)
        for line in (drop / "operator-env").read_text().splitlines()
        if "=" in line
    )
    assert env["PATH"] == daemon_path
    assert "LD_PRELOAD" not in env and "JOB_MARK" not in env
    assert env["ELASTICD_JOB_ID"] == "node"
    assert "0" not in _uid_lines(marker)


# -- finding 7: no child sees the token or systemd's socket ---------------------------

DUMP_ENV = 'env > "{drop}/{name}-env"'


@AS_ROOT
@pytest.mark.slow
async def test_no_child_of_the_daemon_sees_the_token_or_notify_socket(open_tmp: Path) -> None:
    """The daemon runs with ELASTICD_TOKEN and NOTIFY_SOCKET; the worker, the job's health
    check, the node's health check, GPU discovery and the GPU check each dump their
    environment: neither variable is in any of them."""
    drop = _drop(open_tmp)
    token = "tok-" + os.urandom(16).hex()
    fake_smi = _executable(
        open_tmp / "operator-bin" / "nvidia-smi",
        f'#!/bin/sh\nenv > "{drop}/nvidia-smi$1-env"\n'
        'case "$1" in --query-gpu=*) echo "0, 00000000:18:00.0, Fake GPU, 0, No" ;; esac\n',
    )
    config = _config(
        open_tmp, health_check=["/bin/sh", "-c", DUMP_ENV.format(drop=drop, name="node-check")]
    )
    daemon = serve(
        open_tmp,
        "--run-as",
        "nobody",
        "--config",
        str(config),
        env={
            **AS_NOBODY,
            "PATH": f"{fake_smi.parent}:{os.environ.get('PATH', '/usr/bin:/bin')}",
            "ELASTICD_TOKEN": token,
            "NOTIFY_SOCKET": str(open_tmp / "notify"),
        },
    )
    daemon.token = token
    [(job, events)] = await _run(
        daemon,
        {
            "id": "secrets",
            "entrypoint": "/bin/sh",
            "args": ["-c", DUMP_ENV.format(drop=drop, name="worker")],
            "health_check": ["/bin/sh", "-c", DUMP_ENV.format(drop=drop, name="job-check")],
            "gpu_health_check": True,
        },
    )
    assert job["state"] == "SUCCEEDED", job
    dumps = {p.name: p.read_text() for p in drop.glob("*-env")}
    assert {"worker-env", "job-check-env", "node-check-env", "nvidia-smi-L-env"} <= set(dumps)
    assert any(name.startswith("nvidia-smi--query-gpu") for name in dumps), sorted(dumps)
    for name, text in dumps.items():
        names = {line.split("=", 1)[0] for line in text.splitlines()}
        assert not {"ELASTICD_TOKEN", "NOTIFY_SOCKET"} & names, name
        assert token not in text, name
    assert token not in json.dumps(events) and token not in daemon.output()


# -- finding 13: the token file's owner ----------------------------------------------


@AS_ROOT
@pytest.mark.slow
def test_serve_refuses_a_token_file_owned_by_another_user(open_tmp: Path) -> None:
    """A 0600 token file owned by nobody (a job user could read or replace it): exit 2,
    naming the file and the chown to run; the token is not printed."""
    token_file, token = make_token_file(open_tmp)
    os.chown(token_file, _nobody().pw_uid, -1)
    daemon = serve(open_tmp, "--run-as", "nobody", token_file=token_file, env=AS_NOBODY)
    assert daemon.proc.wait(30) == 2
    out = daemon.output()
    assert f"chown root {token_file}" in out and "belongs to nobody" in out
    assert token not in out


# -- finding 14: entrypoint and cwd are resolved as the job's user ---------------------


@AS_ROOT
@pytest.mark.slow
async def test_entrypoint_and_cwd_are_resolved_as_the_job_user(open_tmp: Path) -> None:
    """Under a root-only (0700) folder, an existing and a missing entrypoint, an existing
    and a missing cwd, and a program found only on a PATH entry inside it all fail the same
    way, as nobody sees them (no EACCES-vs-ENOENT to learn from), as a clear spawn failure,
    and nothing of the job runs with root's view of them."""
    secret = _secret(open_tmp)
    base = {"max_restarts": 0, "gpu_health_check": False}
    specs = [
        {"id": "prog-there", "entrypoint": f"{secret}/prog", **base},
        {"id": "prog-missing", "entrypoint": f"{secret}/none", **base},
        {"id": "cwd-there", "entrypoint": "/bin/true", "cwd": f"{secret}/inside", **base},
        {"id": "cwd-missing", "entrypoint": "/bin/true", "cwd": f"{secret}/nowhere", **base},
        {"id": "path-there", "entrypoint": "prog", "env": {"PATH": str(secret)}, **base},
        {"id": "path-missing", "entrypoint": "none", "env": {"PATH": str(secret)}, **base},
    ]
    daemon = serve(open_tmp, "--run-as", "nobody", env=AS_NOBODY)
    results = {job["id"]: (job, events) for job, events in await _run(daemon, *specs)}
    reasons = {}
    for job_id, (job, events) in results.items():
        assert job["state"] == "FAILED", (job_id, job)
        assert "workers.spawn_failed" in _kinds(events), (job_id, _kinds(events))
        assert "workers.started" not in _kinds(events), job_id
        reasons[job_id] = job["reason"]
    for there, missing, there_path, missing_path in [
        ("prog-there", "prog-missing", f"{secret}/prog", f"{secret}/none"),
        ("cwd-there", "cwd-missing", f"{secret}/inside", f"{secret}/nowhere"),
        ("path-there", "path-missing", "'prog'", "'none'"),
    ]:
        assert there_path in reasons[there] and missing_path in reasons[missing]
        # A name looked up on PATH is also named where nobody could not look for it.
        there_at, missing_at = (f"{secret}/{p.strip(chr(39))}" for p in (there_path, missing_path))
        assert reasons[there].replace(there_path, "X").replace(there_at, "X") == reasons[
            missing
        ].replace(missing_path, "X").replace(missing_at, "X"), (reasons[there], reasons[missing])
    assert f"nobody may not enter {secret};" in reasons["prog-there"]
    assert "working folder" in reasons["cwd-there"]
    assert "no executable of that name" in reasons["path-there"]


# -- the one start path, directly ------------------------------------------------------


@AS_ROOT
@pytest.mark.parametrize("how", ["path", "program"])
async def test_a_program_the_job_user_cannot_reach_is_named_with_the_user(
    open_tmp: Path, how: str
) -> None:
    """A venv whose python links into a folder closed to the job's user (root's 0700 home):
    found on PATH or given by path, the start fails naming the user, the link, where it
    leads and the folder the user may not enter, not "no such program"."""
    secret = _secret(open_tmp)
    venv = open_tmp / "venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python3").symlink_to(secret / "prog")
    (venv / "python").symlink_to("python3")  # relative, as venv makes it
    nobody = lookup_user("nobody")
    argv = ["python"] if how == "path" else [str(venv / "python")]
    env = {"PATH": f"/nonexistent:{venv}:/usr/bin:/bin"}
    with pytest.raises(WorkerSpawnError) as caught:
        async with asyncio.timeout(30):
            await start_process(argv, env, identity=nobody)
    message = str(caught.value)
    assert "as user nobody" in message, message
    assert f"user nobody cannot reach {venv / 'python'}, which leads to {secret / 'prog'}" in (
        message
    )
    assert f"nobody may not enter {secret};" in message, message
    if how == "path":
        assert "no executable of that name on its PATH" in message, message
    # Run by root itself, the same program starts: it is there, only not for nobody.
    proc = await start_process(argv, env, identity=None)
    assert await proc.wait() == 0


async def test_start_process_resolves_in_the_child_and_withholds_secrets(tmp_path: Path) -> None:
    """start_process: a relative cwd ignores CDPATH, the program is found on the env's PATH
    (argv[0] becomes its path), stdin is /dev/null, and WITHHELD variables never pass."""
    (tmp_path / "work").mkdir()
    (tmp_path / "decoy" / "work").mkdir(parents=True)
    _executable(
        tmp_path / "bin" / "probe", '#!/bin/sh\necho "$0|$(pwd)|$SECRET_OK|$ELASTICD_TOKEN"; cat'
    )
    env = {
        "PATH": f"/nonexistent:{tmp_path / 'bin'}:/usr/bin:/bin",
        "CDPATH": str(tmp_path / "decoy"),
        "SECRET_OK": "kept",
        "ELASTICD_TOKEN": "must-not-pass",
        "NOTIFY_SOCKET": "/run/systemd/notify",
    }
    old = os.getcwd()
    os.chdir(tmp_path)
    try:
        async with asyncio.timeout(30):
            proc = await start_process(
                ["probe"], env, identity=None, cwd="work", stdout=asyncio.subprocess.PIPE
            )
            out, _ = await proc.communicate()
    finally:
        os.chdir(old)
    assert proc.returncode == 0
    assert out.decode().strip() == f"{tmp_path / 'bin' / 'probe'}|{tmp_path / 'work'}|kept|"
    with pytest.raises(WorkerSpawnError, match="no executable of that name"):
        await start_process(["elasticd-no-such-program"], env, identity=None)


@AS_ROOT
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
    assert f"log_dir folder {logs} belongs to uid 65534 (nobody)" in proc.stderr
    assert not any(logs.iterdir())
