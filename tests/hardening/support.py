"""Helpers for the hardening tests: real `elasticd serve` processes, /proc checks, tiny workers.

Every daemon runs in its own session, so a test can SIGKILL it alone and
then check, through /proc, what happened to its workers. Waiting is always
polling a condition under a deadline, never a bare sleep.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import secrets
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx

PY = sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def proc_state(pid: int) -> str | None:
    """The /proc state letter of ``pid`` (None when there is no such process)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie is dead (it cannot act, only wait to be reaped)."""
    return proc_state(pid) not in (None, "Z", "X")


def proc_uid(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise AssertionError(f"no Uid line for {pid}")


async def eventually(condition: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll ``condition`` every 10 ms until it holds; returns the seconds it took."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)
    return time.monotonic() - started


def script(folder: Path, name: str, body: str) -> str:
    path = folder / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def make_token_file(folder: Path, token: str | None = None) -> tuple[Path, str]:
    token = token or secrets.token_urlsafe(32)
    path = folder / "token"
    path.write_text(token + "\n")
    path.chmod(0o600)
    return path, token


@dataclass
class Served:
    """One `elasticd serve` process."""

    proc: subprocess.Popen[bytes]
    port: int
    state_dir: Path
    log: Path
    token: str | None
    args: list[str] = field(default_factory=list)
    environ: dict[str, str] = field(default_factory=dict)
    cwd: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def client(self, **kwargs: Any) -> httpx.AsyncClient:
        headers = {**self.headers, **kwargs.pop("headers", {})}
        return httpx.AsyncClient(base_url=self.url, headers=headers, timeout=30, **kwargs)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    async def wait_ready(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        async with self.client() as c:
            while True:
                if self.proc.poll() is not None:
                    raise AssertionError(f"daemon exited {self.proc.returncode}:\n{self.output()}")
                with contextlib.suppress(httpx.TransportError):
                    if (await c.get("/readyz")).status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise AssertionError(f"daemon not ready:\n{self.output()[-3000:]}")
                await asyncio.sleep(0.02)

    def kill9(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def restart(self) -> None:
        """Start the daemon again after it died, as systemd would: the same command line,
        environment and folder (so the same port, state folder and token)."""
        assert self.proc.poll() is not None, "the daemon still runs"
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                self.args,
                env=self.environ,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=self.cwd,
            )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def serve(
    root: Path,
    *extra: str,
    state_dir: Path | None = None,
    token_file: Path | None | Literal[False] = None,
    env: dict[str, str] | None = None,
    node_name: str = "hard-node",
    port: int | None = None,
    verbose: bool = False,
    nofile: tuple[int, int] | None = None,
    cwd: Path | None = None,
    cpus: int | None = None,
) -> Served:
    """Start `elasticd serve` on a free loopback port (as root, jobs may run as root).

    ``nofile``: the daemon's (soft, hard) ``RLIMIT_NOFILE``, set before its exec.
    ``cwd``: where it runs (``python -m`` imports from there first).
    ``cpus``: the daemon runs on this many of the CPUs the test may use (its affinity).
    """
    port = port or free_port()
    state_dir = state_dir or root / "state"
    if token_file is False:
        token_file = None  # the daemon makes its own, in its state folder
    elif token_file is None and "ELASTICD_TOKEN" not in (env or {}):
        # Every daemon has a token (a daemon given none makes its own, in its state folder).
        token_file = root / f"auto-token-{port}"
        token_file.write_text(secrets.token_urlsafe(32) + "\n")
        token_file.chmod(0o600)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICD_")}
    environ["ELASTICD_ALLOW_ROOT"] = "true"
    environ.update(env or {})
    args = [
        PY,
        "-m",
        "elasticd",
        *(["-v"] if verbose else []),
        "serve",
        "--port",
        str(port),
        "--state-dir",
        str(state_dir),
        "--node-name",
        node_name,
        "--slots",
        "8",
        *(["--token-file", str(token_file)] if token_file else []),
        *extra,
    ]
    log = root / f"daemon-{port}.log"
    token = token_file.read_text().strip() if token_file else None
    with log.open("ab") as out:
        proc = subprocess.Popen(
            args,
            env=environ,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_preexec(nofile, cpus),
            cwd=cwd,
        )
    return Served(proc, port, state_dir, log, token, args, environ, cwd)


def _preexec(nofile: tuple[int, int] | None, cpus: int | None) -> Callable[[], None] | None:
    if nofile is None and cpus is None:
        return None
    mine = sorted(os.sched_getaffinity(0))
    if cpus is not None and cpus > len(mine):
        raise AssertionError(f"the test needs {cpus} CPUs, this machine has {len(mine)}")

    def preexec() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, nofile)
        if cpus is not None:
            os.sched_setaffinity(0, mine[:cpus])

    return preexec


async def healthy_pids(client: httpx.AsyncClient, job_id: str, count: int, timeout: float = 30):
    """The worker pids once the job's group is HEALTHY with ``count`` workers."""
    deadline = time.monotonic() + timeout
    after = 0
    while True:
        view = (await client.get(f"/jobs/{job_id}/workers")).json()
        for group in view.get("groups", []):
            pids = [w["pid"] for w in group["workers"] if w.get("pid")]
            if group["state"] == "HEALTHY" and len(pids) == count:
                return pids
        if time.monotonic() > deadline:
            raise AssertionError(f"job {job_id} not healthy: {view}")
        r = await client.get(f"/jobs/{job_id}/events", params={"after": after, "wait": 0.5})
        if r.status_code == 200 and r.json():
            after = r.json()[-1]["seq"]


