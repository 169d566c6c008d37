"""A job's files are its user's, and the daemon's files are nobody else's from their first byte:
each attack of issue 22 (findings 3, 4, 5 and 13) performed against a real root daemon (or the
real store server), with real users sharing a group, and the safe outcome asserted."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import json
import os
import select
import shutil
import stat
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from elasticd.store.http import HttpStore
from elasticd.supervise.cgroup import Containment
from elasticd.supervise.spawn import SpawnPolicy, find_perl, find_setpriv, start_process
from tests.conftest import wait_job
from tests.hardening.support import make_token_file, serve
from tests.users import User, Users

ROOT = Path(__file__).resolve().parents[2]
AS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")
SETPRIV = find_setpriv() or shutil.which("setpriv")
#: The other user's programs run under the system Python (the project's venv may not be
#: readable by them): stdlib only.
SYSTEM_PY = "/usr/bin/python3"
NEEDS_OTHER_USERS = pytest.mark.skipif(
    os.geteuid() != 0 or SETPRIV is None or not os.access(SYSTEM_PY, os.X_OK),
    reason="needs root, setpriv and /usr/bin/python3 to act as another user",
)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def _umask_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Umask:"):
            return int(line.split()[1], 8)
    raise AssertionError(f"no Umask line for {pid}")


def _as_user(user: User, code: str, *args: str) -> Any:
    """Run ``code`` (stdlib Python) as ``user`` (its uid, its primary group only); its JSON."""
    out = subprocess.run(
        [
            str(SETPRIV),
            f"--reuid={user.uid}",
            f"--regid={user.gid}",
            "--clear-groups",
            SYSTEM_PY,
            "-I",
            "-c",
            code,
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
        cwd="/",
    )
    return json.loads(out.stdout)


#: Played by another local user: try to list every folder and read every file it is given.
#: Prints what it got: {path: "listed"/"read"/error name}.
PRYING = r"""
import json, os, sys
got = {}
for path in sys.argv[1:]:
    try:
        if os.path.isdir(path):
            os.listdir(path)
            got[path] = "listed"
        else:
            with open(path, "rb") as f:
                f.read(1)
            got[path] = "read"
    except OSError as e:
        got[path] = type(e).__name__
