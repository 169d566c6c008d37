"""The in-place upgrade: the daemon re-executes itself with the same pid (issue 25).

``SIGHUP`` (``systemctl reload elasticd``: ``ExecReload=/bin/kill -HUP
$MAINPID``) or an admin's ``POST /reload`` (``elasticd reload``) asks for
it. In order:

1. **Pre-flight** (:func:`preflight`): the installed program is run with the
   daemon's own command line and ``--check``: it imports everything the
   daemon would and validates the configuration, then prints its version.
   If that fails the daemon stays as it is, and says why in the log and in a
   ``daemon.reexec_refused`` event on each job it runs.
2. **Quiesce** (:meth:`Daemon.reexec <elasticd.node.daemon.Daemon.reexec>`):
   ``/readyz`` says "re-executing"; the node's lease is renewed (a full TTL
   for the new image to take it up); the HTTP server stops accepting and
   drains briefly, its listening sockets kept (connections that arrive
   meanwhile wait in the kernel's backlog for the new image: none is
   refused); the loop runs until no worker exit is half-delivered.
3. **Hand-over** (:class:`Manifest`, JSON, never pickle): with no await
   between it and the ``exec``, each agent that is watching its running
   workers hands over its attempt (:mod:`elasticd.agent.handover`); the
   descriptors named in the manifest (listening sockets, pipes, log files,
   heartbeats) are inheritable copies, every other descriptor closes at the
   ``exec``. The manifest travels in a memfd whose number is in
   ``ELASTICD_REEXEC_FD``: it never touches the disk (it names the job
   tokens' hashes).
4. **exec** of the same interpreter with the same command line: same pid,
   so the workers stay its children; no parent-death signal fires; nothing
   is signalled.

The new image (:func:`take_manifest` at start-up) keeps the listening
sockets, takes up the node's lease and the job tokens, leaves the handed
workers out of the orphan sweep, and re-adopts each job whose workers pass
:func:`~elasticd.supervise.adopt.check_worker` (``job.readopted``; ``/readyz``
is not ready until every handed job is taken up). A job that was not handed
over, or whose workers fail the check, has them killed by the orphan sweep
and resumes as a new attempt with no restart charged (``job.resumed`` says
why), as after a crash.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

from elasticd.agent.handover import AgentHandover
from elasticd.config import Config
from elasticd.errors import WorkerSpawnError
from elasticd.security import resolve_job_users
from elasticd.supervise.adopt import AdoptedProcess, check_worker, close_fds
from elasticd.supervise.spawn import start_process

__all__ = [
    "ENV_FD",
    "PREFLIGHT_TIMEOUT",
    "Manifest",
    "exec_self",
    "preflight",
    "reap_swept",
    "take_manifest",
]

log = logging.getLogger("elasticd.node.reexec")

#: The environment variable that names the hand-over manifest's descriptor in the new image.
ENV_FD = "ELASTICD_REEXEC_FD"
#: Seconds the pre-flight check may take (imports on a loaded node are slow).
PREFLIGHT_TIMEOUT = 60.0
#: The manifest's format; a new image that does not know it starts afresh (jobs resume).
FORMAT = 1


@dataclass
class Manifest:
    """What one program image of the daemon hands to the next (JSON)."""

    old_version: str
    tcp_fd: int | None = None
    unix_fd: int | None = None
    lease: int | None = None
    agents: list[AgentHandover] = field(default_factory=list)
    #: Jobs this node ran that were not handed over, and why (they resume as new attempts).
    not_handed: dict[str, str] = field(default_factory=dict)
    #: Each job's token hash on this node (its workers keep the token they read).
    job_tokens: dict[str, str] = field(default_factory=dict)
    #: Filled in by the new image: handed jobs whose workers failed the check, and why.
    refused: dict[str, str] = field(default_factory=dict)

    def encode(self) -> bytes:
        return json.dumps(
            {
                "format": FORMAT,
                "old_version": self.old_version,
                "tcp_fd": self.tcp_fd,
                "unix_fd": self.unix_fd,
                "lease": self.lease,
                "agents": [a.to_json() for a in self.agents],
                "not_handed": self.not_handed,
                "job_tokens": self.job_tokens,
            }
        ).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Manifest:
        doc = json.loads(raw)
        if doc.get("format") != FORMAT:
            raise ValueError(f"unknown hand-over format {doc.get('format')!r}")
        return cls(
            old_version=str(doc["old_version"]),
            tcp_fd=_int_or_none(doc.get("tcp_fd")),
            unix_fd=_int_or_none(doc.get("unix_fd")),
            lease=_int_or_none(doc.get("lease")),
            agents=[AgentHandover.from_json(a) for a in doc.get("agents", [])],
            not_handed={str(k): str(v) for k, v in doc.get("not_handed", {}).items()},
            job_tokens={str(k): str(v) for k, v in doc.get("job_tokens", {}).items()},
        )

    @property
    def fds(self) -> list[int]:
        listeners = [fd for fd in (self.tcp_fd, self.unix_fd) if fd is not None]
        return listeners + [fd for a in self.agents for fd in a.fds]

    def adopted_pids(self) -> set[tuple[int, int]]:
        """(pid, start time) of every worker handed over and found fit (the sweep spares them)."""
        return {(w.pid, w.start_time) for a in self.agents for w in a.workers}

    def check(self, cgroup_ok: bool) -> None:
        """Keep only the jobs whose every worker can be taken up; the rest go to
        :attr:`refused` with the reason (their workers are swept, their descriptors closed)."""
        kept = []
        for agent in self.agents:
            reasons = [
                check_worker(w, Path(agent.cgroup) if cgroup_ok and agent.cgroup else None)
                for w in agent.workers
            ]
            reason = next((r for r in reasons if r is not None), None)
            if reason is None:
                kept.append(agent)
                continue
            self.refused[agent.job_id] = reason
            close_fds(agent.fds)
        self.agents = kept


def _int_or_none(value: object) -> int | None:
    return None if value is None else int(str(value))


def take_manifest() -> Manifest | None:
    """The new image's start: the manifest its previous image left (None: a plain start).

    Removes ``ELASTICD_REEXEC_FD`` from the environment so that nothing started
    later sees it.
    """
    value = os.environ.pop(ENV_FD, None)
    if value is None:
        return None
    try:
        fd = int(value)
        with os.fdopen(fd, "rb") as f:
            f.seek(0)
            return Manifest.decode(f.read())
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.error(
            "the hand-over of the previous program image is unreadable (%s); "
            "starting afresh: its jobs resume as new attempts",
            exc,
        )
        return None


#: What the pre-flight imports: the daemon's whole program (never the job's side: torch).
CHECKED_PACKAGES = (
    "api",
    "elasticd.node",
    "elasticd.agent",
    "elasticd.supervise",
    "elasticd.rendezvous",
    "elasticd.store",
    "elasticd.sched",
)


def check_install(config: Config) -> int:
    """``elasticd serve --check``: import every module the daemon runs, validate ``config``
    (already loaded by the caller), print ``elasticd <version>``; 0, or 2 with the error."""
    import importlib
    import pkgutil

    from elasticd import __version__

    try:
        for name in CHECKED_PACKAGES:
            package = importlib.import_module(name)
            for module in pkgutil.walk_packages(package.__path__, f"{name}."):
                importlib.import_module(module.name)
        resolve_job_users(config)
    except Exception as exc:
        print(f"elasticd: the check failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print(f"elasticd {__version__}", flush=True)
    return 0


async def preflight(environ: Mapping[str, str]) -> tuple[str | None, str | None]:
    """Run the installed daemon with ``--check``: (its version, None), or (None, why not)."""
    argv = [sys.executable, *sys.orig_argv[1:], "--check"]
    try:
        proc = await start_process(
            argv,
            environ,
            identity=None,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
    except WorkerSpawnError as exc:
        return None, f"the new program could not be started: {exc}"
    try:
        async with asyncio.timeout(PREFLIGHT_TIMEOUT):
            out, _ = await proc.communicate()
    except TimeoutError:
        return None, f"the new program's check did not finish in {PREFLIGHT_TIMEOUT:.0f} s"
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            await asyncio.shield(proc.wait())
    text = out.decode(errors="replace").strip()
    if proc.returncode != 0:
        last = text.splitlines()[-1] if text else "no output"
        return None, f"the new program's check failed (exit {proc.returncode}): {last}"
    lines = [line for line in text.splitlines() if line.startswith("elasticd ")]
    return (lines[-1].split(" ", 1)[1].strip() if lines else "unknown"), None


def exec_self(manifest: Manifest) -> NoReturn:
    """Replace this program image with the installed one, same pid, handing ``manifest`` over.

    Raises ``OSError`` when the exec itself fails (this image then runs on).
    """
    fd = os.memfd_create("elasticd-handover", 0)  # inheritable: the new image reads it
    try:
        os.write(fd, manifest.encode())
        env = dict(os.environ)
        env[ENV_FD] = str(fd)
        for handed in manifest.fds:
            os.set_inheritable(handed, True)
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, sys.orig_argv, env)
    finally:
        os.close(fd)


async def reap_swept(pids: list[int]) -> None:
    """Reap the swept workers that were this process's own children (handed over by the
    previous image but not taken up): killed by the sweep, they would stay zombies."""
    ours = []
    for pid in pids:
        with contextlib.suppress(ChildProcessError):
            os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)  # noqa: ASYNC222 - WNOHANG
            ours.append(AdoptedProcess(pid))
    await asyncio.gather(*(child.wait() for child in ours))
