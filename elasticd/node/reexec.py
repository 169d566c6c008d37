"""The in-place upgrade: the daemon re-executes itself with the same pid (issue 25).

``SIGHUP`` (``systemctl reload elasticd``: ``ExecReload=/bin/kill -HUP
$MAINPID``) or an admin's ``POST /reload`` (``elasticd reload``) asks for
it. In order:

1. **Pre-flight** (:func:`preflight`): the installed program is run with the
   daemon's own command line and ``--check``: it imports everything the
   daemon would, validates the configuration, reads its secrets, and proves it
   can start where it will run (:func:`check_state`: each database opens
   read-write, the state disk takes :data:`FIRST_WRITES`), then prints its
   version. If that fails the daemon stays as it is, and says why in the log
   and in a ``daemon.reexec_refused`` event on each job it runs.
2. **Quiesce** (:meth:`Daemon.reexec <elasticd.node.daemon.Daemon.reexec>`):
   ``/readyz`` says "re-executing" and no new job is taken; every agent
   half-way through a start or a restart gets up to :data:`HANDOVER_WAIT`
   to have its workers running and watched (:func:`~elasticd.agent.handover.not_ready`,
   polled), so that its job is handed over rather than resumed as a new
   attempt; past it the exec goes on, and those jobs take the fallback (the
   ``daemon.reexec`` event names them); a stop asked for meanwhile wins (no
   exec, the daemon stops). The node's lease is renewed (a full TTL
   for the new image to take it up); the HTTP server stops accepting and
   drains briefly, its listening sockets kept (connections that arrive
   meanwhile wait in the kernel's backlog for the new image: none is
   refused); the loop runs until no worker exit is half-delivered.
3. **Hand-over** (:class:`Manifest`, JSON, never pickle): with no await
   between it and the ``exec``, each agent that is watching its running
   workers hands over its attempt (:mod:`elasticd.agent.handover`); each
   other agent went on through the quiesce, and the failure it saw (or its
   workers met) and has not recorded yet is carried
   (:class:`~elasticd.agent.handover.CarriedFailure`): the new image records
   it before the job resumes, so that it is charged once, wherever the exec
   cut the agent off; the
   descriptors named in the manifest (listening sockets, pipes, log files,
   heartbeats) are inheritable copies, every other descriptor closes at the
   ``exec``. The manifest travels in a memfd whose number is in
   ``ELASTICD_REEXEC_FD``: it never touches the disk (it names the job
   tokens' hashes).
4. **exec** of the same interpreter with the same command line: same pid,
   so the workers stay its children; no parent-death signal fires; nothing
   is signalled.

Nothing is left unguarded from the point of no return (after the quiesce) until
the new image has taken everything back (:mod:`elasticd.node.execwindow`, issue
34): SIGHUP, SIGTERM and SIGINT are held (blocked across the exec, delivered to
the new image's handlers: a reload coalesces, a stop is the normal stop once the
handed jobs are taken up); the state-folder lock's descriptor is handed over
(``Manifest.lock_fd``) and adopted; the lease is renewed as the last await before
the exec and then by the new image from before its heavy imports. A new image that
cannot start exits 1 (systemd restarts it), never 2. Each new image logs the window
it saw (``re-exec window: ...``).

The new image (:func:`take_manifest` at start-up) keeps the listening
sockets, waits for the store if it does not answer (``/healthz`` answers
meanwhile), takes up the node's lease and the job tokens, leaves the handed
workers out of the orphan sweep, and re-adopts each job whose workers pass
:func:`~elasticd.supervise.adopt.check_worker` (``job.readopted``; ``/readyz``
is not ready until every handed job is taken up). A job that was not handed
over, or whose workers fail the check, has them killed by the orphan sweep
and resumes as a new attempt with no restart charged (``job.resumed`` says
why), as after a crash; a failure of its carried over is recorded first
(:attr:`Manifest.failures`), charged at its next round.

The store may be away at the exec (its host died while this node waited to
re-execute). The handed workers then run unwatched until the new image takes
them up, which needs the store; they must not outlive the node's lease,
since the other nodes count the node as gone once it may have lapsed (and
re-form without it). So the manifest carries when the last renewal that got
through was sent (:attr:`Manifest.renewed_at`, on ``CLOCK_MONOTONIC``, which
the exec keeps); if the store still has not answered when the lease may lapse
(:func:`fence_at`), the new image fences: it ends the handed workers (as the
agents would have: ``agent.fenced``) and their jobs resume as new attempts,
uncharged, once the store is back (:meth:`ReexecMixin._wait_for_store_fenced`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import uvicorn

from elasticd import __version__
from elasticd.agent.handover import AgentHandover, CarriedFailure
from elasticd.clock import Clock
from elasticd.config import Config, read_cluster_token, read_store_password, read_token
from elasticd.errors import ConfigError, StoreError, WorkerSpawnError
from elasticd.eventkinds import EventKind
from elasticd.identity import Authenticator
from elasticd.node.cluster import Cluster
from elasticd.node.events import EventLog
from elasticd.node.execwindow import ENV_SIGNALS_FD, HeldSignals, LeaseKeeper, linger_delay
from elasticd.node.jobs import JobService
from elasticd.node.lighthouses import NodeLighthouses
from elasticd.node.statelock import StateLock
from elasticd.security import refuse_foreign_state, resolve_job_users
from elasticd.store import Store
from elasticd.supervise.adopt import (
    check_worker,
    close_fds,
    end_handed,
    inheritable_dup,
    inherited_to_end,
)
from elasticd.supervise.spawn import live_children, start_process
from elasticd.supervise.sweep import own_children, process_start_time, start_time_of

__all__ = [
    "ADOPT_DEADLINE",
    "ENV_FD",
    "HANDOVER_WAIT",
    "REEXEC_DRAIN",
    "ReexecMixin",
    "inherited_socket",
    "PREFLIGHT_TIMEOUT",
    "Manifest",
    "exec_self",
    "fence_at",
    "preflight",
    "take_manifest",
]

log = logging.getLogger("elasticd.node.reexec")

#: The environment variable that names the hand-over manifest's descriptor in the new image.
ENV_FD = "ELASTICD_REEXEC_FD"
#: Seconds the pre-flight check may take (imports on a loaded node are slow).
PREFLIGHT_TIMEOUT = 60.0
#: Seconds requests under way get before a re-exec (what still runs then is cut off).
REEXEC_DRAIN = 0.5
#: Seconds a re-exec waits, at most, for each agent mid-start or mid-restart to be watching its
#: running workers (ready to hand them over); past it the exec goes on, and those jobs resume
#: in the next image as new attempts (uncharged, their workers restarted).
HANDOVER_WAIT = 10.0
#: Seconds between two looks at the agents while the re-exec waits for them.
HANDOVER_POLL = 0.05
#: Seconds a handed-over job waits to be taken up (the plan places it here) before its
#: workers are ended (it ended meanwhile, or the fleet moved it).
ADOPT_DEADLINE = 30.0
#: Seconds a stop asked for as the new image starts waits, at most, for it to take its handed
#: jobs up (then stopped as any job: SIGTERM, the grace, ``daemon.stopped``).
STOP_ADOPT_WAIT = 10.0
#: The daemon's own database in its state folder (events, the spawn registry).
DATABASE_FILE = "elasticd.sqlite3"
#: The manifest's format; a new image that does not know it starts afresh (jobs resume).
FORMAT = 1


@dataclass
class Manifest:
    """What one program image of the daemon hands to the next (JSON)."""

    old_version: str
    tcp_fd: int | None = None
    unix_fd: int | None = None
    #: The state folder's locked descriptor (the new image adopts it: the folder is never free).
    lock_fd: int | None = None
    lease: int | None = None
    #: When the last renewal of ``lease`` that got through was sent (``CLOCK_MONOTONIC``,
    #: which the exec keeps): the lease lives at least ``lease_ttl`` from then.
    renewed_at: float | None = None
    #: When the old image exec'd (``CLOCK_MONOTONIC``): the start of the window it measures.
    exec_at: float | None = None
    agents: list[AgentHandover] = field(default_factory=list)
    #: Jobs this node ran that were not handed over, and why (they resume as new attempts).
    not_handed: dict[str, str] = field(default_factory=dict)
    #: Of those, the failures their agents saw and had not recorded yet: recorded by the
    #: new image before they resume, so that each is charged once (nothing is lost).
    failures: dict[str, CarriedFailure] = field(default_factory=dict)
    #: Each job's token hash on this node (its workers keep the token they read).
    job_tokens: dict[str, str] = field(default_factory=dict)
    #: Each torchft Lighthouse's port (job id: port): the new image serves it there again.
    lighthouses: dict[str, int] = field(default_factory=dict)
    #: (pid, start time) of what the old image started and did not hand over (a health
    #: check, a standby being stopped, a worker of a job not handed): nobody reads its end.
    unhanded: list[tuple[int, int]] = field(default_factory=list)
    #: Filled in by the new image: handed jobs whose workers failed the check, and why.
    refused: dict[str, str] = field(default_factory=dict)
    #: Filled in by the new image at its start: its children (pid: start time), all the
    #: old image's (see :meth:`inherited_to_end`).
    children: dict[int, int | None] = field(default_factory=dict)

    def encode(self) -> bytes:
        return json.dumps(
            {
                "format": FORMAT,
                "old_version": self.old_version,
                "tcp_fd": self.tcp_fd,
                "unix_fd": self.unix_fd,
                "lock_fd": self.lock_fd,
                "lease": self.lease,
                "renewed_at": self.renewed_at,
                "exec_at": self.exec_at,
                "agents": [a.to_json() for a in self.agents],
                "not_handed": self.not_handed,
                "failures": {job: f.to_json() for job, f in self.failures.items()},
                "job_tokens": self.job_tokens,
                "unhanded": [list(pair) for pair in self.unhanded],
                "lighthouses": self.lighthouses,
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
            lock_fd=_int_or_none(doc.get("lock_fd")),
            lease=_int_or_none(doc.get("lease")),
            renewed_at=None if doc.get("renewed_at") is None else float(doc["renewed_at"]),
            exec_at=None if doc.get("exec_at") is None else float(doc["exec_at"]),
            agents=[AgentHandover.from_json(a) for a in doc.get("agents", [])],
            not_handed={str(k): str(v) for k, v in doc.get("not_handed", {}).items()},
            failures={
                str(k): CarriedFailure.from_json(v) for k, v in doc.get("failures", {}).items()
            },
            job_tokens={str(k): str(v) for k, v in doc.get("job_tokens", {}).items()},
            unhanded=[(int(pid), int(start)) for pid, start in doc.get("unhanded", [])],
            lighthouses={str(k): int(v) for k, v in doc.get("lighthouses", {}).items()},
        )

    @property
    def fds(self) -> list[int]:
        listeners = [fd for fd in (self.tcp_fd, self.unix_fd) if fd is not None]
        lock = [] if self.lock_fd is None else [self.lock_fd]
        return listeners + lock + [fd for a in self.agents for fd in a.fds]

    def adopted_pids(self) -> set[tuple[int, int]]:
        """(pid, start time) of every worker handed over and found fit (the sweep spares them)."""
        return {(w.pid, w.start_time) for a in self.agents for w in a.workers}

    def inherited_to_end(self) -> tuple[set[int], set[int]]:
        """The children the old image left that this one does not supervise: ``(kill,
        reap)`` (:func:`~elasticd.supervise.adopt.inherited_to_end`); after :meth:`check`."""
        return inherited_to_end(self.children, self.adopted_pids(), self.unhanded)

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

    async def fence(self, reason: str) -> None:
        """End every handed worker (nobody takes them up: see :func:`fence_at`); their jobs go
        to :attr:`refused` with ``reason`` (they resume as new attempts)."""
        fenced, self.agents = self.agents, []
        for agent in fenced:
            self.refused[agent.job_id] = reason
        await end_handed([w for a in fenced for w in a.workers])
        for worker in (w for a in fenced for w in a.workers):
            self.children.pop(worker.pid, None)  # reaped: not the sweep's any more


def fence_at(renewed_at: float | None, lease_ttl: float, now: float) -> float:
    """The monotonic time from which the node's lease may have lapsed, its last renewal that
    got through sent at ``renewed_at``: handed workers must not run past it unwatched, the
    other nodes count the node as gone from then. None: an image that did not say (before
    ``renewed_at`` was handed over), which renewed right before its exec: ``now`` + the TTL."""
    return (now if renewed_at is None else renewed_at) + lease_ttl


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
    # Before this image starts anything: every child now is the old image's.
    children = {pid: start_time_of(pid) for pid in own_children()}
    try:
        fd = int(value)
        with os.fdopen(fd, "rb") as f:
            f.seek(0)
            manifest = Manifest.decode(f.read())
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.error(
            "the hand-over of the previous program image is unreadable (%s); "
            "starting afresh: its jobs resume as new attempts",
            exc,
        )
        return None
    manifest.children = children
    return manifest


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


#: What this image takes over from the one before it across an exec, beyond the manifest's
#: jobs (issue 34), as ``--check`` announces it: an image that does not say it adopts one is
#: not handed it (a downgrade to an image from before issue 34 would keep HUP, TERM and INT
#: blocked for good, and find its own state folder locked by the descriptor handed to it).
ADOPTS = ("held_signals", "lock_fd")
#: The line of ``--check``'s output that says what it adopts (an older image's has none,
#: and an older parent reads only the ``elasticd <version>`` line).
ADOPTS_PREFIX = "elasticd-adopts:"


@dataclass(frozen=True)
class Preflight:
    """What the installed program's ``--check`` said of itself."""

    version: str
    adopts: frozenset[str] = frozenset()

    @classmethod
    def parse(cls, text: str) -> Preflight:
        """From ``--check``'s output (an older image's: its version, adopting nothing)."""
        version, adopts = "unknown", frozenset[str]()
        for line in text.splitlines():
            if line.startswith("elasticd "):
                version = line.split(" ", 1)[1].strip() or version
            elif line.startswith(ADOPTS_PREFIX):
                words = line.removeprefix(ADOPTS_PREFIX).split(",")
                adopts = frozenset(w.strip() for w in words if w.strip())
        return cls(version, adopts)