print(json.dumps(got))
"""


def _tree(top: Path) -> list[Path]:
    """``top`` and everything under it (as root sees it)."""
    found = [top]
    for folder, dirs, files in os.walk(top):
        found += [Path(folder) / name for name in dirs + files]
    return found


async def _submit_and_wait(c: httpx.AsyncClient, spec: dict[str, Any]) -> dict[str, Any]:
    r = await c.post("/jobs", json=spec)
    assert r.status_code == 201, r.text
    return await wait_job(c, spec["id"])


# -- finding 3: users who share a group read each other's job output ----------------------


@NEEDS_OTHER_USERS
@pytest.mark.slow
async def test_a_user_of_the_same_group_can_neither_read_nor_list_anything_of_anothers_job(
    open_tmp: Path, users: Users
) -> None:
    """alice and bob share their primary group; alice's job prints a secret to stdout and
    stderr and writes a file next to its logs. bob (a process of his) cannot list one folder
    of alice's job nor read one file in it, while alice reads her logs through the API and,
    by path, with her own process; the worker folder is hers and 0700, the logs hers and 0600."""
    group = users.group()
    alice, bob = users.user(group=group), users.user(group=group)
    daemon = serve(open_tmp, "--run-as", alice.name, env={"ELASTICD_ALLOW_ROOT": "false"})
    worker = 'echo "OUT-$SECRET"; echo "ERR-$SECRET" >&2; echo "$SECRET" > "${TORCHELASTIC_ERROR_FILE%/*}/notes"'
    try:
        async with asyncio.timeout(90), daemon.client() as c:
            await daemon.wait_ready()
            job = await _submit_and_wait(
                c,
                {
                    "id": "alices",
                    "entrypoint": "/bin/sh",
                    "args": ["-c", worker],
                    "env": {"SECRET": "hunter2"},
                    "max_restarts": 0,
                },
            )
            assert job["state"] == "SUCCEEDED", job
            r = await c.get("/jobs/alices/logs")
            assert r.status_code == 200 and "OUT-hunter2" in r.text  # alice's, through the API
    finally:
        daemon.stop()
    job_dir = open_tmp / "state" / "logs" / "alices"
    rank_dir = job_dir / "attempt_0" / "0"
    everything = _tree(job_dir)
    assert rank_dir / "stdout.log" in everything and rank_dir / "notes" in everything
    tried = _as_user(bob, PRYING, *map(str, everything))
    assert all(outcome == "PermissionError" for outcome in tried.values()), tried
    # alice reaches her own output by its path (the folders above are traverse-only).
    mine = _as_user(alice, PRYING, str(rank_dir), str(rank_dir / "stdout.log"))
    assert mine == {str(rank_dir): "listed", str(rank_dir / "stdout.log"): "read"}
    assert (rank_dir.stat().st_uid, _mode(rank_dir)) == (alice.uid, 0o700)
    for name in ("stdout.log", "stderr.log"):
        st = (rank_dir / name).stat()
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (alice.uid, 0o600), name
    for folder in (job_dir, job_dir / "attempt_0"):
        st = folder.lstat()
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 0, 0o711), folder


# -- finding 4: the daemon's state is born readable, and made private only later ------------


class _Births:
    """Every file and folder created in one folder, with its mode as soon as it was seen
    (inotify, so a window between a 0644 birth and a later chmod is caught)."""

    IN_CREATE = 0x100
    IN_MOVED_TO = 0x80
    IN_NONBLOCK = 0o4000

    def __init__(self, folder: Path) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        self._fd = libc.inotify_init1(self.IN_NONBLOCK)
        assert self._fd >= 0, os.strerror(ctypes.get_errno())
        wd = libc.inotify_add_watch(
            self._fd, str(folder).encode(), self.IN_CREATE | self.IN_MOVED_TO
        )
        assert wd >= 0, os.strerror(ctypes.get_errno())
        self._folder = folder
        self.modes: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.is_set():
            ready, _, _ = select.select([self._fd], [], [], 0.05)
            if not ready:
                continue
            data = os.read(self._fd, 65536)
            offset = 0
            while offset < len(data):
                _, _, _, length = struct.unpack_from("iIII", data, offset)
                raw = data[offset + 16 : offset + 16 + length]
                name = raw.split(b"\0", 1)[0].decode()
                offset += 16 + length
                try:
                    self.modes.setdefault(name, _mode(self._folder / name))
                except FileNotFoundError:
                    continue

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        os.close(self._fd)


@contextmanager
def _births(folder: Path) -> Iterator[_Births]:
    watcher = _Births(folder)
    try:
        yield watcher
    finally:
        watcher.close()


@AS_ROOT
@pytest.mark.slow
async def test_every_file_of_the_daemons_state_is_born_private(tmp_path: Path) -> None:
    """A real daemon on an empty state folder: each file and folder it creates there (the
    SQLite files and their -wal and -shm, the log root) has no group or other bit from the
    moment inotify reports it, so no local user can open one in a window; the daemon runs
    with umask 0077 even though it was started with 022."""
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    with _births(state) as births:
        daemon = serve(tmp_path, state_dir=state)
        try:
            async with asyncio.timeout(60), daemon.client() as c:
                await daemon.wait_ready()
                r = await c.post("/jobs", json={"id": "w", "entrypoint": "/bin/true"})
                assert r.status_code == 201
                await wait_job(c, "w")
                umask = _umask_of(daemon.proc.pid)
        finally:
            daemon.stop()
    born = births.modes
    assert {"elasticd.sqlite3", "store.sqlite3", "logs"} <= set(born), born
    assert any(name.endswith("-wal") for name in born), born
    # A root daemon's folders that its local users' jobs pass through are traverse-only
    # (0711: never listed, never read); the socket's folder holds the socket alone (0755),
    # and every connection on it is served as the uid the kernel names.
    public = {"run": 0o755, "run/elasticd.sock": 0o666}
    leaky = {
        name: oct(mode)
        for name, mode in born.items()
        if name not in public and mode & (0o066 if name in ("logs", "tokens") else 0o077)
    }
    assert not leaky, f"born readable by others: {leaky}"
    now = {
        str(p.relative_to(state)): oct(_mode(p))
        for p in _tree(state)[1:]
        if str(p.relative_to(state)) not in public
        and _mode(p) & (0o066 if p.is_dir() and not p.is_symlink() else 0o077)
    }
    assert not now, now
    assert umask == 0o077


@AS_ROOT
@pytest.mark.slow
def test_elasticd_run_keeps_its_state_private_and_gives_the_job_the_callers_umask(
    tmp_path: Path,
) -> None:
    """`elasticd run` started with umask 002 and a fresh --state-dir: its own files are 0600 in
    a 0700 folder and the process runs with umask 077, while its worker gets 002, the caller's
    (as torchrun's workers inherit it)."""
    state, out = tmp_path / "run-state", tmp_path / "umasks"
    code = f"grep Umask: /proc/self/status /proc/$PPID/status > {out}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICD_")}
    env["ELASTICD_ALLOW_ROOT"] = "true"
    done = subprocess.run(
        [sys.executable, "-m", "elasticd", "run", "--state-dir", str(state)]
        + ["--no-python", "--", "/bin/sh", "-c", code],
        capture_output=True,
        text=True,
        timeout=90,
        env=env,
        umask=0o002,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    worker, daemon = (line.split()[-1] for line in out.read_text().splitlines())
    assert (worker, daemon) == ("0002", "0077")
    assert _mode(state) == 0o700
    files = [p for p in state.iterdir() if p.is_file()]
    assert any(p.name.endswith("-wal") for p in files) or files
    assert {p.name: oct(_mode(p)) for p in files if _mode(p) != 0o600} == {}


# -- finding 5: the store server never makes its files private -----------------------------


@AS_ROOT
async def test_the_store_server_keeps_its_files_private(tmp_path: Path) -> None:
    """`python -m api.store_server` started with umask 022 on a fresh state folder, and on an
    existing 0755 one: once it listens (and a write has landed) the folder is 0700, the store
    and its -wal and -shm are 0600, and the process's umask is 0077."""
    token_file, token = make_token_file(tmp_path)
    existing = tmp_path / "existing"
    existing.mkdir(mode=0o755)
    existing.chmod(0o755)
    for state in (tmp_path / "fresh" / "state", existing):
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            *["-m", "api.store_server", "--port", "0", "--loop", "asyncio"],
            *["--state-dir", str(state), "--token-file", str(token_file)],
            stdout=asyncio.subprocess.PIPE,
            cwd=ROOT,
            umask=0o022,
        )
        try:
            assert proc.stdout is not None
            line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
            assert line.startswith("listening on "), line
            url = line.split()[-1]
            async with HttpStore(url, token) as client:
                await client.put("/job/x", b"s3cret")  # the journal has a write in it
            assert _umask_of(proc.pid) == 0o077
            assert _mode(state) == 0o700
            files = sorted(p.name for p in state.iterdir())
            assert {"store.sqlite3", "store.sqlite3-wal", "store.sqlite3-shm"} <= set(files)
            assert {n: oct(_mode(state / n)) for n in files if _mode(state / n) != 0o600} == {}
        finally:
            proc.terminate()
            await asyncio.wait_for(proc.wait(), 30)


