"""Worker spawns: the parent-death signal (setpriv and the Python fallback), users, log folders."""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import subprocess
import sys
from pathlib import Path

import pytest

from elasticd.config import load_config
from elasticd.errors import ConfigError, WorkerSpawnError
from elasticd.security import JobUsers, lookup_user, resolve_job_users
from elasticd.supervise import WorkerGroupProcesses, WorkerLaunch
from elasticd.supervise.spawn import (
    CGROUP_STAGE,
    PY_WRAPPER,
    SpawnPolicy,
    find_perl,
    find_setpriv,
    python_stage,
    start_process,
    wrap_argv,
)
from tests.hardening.support import eventually, pid_alive, proc_uid

ROOT = Path(__file__).resolve().parents[2]
AS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")
WRAPPERS = [
    pytest.param(
        "setpriv",
        marks=pytest.mark.skipif(find_setpriv() is None, reason="no setpriv --pdeathsig"),
    ),
    "python",
]

# A stand-in daemon: spawns one worker through the real spawn path, waits until the
# worker runs its own program (the wrapper is done), prints its pid and dies at once.
PARENT = """
import asyncio, os, sys, time
from pathlib import Path
from elasticd.security import JobUsers, lookup_user
from elasticd.supervise import WorkerGroupProcesses, WorkerLaunch
from elasticd.supervise.spawn import SpawnPolicy

wrapper, user, log_dir = sys.argv[1], sys.argv[2], Path(sys.argv[3])
users = JobUsers(default=lookup_user(user)) if user != "-" else None
policy = SpawnPolicy(users=users, setpriv=True if wrapper == "setpriv" else False)

async def main():
    # /bin/sh, not this Python: another user may not be able to run this one.
    code = "exec sleep 600 # pdeathsig-test-worker"
    launch = WorkerLaunch(0, ["/bin/sh", "-c", code], dict(os.environ), "/", log_dir)
    group = await WorkerGroupProcesses.start([launch], policy=policy)
    pid = group.pids[0]
    deadline = time.monotonic() + 20
    while Path(f"/proc/{pid}/cmdline").read_bytes().split(bytes(1))[0] != b"sleep":
        assert time.monotonic() < deadline, "the worker never ran its program"
        await asyncio.sleep(0.005)
    print(pid, flush=True)
    os._exit(0)  # die like a SIGKILLed daemon: nothing is stopped

asyncio.run(main())
"""


def _orphan_worker(wrapper: str, user: str, log_dir: Path, python: str = sys.executable) -> int:
    return int(_parent_output([PARENT, wrapper, user, str(log_dir)], python).split()[-1])