SLEEPER = """
import os, sys, time
print("ready", os.getpid(), flush=True)
time.sleep(600)
"""


def processes(what: str) -> Iterator[tuple[int, list[bytes]]]:
    """Each live process's pid and its ``/proc/<pid>/<what>`` (``cmdline``, ``environ``),
    split at its NULs; a process that cannot be read (gone, another user's) is left out."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / what).read_bytes().split(b"\0")
            except OSError:
                continue
            if pid_alive(int(entry.name)):
                yield int(entry.name), fields


def running_program(path: str) -> list[int]:
    """The live processes whose command line names ``path`` (a test's own script)."""
    return [pid for pid, argv in processes("cmdline") if path.encode() in argv]


def job_ranks(job_id: str, port: int) -> dict[int, list[int]]:
    """The live processes of ``job_id`` run by the daemon on ``port``, by global rank.

    Found in ``/proc`` by the environment every worker gets (``ELASTICD_JOB_ID``,
    ``RANK``, and ``ELASTICD_URL``, whose port tells this test's daemon from any other;
    children inherit it), so a process that outlived its daemon counts too.
    """
    job, url = f"ELASTICD_JOB_ID={job_id}".encode(), f":{port}".encode()
    ranks: dict[int, list[int]] = {}
    for pid, environ in processes("environ"):
        found = dict(v.split(b"=", 1) for v in environ if b"=" in v)
        if job in environ and found.get(b"ELASTICD_URL", b"").endswith(url) and b"RANK" in found:
            ranks.setdefault(int(found[b"RANK"]), []).append(pid)
    return ranks


def cgroup_home() -> Path | None:
    """This process's cgroup v2 folder when it is writable (the daemons it starts then make
    their subtrees there), read as the daemon reads it (elasticd.supervise.cgroup)."""
    from elasticd.supervise.cgroup import cgroup2_mount, own_cgroup

    if os.geteuid() != 0:
        return None
    mount = cgroup2_mount(Path("/proc/self/mountinfo").read_text())
    own = own_cgroup(Path("/proc/self/cgroup").read_text())
    if mount is None or own is None:
        return None
    here = Path(mount) / own.lstrip("/")
    return here if os.access(here, os.W_OK) else None


def daemon_subtree(home: Path, node: str, state_dir: Path) -> Path:
    """The cgroup subtree a daemon of ``node`` on ``state_dir`` makes under ``home``."""
    from elasticd.supervise.cgroup import subtree_name

    return home / subtree_name(node, str(state_dir.resolve()))