# -- finding 13: workers inherit root's umask 022 ------------------------------------------

#: A worker that prints its umask, as the kernel reports it.
PRINT_UMASK = ["-c", "grep Umask: /proc/self/status"]


def _logged_umask(text: str) -> str:
    return text.split("Umask:")[1].split()[0]


@AS_ROOT
@pytest.mark.slow
@pytest.mark.parametrize("containment", ["cgroup", "subreaper"])
async def test_a_jobs_workers_get_umask_0027_unless_the_spec_sets_one(
    open_tmp: Path, containment: str
) -> None:
    """A real root daemon (its own umask 077): a worker of a job without `umask` runs with 0027
    (never root's 022, nor the daemon's 077), one whose spec says "077" with 0077, and one
    that says 2 (an int) with 0002; through the cgroup start stage and the plain start."""
    if containment == "cgroup" and not _cgroups_writable(open_tmp):
        pytest.skip("no writable cgroup v2 here")
    daemon = serve(open_tmp, env={"ELASTICD_CONTAINMENT": containment})
    cases = {"default": None, "strict": "077", "loose": 2}
    seen: dict[str, str] = {}
    try:
        async with asyncio.timeout(90), daemon.client() as c:
            await daemon.wait_ready()
            for job_id, umask in cases.items():
                spec: dict[str, Any] = {"id": job_id, "entrypoint": "/bin/sh", "args": PRINT_UMASK}
                if umask is not None:
                    spec["umask"] = umask
                job = await _submit_and_wait(c, spec)
                assert job["state"] == "SUCCEEDED", job
                seen[job_id] = _logged_umask((await c.get(f"/jobs/{job_id}/logs")).text)
                if job_id == "default":
                    assert seen == {"default": "0027"}  # the attack: root's 022 reached it
            shown = (await c.get("/jobs/strict")).json()["spec"]["umask"]
    finally:
        daemon.stop()
    assert seen == {"default": "0027", "strict": "0077", "loose": "0002"}
    assert shown == "0077"