def _parent_output(args: list[str], python: str = sys.executable) -> str:
    """The stdout of ``python -c *args`` (a stand-in daemon), which must succeed."""
    done = subprocess.run(
        [python, "-c", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize("wrapper", WRAPPERS)
async def test_a_worker_dies_with_its_parent(tmp_path: Path, wrapper: str) -> None:
    """The parent process exits without stopping its worker: the kernel kills the worker."""
    pid = _orphan_worker(wrapper, "-", tmp_path / "logs" / "j" / "attempt_0" / "0")
    took = await eventually(lambda: not pid_alive(pid), 2.0, f"worker {pid} to die")
    assert took < 2.0


@AS_ROOT
@pytest.mark.parametrize("wrapper", WRAPPERS)
async def test_the_death_signal_survives_the_switch_to_another_user(
    open_tmp: Path, wrapper: str, request: pytest.FixtureRequest
) -> None:
    """A worker switched to `nobody` still dies with its parent (the signal is set after setuid).

    The Python fallback runs the daemon's own interpreter as the job user: the stand-in
    daemon runs on nobody's venv (the tests' own may be out of a normal user's reach)."""
    python = (
        request.getfixturevalue("nobody_clone").python if wrapper == "python" else sys.executable
    )
    log_dir = open_tmp / "logs" / "j" / "attempt_0" / "0"
    pid = _orphan_worker(wrapper, "nobody", log_dir, python)
    try:
        assert proc_uid(pid) == lookup_user("nobody").uid
    except FileNotFoundError:
        pass  # already gone: fine too
    await eventually(lambda: not pid_alive(pid), 2.0, f"worker {pid} (nobody) to die")


# A stand-in daemon that starts one worker as another user, with no cgroup, straight
# through start_process (the root stage, then the parent-death signal), reads the
# worker's ids and umask once it runs its program, prints them and dies at once.
IDS_PARENT = """
import asyncio, json, os, sys, time
from pathlib import Path
from elasticd.security import Identity
from elasticd.supervise.spawn import SpawnPolicy, start_process

stage, wrapper, uid, gid, groups = sys.argv[1:6]
policy = SpawnPolicy(setpriv=wrapper == "setpriv", stage=stage == "perl")
identity = Identity("probe", int(uid), int(gid), "/", tuple(int(g) for g in groups.split(",")))

async def main():
    proc = await start_process(
        ["/bin/sh", "-c", "exec sleep 600"], dict(os.environ), identity=identity,
        policy=policy, umask=0o027, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,  # not this process's pipes: the test reads them to EOF
    )
    status = Path(f"/proc/{proc.pid}/status")
    deadline = time.monotonic() + 20
    while Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(bytes(1))[0] != b"sleep":
        assert time.monotonic() < deadline, "the worker never ran its program"
        await asyncio.sleep(0.005)
    fields = dict(line.split(":", 1) for line in status.read_text().splitlines())
    print(json.dumps({k: fields[k].split() for k in ("Uid", "Gid", "Groups", "Umask")}))
    print(proc.pid, flush=True)
    os._exit(0)  # die like a SIGKILLed daemon: nothing is stopped

asyncio.run(main())
"""


@AS_ROOT
@pytest.mark.parametrize("stage", ["perl", "python"])
@pytest.mark.parametrize("wrapper", WRAPPERS)
async def test_a_worker_of_another_user_without_a_cgroup_has_its_ids_umask_and_death_signal(
    stage: str, wrapper: str
) -> None:
    """Started as another user with no cgroup (the root stage, where subprocess would fork()
    to switch users itself): the user's real, effective and saved uid and gid, exactly its
    groups, the umask asked for, and the worker dies with its parent."""
    if stage == "perl" and find_perl() is None:
        pytest.skip("no usable perl")
    nobody = lookup_user("nobody")
    groups = sorted({nobody.gid, 100})
    ids = [str(nobody.uid), str(nobody.gid), ",".join(map(str, groups))]
    seen_line, pid_line = _parent_output([IDS_PARENT, stage, wrapper, *ids]).splitlines()[-2:]
    seen = json.loads(seen_line)
    assert seen["Uid"] == [str(nobody.uid)] * 4
    assert seen["Gid"] == [str(nobody.gid)] * 4
    assert sorted(int(g) for g in seen["Groups"]) == groups
    assert seen["Umask"] == ["0027"]
    pid = int(pid_line)
    await eventually(lambda: not pid_alive(pid), 2.0, f"worker {pid} ({stage}, {wrapper}) to die")


def test_the_wrapper_argv() -> None:
    """setpriv runs the resolved program; the fallback is an isolated Python that keeps argv[0]."""
    assert wrap_argv("/usr/bin/python3", ["python", "x.py"], setpriv="/usr/bin/setpriv") == [
        "/usr/bin/setpriv",
        "--pdeathsig",
        "KILL",
        "--",
        "/usr/bin/python3",
        "x.py",
    ]
    fallback = wrap_argv("/usr/bin/python3", ["python", "x.py"], setpriv=None)
    assert fallback[:5] == [sys.executable, "-I", "-S", "-c", PY_WRAPPER]
    assert fallback[5:] == [str(os.getpid()), "/usr/bin/python3", "python", "x.py"]


@pytest.mark.parametrize(
    "arg", ["plain", 'it\'s "quoted"\n\\', "\u00e9\u4e2d", "\udcff", "'); import os #"]
)
def test_the_python_stage_reads_its_arguments_as_literals(arg: str) -> None:
    """The arguments written into the Python stage come back exactly as given, as data:
    quotes, newlines, non-ASCII and an undecodable byte (a surrogate) alike."""
    text = python_stage(7, ["-1", arg])
    assert text.endswith(CGROUP_STAGE.encode())
    scope: dict[str, object] = {}
    exec(text.decode().removesuffix(CGROUP_STAGE), {}, scope)
    assert scope == {"a": ["7", "-1", arg]}


async def test_a_nul_in_an_argument_is_a_start_error_on_the_python_stage() -> None:
    """A NUL cannot be on a command line; written into the Python stage it would not be cut
    there either: the start fails, as subprocess fails it, and nothing runs."""
    r, w = os.pipe()  # a cgroup.procs stand-in: the root stage is used
    try:
        with pytest.raises(WorkerSpawnError, match="embedded null byte"):
            await start_process(
                ["sh", "-c", "true\0"],
                {"PATH": "/usr/bin:/bin"},
                identity=None,
                cgroup_procs=w,
                policy=SpawnPolicy(stage=False),
            )
    finally:
        os.close(r)
        os.close(w)


# -- users ---------------------------------------------------------------------------


def _config(**settings: object):
    return load_config(settings, environ={})


def test_a_non_root_daemon_runs_jobs_as_itself() -> None:
    """Not root: jobs run as the daemon; asking for any other user is a configuration error."""
    me = pwd.getpwuid(os.geteuid()).pw_name
    users = resolve_job_users(_config(), euid=1000 if os.geteuid() == 0 else os.geteuid())
    assert users.default is None and users.refusal is None
    if os.geteuid() != 0:
        assert users.for_job(me) is None
    with pytest.raises(ConfigError, match="only a daemon running as root"):
        resolve_job_users(_config(run_as="root"), euid=4242)


@AS_ROOT
def test_root_daemon_user_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    """Root: run_as wins; else the service user; else refused unless allow_root; embedded: caller."""
    nobody = lookup_user("nobody")
    users = resolve_job_users(_config(run_as="nobody", allow_root=False))
    assert users.for_job(None) == nobody
    with pytest.raises(WorkerSpawnError, match="'root', which this node does not allow"):
        users.for_job("root")
    with pytest.raises(ConfigError, match="refusing to run jobs as root"):
        resolve_job_users(_config(run_as="root", allow_root=False))
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_job_users(_config(run_as="no-such-user-here", allow_root=False))
    # `elasticd serve` (allow_root False) with no service user: jobs are refused, with the fix.
    monkeypatch.setattr("elasticd.security.SERVICE_USER", "no-such-service-user")
    refused = resolve_job_users(_config(allow_root=False))
    with pytest.raises(WorkerSpawnError, match="allow_root = true") as caught:
        refused.for_job(None)
    # The fix in both spellings: the flags the README names and the config keys.
    for spelling in ("--run-as USER", 'run_as = "USER"', "--allow-root", "allow_root = true"):
        assert spelling in str(caught.value), caught.value
    assert resolve_job_users(_config(allow_root=True)).for_job(None) is None  # root, as told
    assert resolve_job_users(_config()).for_job(None) is None  # embedded: the caller
    # With the service user present, the service runs jobs as it.
    monkeypatch.setattr("elasticd.security.SERVICE_USER", "nobody")
    assert resolve_job_users(_config(allow_root=False)).for_job(None) == nobody
    # A job may name a user only from allowed_users (and the run_as user).
    listed = resolve_job_users(_config(run_as="nobody", allowed_users="daemon", allow_root=False))
    assert listed.for_job("daemon") == lookup_user("daemon")
    assert listed.for_job("nobody") == nobody
    with pytest.raises(WorkerSpawnError, match="allowed_users in the config: daemon, nobody"):
        listed.for_job("bin")


async def test_a_job_asking_for_a_user_the_daemon_does_not_allow_fails_to_spawn(
    tmp_path: Path,
) -> None:
    """The spawn refuses a user outside the policy, naming the rank and the allowed users."""
    policy = SpawnPolicy(users=JobUsers(default=None, allowed={}))
    launch = WorkerLaunch(
        0, [sys.executable, "-c", "pass"], dict(os.environ), None, tmp_path, user="bin"
    )
    with pytest.raises(
        WorkerSpawnError, match="local rank 0: .*'bin'.*allowed_users in the config: none"
    ):
        await WorkerGroupProcesses.start([launch], policy=policy)


@AS_ROOT
async def test_a_worker_of_another_user_owns_its_folder_but_not_the_ones_above(
    open_tmp: Path,
) -> None:
    """As `nobody`: the rank folder (0700) and logs (0600) are nobody's only; the job and attempt
    folders stay root's, traverse-only (0711), with root's group, never the job user's."""
    nobody = lookup_user("nobody")
    policy = SpawnPolicy(users=JobUsers(default=nobody))
    log_dir = open_tmp / "logs" / "j" / "attempt_0" / "0"
    code = 'id -u; echo "$HOME"; echo x > "$LOGS/mine"'
    env = {**os.environ, "LOGS": str(log_dir)}
    launch = WorkerLaunch(0, ["/bin/sh", "-c", code], env, "/", log_dir)
    async with await WorkerGroupProcesses.start([launch], policy=policy) as group:
        result = await group.wait()
    assert result.succeeded, (log_dir / "stderr.log").read_text()
    assert (log_dir / "stdout.log").read_text().split() == [str(nobody.uid), nobody.home]
    for path in (log_dir, log_dir / "stdout.log", log_dir / "mine"):
        assert path.stat().st_uid == nobody.uid, path
    assert log_dir.stat().st_mode & 0o777 == 0o700
    for name in ("stdout.log", "stderr.log"):
        assert (log_dir / name).stat().st_mode & 0o777 == 0o600, name
    for folder in (log_dir.parent, log_dir.parent.parent):
        st = folder.stat()
        assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (0, 0, 0o711), folder


async def test_a_log_file_that_is_a_symlink_is_refused(tmp_path: Path) -> None:
    """The daemon never appends worker output through a link planted in the log folder."""
    log_dir = tmp_path / "j" / "attempt_0" / "0"
    log_dir.mkdir(parents=True)
    target = tmp_path / "precious"
    target.write_text("keep me\n")
    (log_dir / "stdout.log").symlink_to(target)
    launch = WorkerLaunch(0, [sys.executable, "-c", "print('x')"], dict(os.environ), None, log_dir)
    with pytest.raises(WorkerSpawnError, match="cannot set up the logs"):
        await WorkerGroupProcesses.start([launch])
    assert target.read_text() == "keep me\n"


@AS_ROOT
@pytest.mark.parametrize("stage", ["perl", "python"])
async def test_a_user_switch_that_fails_is_a_start_error_on_each_stage(
    tmp_path: Path, stage: str
) -> None:
    """A group the kernel refuses (gid 2^32 - 1): the start raises, as the stage's failure,
    on the Perl and the Python stage alike; nothing of the job runs."""
    from elasticd.errors import SpawnStage
    from elasticd.security import Identity
    from elasticd.supervise.spawn import SpawnPolicy, start_process

    bad = Identity("nobody", 65534, 65534, "/nonexistent", (65534, 4294967295))
    marker = tmp_path / "ran"
    with pytest.raises(WorkerSpawnError) as caught:
        async with asyncio.timeout(30):
            await start_process(
                ["/bin/touch", str(marker)],
                {"PATH": "/bin:/usr/bin"},
                identity=bad,
                policy=SpawnPolicy(stage=stage == "perl"),
            )
    assert caught.value.stage is SpawnStage.STAGE, caught.value
    assert not marker.exists()