#: What a new image that does not adopt a thing gets instead (logged at the exec).
_NOT_ADOPTED = {
    "held_signals": "a reload asked for across the exec is ignored, a stop kills it outright",
    "lock_fd": "the state folder is unlocked until it has started",
}


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
        # The secrets the daemon reads at its start: there, readable, private.
        read_token(config)
        read_cluster_token(config)
        read_store_password(config)
        # What the start refuses first (issue 35): the new image must not meet it after the exec.
        refuse_foreign_state(config.state_dir, {"log_dir": config.logs})
        unfit = check_state(config)
    except Exception as exc:
        print(f"elasticd: the check failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    if unfit is not None:
        print(f"elasticd: the check failed: {unfit}", file=sys.stderr)
        return 2
    print(f"{ADOPTS_PREFIX} {','.join(ADOPTS)}")
    print(f"elasticd {__version__}", flush=True)
    return 0


#: Bytes the pre-flight writes (then removes) in the state folder: room for the new image's
#: first writes (its databases' journals and the events of the hand-over), proved, not guessed.
FIRST_WRITES = 1 << 20


def check_state(config: Config) -> str | None:
    """Whether a new image can start on ``config``'s state folder (``--check``): each of its
    databases that exists opens read-write and takes a write lock; the folder's disk takes
    :data:`FIRST_WRITES` bytes. None, or why not (issue 34: a new image that met a full disk
    at its start exited 2, and every worker died with it)."""
    import sqlite3

    from elasticd.store import STORE_FILE

    state = config.state_dir
    names = [DATABASE_FILE] if config.store_url is not None else [DATABASE_FILE, STORE_FILE]
    for path in (state / name for name in names):
        if not path.exists():
            continue  # made by the start, as on a first start
        try:
            db = sqlite3.connect(f"file:{path}?mode=rw", uri=True, timeout=5)
            try:
                db.execute("BEGIN IMMEDIATE")
                db.execute("ROLLBACK")
            finally:
                db.close()
        except sqlite3.Error as exc:
            return f"{path} does not open read-write: {exc}"
    probe = state / f".reexec-check.{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            chunk, left = b"\0" * 65536, FIRST_WRITES
            while left > 0:
                left -= os.write(fd, chunk[:left])
            os.fsync(fd)
        finally:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(probe)
    except OSError as exc:
        return (
            f"the state folder {state} has no room for the new image's first writes "
            f"({FIRST_WRITES >> 10} KiB): {exc.strerror or exc}"
        )
    return None


async def preflight(environ: Mapping[str, str]) -> tuple[Preflight | None, str | None]:
    """Run the installed daemon with ``--check``: (what it said, None), or (None, why not)."""
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
    return Preflight.parse(text), None


def exec_self(manifest: Manifest, held: HeldSignals, asked: Iterable[int] = ()) -> NoReturn:
    """Replace this program image with the installed one, same pid, handing ``manifest`` over.

    ``held``: the signals held since the point of no return; each one noted, and ``asked``
    (what the daemon was asked meanwhile: a stop, a reload), is pending at the exec, for
    the new image. Raises ``OSError`` when the exec itself fails (this image then runs on;
    the caller releases ``held``).
    """
    fd = os.memfd_create("elasticd-handover", 0)  # inheritable: the new image reads it
    try:
        manifest.exec_at = time.monotonic()
        os.write(fd, manifest.encode())
        env = dict(os.environ)
        env[ENV_FD] = str(fd)
        for handed in manifest.fds:
            os.set_inheritable(handed, True)
        sys.stdout.flush()
        sys.stderr.flush()
        carried = held.carry()
        if carried is not None:
            env[ENV_SIGNALS_FD] = str(carried)
        held.pend(asked)
        os.execve(sys.executable, sys.orig_argv, env)
    finally:
        os.close(fd)


def inherited_socket(fd: int) -> socket.socket:
    """A listening socket that came through the exec (re-exec): closed at the next one."""
    sock = socket.socket(fileno=fd)
    sock.set_inheritable(False)
    sock.setblocking(False)
    return sock


class ReexecMixin:
    """The daemon's side of the re-exec (:class:`elasticd.node.daemon.Daemon` mixes it in):
    the request, the pre-flight, the quiesce, the hand-over and the exec; and, in the new
    image, what it says and the deadline of the adoptions."""

    config: Config
    clock: Clock
    pid: int
    events: EventLog
    jobs: JobService
    store: Store
    cluster: Cluster
    authenticator: Authenticator
    closing_streams: asyncio.Event
    can_reexec: bool
    _environ: dict[str, str]
    _reload: asyncio.Event
    _stop: asyncio.Event
    _reexecing: bool
    _server: uvicorn.Server | None
    _server_task: asyncio.Task[None] | None
    _listeners: list[socket.socket]
    _handover: Manifest | None
    _state_lock: StateLock | None
    _lease_keeper: LeaseKeeper | None
    lighthouses: NodeLighthouses
    handlers_at: float | None
    stop_signal: signal.Signals | None

    def _reexec_possible(self) -> bool:
        raise NotImplementedError

    def request_reload(self) -> None:
        """Ask for a re-exec in place (what SIGHUP and ``POST /reload`` do)."""
        self._reload.set()

    def _said_reexec(self, manifest: Manifest) -> None:
        """``daemon.reexec`` on every job this node ran through the re-exec; on a job that
        was not carried over, why (it resumes as a new attempt)."""
        message = (
            f"the daemon on {self.config.node_name} re-executed itself in place (pid "
            f"{self.pid}): elasticd {manifest.old_version} -> {__version__}"
        )
        fallback = {**manifest.not_handed, **manifest.refused}
        log.info(
            "%s; resumed as new attempts: %s",
            message,
            ", ".join(f"{job} ({why})" for job, why in fallback.items()) or "none",
        )
        for job_id in dict.fromkeys([*(a.job_id for a in manifest.agents), *fallback]):
            why = fallback.get(job_id)
            said = message if why is None else f"{message}; the job was not carried over ({why})"
            agent = self.jobs.supervisor.agents.get(job_id)  # the one that took it up
            tag = agent.job_tag if agent is not None else None
            self.events.emit(job_id, "daemon", EventKind.DAEMON_REEXEC, said, job_tag=tag)

    def _lock_state_dir(self) -> StateLock:
        """The state folder's lock: the one the previous image handed over (re-exec: it was
        never free), else taken now (a second daemon is refused: ``ConfigError``)."""
        manifest = self._handover
        if manifest is not None and manifest.lock_fd is not None:
            try:
                return StateLock.adopt(self.config.state_dir, manifest.lock_fd)
            except ConfigError as exc:
                log.warning("%s; locking the folder afresh", exc)
            finally:
                manifest.lock_fd = None
        return StateLock(self.config.state_dir).acquire()

    def _log_window(self, manifest: Manifest) -> None:
        """The window this re-exec left (all of it ``CLOCK_MONOTONIC``, which the exec keeps):
        from the exec to this image's signal handlers, to its first renewal of the lease, and
        until it has taken everything back (ready)."""
        if manifest.exec_at is None:
            return
        keeper = self._lease_keeper

        def since(at: float | None) -> str:
            exec_at = manifest.exec_at
            return "-" if at is None or exec_at is None else f"{at - exec_at:.2f} s"

        log.info(
            "re-exec window: signals handled after %s, the lease renewed after %s (%d "
            "renewals before the node's keep-alive), everything taken back after %s "
            "(lease TTL %.1f s)",
            since(self.handlers_at),
            since(keeper.first_renewal if keeper is not None else None),
            keeper.renewals if keeper is not None else 0,
            since(time.monotonic()),
            self.config.lease_ttl,
        )

    async def _take_up_before_the_stop(self) -> None:
        """A stop asked for while this image takes its handed jobs up (a SIGTERM held across
        the exec): each is taken up first (up to :data:`STOP_ADOPT_WAIT`), so that the stop
        is the normal one for it too (SIGTERM to its workers, the grace, ``daemon.stopped``);
        what is still not taken up then is ended (SIGKILL)."""
        if self._handover is None or not self._reexec_possible():
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + STOP_ADOPT_WAIT
        while self.jobs.adopting and loop.time() < deadline:
            await asyncio.sleep(HANDOVER_POLL)
        await self._end_abandoned(STOP_ADOPT_WAIT, "before the stop")

    async def _adoption_deadline(self) -> None:
        """Handed-over attempts that no agent took up in time: their workers end."""
        await asyncio.sleep(ADOPT_DEADLINE)
        await self._end_abandoned(ADOPT_DEADLINE, "(the job ended or moved)")

    async def _end_abandoned(self, waited: float, why: str) -> None:
        """End the workers of every handed-over attempt no agent took up in ``waited`` s."""
        for handover in self.jobs.abandon_adoptions():
            log.warning(
                "job %s: its handed-over workers were not taken up in %.0f s %s; ending them",
                handover.job_id,
                waited,
                why,
            )
            await end_handed(handover.workers)

    async def _wait_for_store_fenced(self, wait: Callable[[], Awaitable[bool]]) -> bool:
        """The new image's wait for the store (``wait``: until it answers; False if a stop
        came first), during which the handed workers run unwatched: if it still waits when
        the node's lease may lapse (:func:`fence_at`), they are ended first (fenced)."""
        manifest = self._handover
        if manifest is None or not manifest.agents or self.config.store_url is None:
            return await wait()  # none handed, or the store is this daemon's: no lease lapses
        now = self.clock.monotonic()
        renewed = manifest.renewed_at
        keeper = self._lease_keeper
        if keeper is not None and keeper.renewed_at is not None:  # renewed since the exec
            renewed = max(renewed or keeper.renewed_at, keeper.renewed_at)
        lapse = fence_at(renewed, self.config.lease_ttl, now)
        try:
            async with asyncio.timeout(lapse - now) as bound:
                return await wait()
        except TimeoutError:
            if not bound.expired():
                raise
        jobs = ", ".join(a.job_id for a in manifest.agents)
        log.warning(
            "the store did not answer for the lease TTL (%.0f s) across the re-exec: "
            "ending the handed workers of %s (fenced; they resume as new attempts)",
            self.config.lease_ttl,
            jobs,
        )
        await manifest.fence(
            f"the store was out of reach for the lease TTL ({self.config.lease_ttl:.0f} s) "
            "across the re-exec: its workers were stopped (fenced), the other nodes count "
            "this one as gone"
        )
        return await wait()

    async def reexec(self) -> None:
        """Re-execute the installed program in place (see :mod:`elasticd.node.reexec`).

        Returns only when refused: the pre-flight check failed (or the exec
        itself); the daemon then runs on as it was, and says why in the log and
        in a ``daemon.reexec_refused`` event on each job it runs. Or when a stop
        was asked for while it waited for the agents: the daemon then stops.
        """
        if not self._reexec_possible():
            return
        if not self.can_reexec:
            self._refuse_reexec("only a daemon started by `elasticd serve` re-executes itself")
            return
        log.info("reload asked: checking the new program before re-executing")
        new, reason = await preflight(self._environ)
        if new is None:
            self._refuse_reexec(reason or "the new program's check failed")
            return
        log.info("re-executing in place: elasticd %s -> %s", __version__, new.version)
        for what in sorted(set(ADOPTS) - new.adopts):
            log.warning(
                "re-exec: the new program (elasticd %s) does not adopt %s: %s",
                new.version,
                what,
                _NOT_ADOPTED[what],
            )
        self._reexecing = True
        accepting, self.jobs.reconciler.accepting = self.jobs.accepting, False
        unready = await self._await_handover()
        if self._stop.is_set():  # a stop asked for meanwhile wins: no exec, the daemon stops
            self._reexecing = False
            log.info("re-exec abandoned: the daemon is asked to stop")
            return
        # The point of no return: from here until the new image has its handlers, SIGHUP,
        # SIGTERM and SIGINT wait (a stop asked for now is the new image's to carry out).
        held = HeldSignals() if "held_signals" in new.adopts else HeldSignals.ignoring_reloads()
        held.hold()
        try:
            await self._exec(unready, accepting, held, hand_lock="lock_fd" in new.adopts)
        finally:
            held.release()  # reached only where the exec did not happen

    def _asked_meanwhile(self) -> list[int]:
        """What a signal asked of this image since the point of no return (its loop took
        it): the new image is asked again (a reload coalesces into one more)."""
        asked: list[int] = []
        if self._stop.is_set():
            asked.append(self.stop_signal or signal.SIGTERM)
        if self._reload.is_set():
            asked.append(signal.SIGHUP)
        return asked

    async def _exec(
        self, unready: dict[str, str], accepting: bool, held: HeldSignals, *, hand_lock: bool
    ) -> None:
        """The re-exec past the point of no return; returns only where the exec failed.
        ``hand_lock``: the new image adopts the state folder's lock (else it takes it anew)."""
        await self._record_failures(unready)
        if linger := linger_delay(self._environ):  # a test's slow quiesce
            await asyncio.sleep(linger)
        listeners = await self._drain_http()
        # Standbys (prewarm) are not handed over: killed now, the new image starts new ones.
        await self.jobs.close_standbys()
        # torchft's Managers keep their Lighthouse's address: the new image serves each on
        # its port again (its record and leadership stay on the node's lease meanwhile).
        lighthouses = await self.lighthouses.pause()
        # The last await that takes time: the new image has a whole TTL from here to renew
        # the lease.
        await self._renew_lease()
        # No exit half-delivered (reaped, its callback not run: its status nowhere but
        # there): each is with its worker, or still a zombie (read at the hand-over, left for
        # the next image). Last, after the renewal: an exit reaped during it is delivered too.
        for _ in range(1000):
            if not self.jobs.pending_exit():
                break
            await asyncio.sleep(0)
        # From here to the exec nothing awaits: the hand-over is what the exec carries.
        handed, not_handed = self.jobs.hand_over()
        # What the agents not handed over are in the middle of: a failure they saw (or their
        # workers met) and have not recorded yet, the exec would lose (the record above was
        # made before the last awaits, during which they went on); the new image records it.
        failures = self.jobs.carried_failures(not_handed)
        workers = {w.pid for a in handed for w in a.workers}
        unhanded = [
            (pid, start)
            for pid in sorted(live_children() - workers)
            if (start := process_start_time(pid)) is not None
        ]
        for job_id in set(not_handed) & set(unready):
            not_handed[job_id] += f", still after {HANDOVER_WAIT:.0f} s of waiting"
        manifest = Manifest(
            old_version=__version__,
            tcp_fd=listeners[0] if listeners else None,
            unix_fd=listeners[1] if len(listeners) > 1 else None,
            lock_fd=(
                inheritable_dup(self._state_lock.fileno())
                if hand_lock and self._state_lock is not None and self._state_lock.held
                else None
            ),
            lease=None if self.config.store_only else self.cluster.lease_id,
            renewed_at=None if self.config.store_only else self.cluster.renewed_at,
            agents=handed,
            not_handed=not_handed,
            failures=failures,
            job_tokens=self.authenticator.jobs.digests(),
            unhanded=unhanded,
            lighthouses=lighthouses,
        )
        log.info(
            "re-exec: handing over %d job(s), exec'ing now (signals held until the new image "
            "has its handlers)",
            len(handed),
        )
        if not held.blocking and self._stop.is_set():
            # Nothing is held for an older image: a stop asked for now would be lost with
            # this image's handler. The stop wins: no exec, the daemon stops as asked.
            await self._undo_exec(manifest, listeners, accepting)
            log.info("re-exec abandoned: the daemon is asked to stop")
            return
        try:
            exec_self(manifest, held, self._asked_meanwhile())
        except OSError as exc:
            await self._undo_exec(manifest, listeners, accepting)
            self._refuse_reexec(f"the exec failed: {exc}")

    async def _undo_exec(self, manifest: Manifest, listeners: list[int], accepting: bool) -> None:
        """The exec did not happen: this image runs on as it was (serving, placing)."""
        for fd in manifest.fds[len(listeners) :]:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._reexecing = False
        self.jobs.reconciler.accepting = accepting
        await self._restart_http(listeners)
        await self.lighthouses.serve_again(manifest.lighthouses)

    async def _await_handover(self) -> dict[str, str]:
        """Wait up to :data:`HANDOVER_WAIT` for every agent to be ready to hand its attempt
        over (looked at every :data:`HANDOVER_POLL`), or until a stop is asked for; the jobs
        still not ready, and why."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + HANDOVER_WAIT
        while (unready := self.jobs.not_ready()) and loop.time() < deadline:
            if self._stop.is_set():
                break
            await asyncio.sleep(HANDOVER_POLL)
        if unready:
            log.warning(
                "re-exec: not ready to be handed over after %.0f s: %s",
                HANDOVER_WAIT,
                ", ".join(f"{job} ({why})" for job, why in unready.items()),
            )
        return unready

    async def _record_failures(self, unready: Mapping[str, str]) -> None:
        """Jobs not ready past the wait resume as new attempts in the next image; a failure
        their agent saw and has not recorded yet (it still stops the survivors) is recorded
        now, so that it is charged there and not lost. Bounded as a lease renewal is."""
        with contextlib.suppress(StoreError, TimeoutError):
            async with asyncio.timeout(self.config.lease_ttl / 3):
                await self.jobs.record_failures(unready)

    def _refuse_reexec(self, reason: str) -> None:
        log.error("re-exec refused: %s; running on as elasticd %s", reason, __version__)
        for job_id, agent in list(self.jobs.supervisor.agents.items()):
            self.events.emit(
                job_id,
                "daemon",
                EventKind.DAEMON_REEXEC_REFUSED,
                f"the daemon on {self.config.node_name} did not re-execute itself: {reason}; "
                f"it runs on as elasticd {__version__}",
                job_tag=agent.job_tag,
            )

    async def _renew_lease(self) -> None:
        """A renewal right before the exec: the new image has a whole TTL to take it up."""
        if self.config.store_only:
            return
        with contextlib.suppress(StoreError, TimeoutError):
            async with asyncio.timeout(self.config.lease_ttl / 3):
                await self.cluster.renew()

    async def _drain_http(self) -> list[int]:
        """Stop taking connections but keep listening: inheritable copies of the listening
        sockets (what connects meanwhile waits in their backlog for the new image).
        Requests under way get :data:`REEXEC_DRAIN` to finish; what still runs then (a
        long-poll) is cut off by the exec, and its client asks again."""
        if self._server is None or self._server_task is None:
            return []
        listeners = [inheritable_dup(sock.fileno()) for sock in self._listeners]
        for server in getattr(self._server, "servers", []):
            server.close()  # the loop stops accepting; the copies keep the sockets open
        self.closing_streams.set()  # streams (SSE, log follow) end now
        loop = asyncio.get_running_loop()
        deadline = loop.time() + REEXEC_DRAIN
        while self._server.server_state.tasks and loop.time() < deadline:
            await asyncio.sleep(0.01)
        return listeners

    async def _restart_http(self, listeners: list[int]) -> None:
        """Serve again on the kept sockets (the exec failed)."""
        if self._server is None or self._server_task is None or not listeners:
            return
        self._server.should_exit = True
        with contextlib.suppress(Exception):
            await self._server_task
        self.closing_streams = asyncio.Event()
        sockets = [inherited_socket(fd) for fd in listeners]
        self._listeners = sockets
        self._server = type(self._server)(self._server.config)
        self._server_task = asyncio.create_task(self._server.serve(sockets), name="http")