def _cgroups_writable(root: Path) -> bool:
    try:
        Containment.setup("cgroup", node="umask-probe", state_dir=root).close()
    except Exception:
        return False
    return True


@AS_ROOT
@pytest.mark.parametrize("stage", ["perl", "python", "none"])
async def test_the_umask_holds_on_every_start_path(tmp_path: Path, stage: str) -> None:
    """start_process with umask 0o027, from a process whose umask is 077: the program has
    0027 after the Perl root stage, the Python root stage (each into a cgroup) and the
    start with no cgroup (the Python stage again: all three switch to nobody)."""
    import pwd

    from elasticd.security import Identity

    if stage == "perl" and find_perl() is None:
        pytest.skip("no usable perl here")
    nobody = pwd.getpwnam("nobody")
    identity = Identity("nobody", nobody.pw_uid, nobody.pw_gid, nobody.pw_dir, (nobody.pw_gid,))
    containment = attempt = None
    if stage != "none":
        if not _cgroups_writable(tmp_path):
            pytest.skip("no writable cgroup v2 here")
        containment = Containment.setup("cgroup", node=f"umask-{stage}", state_dir=tmp_path)
        attempt = containment.open_attempt("umask", 0, None)
    before = os.umask(0o077)
    try:
        proc = await start_process(
            ["sh", *PRINT_UMASK],
            {"PATH": "/usr/bin:/bin"},
            identity=identity,
            stdout=asyncio.subprocess.PIPE,
            policy=SpawnPolicy(stage=stage == "perl"),
            cgroup_procs=attempt.procs_fd if attempt is not None else None,
            umask=0o027,
        )
        out, _ = await asyncio.wait_for(proc.communicate(), 30)
    finally:
        os.umask(before)
        if attempt is not None and attempt.cgroup is not None:
            attempt.cgroup.stop_now()
        if containment is not None:
            containment.close()
    assert _logged_umask(out.decode()) == "0027"


@AS_ROOT
@pytest.mark.slow
async def test_elasticd_submit_sends_the_callers_umask(open_tmp: Path) -> None:
    """`elasticd submit` run with umask 007 and no --umask: the job's spec says 0007 and its
    worker runs with it; with --umask 077 the flag wins."""
    daemon = serve(open_tmp)
    assert daemon.token is not None
    (open_tmp / "client").mkdir()
    token_file, _ = make_token_file(open_tmp / "client", daemon.token)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICD_")}
    env.update({"ELASTICD_URL": daemon.url, "ELASTICD_TOKEN_FILE": str(token_file)})

    def submit(job_id: str, *flags: str) -> None:
        done = subprocess.run(
            [sys.executable, "-m", "elasticd", "submit", "--id", job_id, *flags]
            + ["--", "/bin/sh", *PRINT_UMASK],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
            umask=0o007,
            cwd=open_tmp,
        )
        assert done.returncode == 0, done.stderr

    try:
        async with asyncio.timeout(90), daemon.client() as c:
            await daemon.wait_ready()
            await asyncio.to_thread(submit, "inherited")
            await asyncio.to_thread(submit, "flagged", "--umask", "077")
            specs, seen = {}, {}
            for job_id in ("inherited", "flagged"):
                await wait_job(c, job_id)
                specs[job_id] = (await c.get(f"/jobs/{job_id}")).json()["spec"]["umask"]
                seen[job_id] = _logged_umask((await c.get(f"/jobs/{job_id}/logs")).text)
    finally:
        daemon.stop()
    assert specs == {"inherited": "0007", "flagged": "0077"}
    assert seen == specs
