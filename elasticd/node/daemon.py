"""The daemon: composition root that owns the loop's signals, tasks and shutdown order.

Start-up: check the settings (the token file, the bind address, the store's
security: :func:`elasticd.config.check_store`) before anything connects,
lock the state folder (:mod:`elasticd.node.statelock`: one daemon per folder,
a second one exits 2 naming the holder's pid), open the database (a damaged
one is refused, or set aside: ``on_corrupt_database``), open the store, start the HTTP server inside
this event loop (it binds first: the port is part of this node's record;
``/readyz`` says "starting" until the end), wait until the store answers
(the nodes of a cluster start in any order: retried with backoff, logged
once, ``/readyz`` says what is awaited; a store that refuses this daemon's
credentials is a configuration error, raised at once), kill the workers a
previous run left behind (:func:`elasticd.supervise.sweep.sweep_orphans`, then
the attempt cgroups left in the daemon's subtree: :mod:`elasticd.supervise.cgroup`),
recover the jobs a previous run left active (never lose them), register in
the cluster, tell systemd ``READY=1``, and ping its watchdog when the unit
has one.

A full or failing local disk (state or logs) never stops the daemon: the
writers keep what they could not write and retry (:mod:`elasticd.storage`),
``/readyz`` turns 503 with "storage degraded since T: ..." while
``/healthz`` stays 200 (the process is alive), new jobs are refused with
507, and everything resumes by itself once the disk takes writes again.

Each start-up step pushes its undo onto an ``AsyncExitStack``: a start that
fails half-way releases what it had acquired, in reverse order, and leaves
the daemon ``CLOSED`` (:class:`DaemonState`: ``NEW → STARTING → RUNNING →
STOPPING → CLOSED``, forward only). The spawn policy (who jobs run as, the
spawn registry, the containment) is built here and handed to the job
service, which gives it to each agent: nothing about spawning is process-wide.

Shutdown (SIGTERM or SIGINT), in a fixed order, each step bounded:
stop accepting jobs → stop agents (each stops its workers: SIGTERM to the
process group, the job's grace, SIGKILL, awaited; each leaves its
rendezvous) → events are already on disk, checkpoint the database → publish
the queued events to the store → then the start-up's undo stack:
stop the retention and watchdog tasks, leave the cluster (revoke the node's
lease, so peers see it gone at once), release the cgroup subtree, stop the
HTTP server, close the store, close the database. Once the workers are
stopped, what follows shares ``shutdown_timeout``: each step (the events'
publication, the lease's revocation, the HTTP drain) gets what is left of it,
at least 1 s (:func:`step_bound`).

Signal handlers only set an event; uvicorn's own handlers are switched off.

Re-exec (SIGHUP, or an admin's ``POST /reload``): the daemon re-executes the
installed program in place, same pid, after a pre-flight check; the workers
run on and the new image takes them up (:mod:`elasticd.node.reexec`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import logging
import math
import os
import pwd
import signal
import socket
import stat
import time
from collections.abc import Generator
from pathlib import Path
from types import TracebackType
from typing import Self

import uvicorn

from elasticd import __version__, keys
from elasticd.agent.agent import ConsoleSink
from elasticd.clock import SYSTEM_CLOCK, Clock
from elasticd.config import (
    Config,
    check_store,
    own_token,
    read_cluster_token,
    read_store_password,
    read_token,
)
from elasticd.errors import (
    ConfigError,
    ElasticdError,
    StoreAuthError,
    StoreError,
    StoreUnavailable,
)
from elasticd.eventkinds import EventKind
from elasticd.identity import Authenticator, IdentityTable
from elasticd.models import Job, incarnation_tag
from elasticd.node import systemd
from elasticd.node.cluster import MAX_NODE_SLOTS, Cluster, NodeRecord
from elasticd.node.db import Database
from elasticd.node.events import EventLog, EventRetention
from elasticd.node.execwindow import LeaseKeeper, configured_store
from elasticd.node.host import bind_socket, detect_gpus, raise_nofile_limit
from elasticd.node.jobs import JobService
from elasticd.node.lighthouses import NodeLighthouses
from elasticd.node.looplag import LoopLag
from elasticd.node.metrics import PAGE_MAX_AGE, Metrics, node_series
from elasticd.node.quarantine import node_health
from elasticd.node.reexec import DATABASE_FILE, Manifest, ReexecMixin, inherited_socket
from elasticd.node.scheduler import FleetScheduler
from elasticd.node.slurm_drain import SlurmDrain
from elasticd.node.statelock import StateLock
from elasticd.sched.plan import FleetPlan
from elasticd.security import (
    UNIX_PATH_MAX,
    bind_unix_socket,
    make_private_dir,
    refuse_foreign_state,
    resolve_job_users,
    secure_state_dir,
)
from elasticd.storage import StorageHealth
from elasticd.store import (
    Store,
    redact_url,
    store_endpoints,
)
from elasticd.store.embedded import EmbeddedStore
from elasticd.supervise.adopt import adopted_children, end_inherited
from elasticd.supervise.cgroup import Containment, partial_log_level
from elasticd.supervise.env import job_base_env
from elasticd.supervise.spawn import SpawnPolicy, live_children
from elasticd.supervise.sweep import sweep_orphans
from elasticd.tasks import TaskSet, cancel_and_wait, race

log = logging.getLogger("elasticd.node.daemon")

#: When this program image started: ``/healthz``'s ``started_at`` (a re-exec changes it).
IMAGE_STARTED = time.time()

#: The least one step of the wind-down gets, however little of ``shutdown_timeout`` is left.
MIN_STEP = 1.0
#: What a write gets while the state disk refuses writes: nothing is acknowledged then.
DEGRADED_STEP = 1.0


def step_bound(left: float, *, degraded: bool) -> float:
    """Seconds one step of a stopping daemon's wind-down may take (pure).

    ``left``: what remains of ``shutdown_timeout`` (counted from when the
    workers were stopped); each step gets it, at least :data:`MIN_STEP`, and
    a write no more than :data:`DEGRADED_STEP` while the state disk refuses.
    """
    bound = max(MIN_STEP, left)
    return min(bound, DEGRADED_STEP) if degraded else bound


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: the daemon owns the signals. Its tick measures
    the event loop's lag (:mod:`elasticd.node.looplag`)."""

    def __init__(self, config: uvicorn.Config, lag: LoopLag) -> None:
        super().__init__(config)
        self.lag = lag
        lag.restart()

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield

    async def on_tick(self, counter: int) -> bool:
        self.lag.tick(asyncio.get_running_loop().time())
        return await super().on_tick(counter)


def _user_name(uid: int) -> str | None:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return None


#: Read (and never written) to learn whether the store answers.
NODE_PROBE_KEY = keys.PROBE


class DaemonState(enum.Enum):
    """Where a :class:`Daemon` is in its life; it only moves forward."""

    NEW = "new"
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    CLOSED = "closed"


class Daemon(ReexecMixin):
    """One node's elasticd. Use as ``async with Daemon(config) as d: await d.serve()``."""

    def __init__(
        self,
        config: Config,
        *,
        store: Store | None = None,
        serve_http: bool = True,
        console: ConsoleSink | None = None,
        clock: Clock = SYSTEM_CLOCK,
        environ: dict[str, str] | None = None,
        worker_stdin: int | None = None,
        pass_environment: bool = False,
        state_lock: StateLock | None = None,
        handover: Manifest | None = None,
        lease_keeper: LeaseKeeper | None = None,
    ) -> None:
        """``pass_environment``: the jobs get this process's whole environment, as torchrun's
        workers get the caller's; only an embedded daemon (``elasticd run``,
        ``elasticd.launch``), whose one job is its caller's own, sets it. Otherwise a job gets
        :data:`~elasticd.supervise.env.ALLOWED_ENV` of it and its own ``env``: a served daemon
        runs other users' jobs, and its environment is the operator's.

        ``state_lock``: the state folder's lock, already held by the caller (``elasticd run``
        locks the folder before it writes its token there); otherwise :meth:`start` takes it
        first and releases it last.

        ``handover``: what the daemon's previous program image handed over (it
        re-executed itself: :mod:`elasticd.node.reexec`); ``lease_keeper``: what renews
        the node's lease meanwhile (:mod:`elasticd.node.execwindow`), stopped once the
        node's own keep-alive runs."""
        self.config = config
        self._handover = handover
        self._lease_keeper = lease_keeper
        #: When this image's signal handlers were in (``CLOCK_MONOTONIC``; set by the CLI).
        self.handlers_at: float | None = None
        #: Set by ``elasticd serve``: this daemon may re-execute itself (SIGHUP, /reload).
        self.can_reexec = False
        #: Set by ``elasticd run`` on a Slurm step's store host: ``GET /slurm/proof`` answers
        #: (with this daemon's token's proof) instead of 404.
        self.slurm_store_host = False
        self._reload = asyncio.Event()
        #: From the reload's request (SIGHUP, ``POST /reload``, one held across an exec)
        #: through its pre-flight: ``/readyz`` says a reload is coming (not ready).
        self._reload_checking = False
        #: The last ``/metrics`` page: (``Metrics.changes`` and the node records written here
        #: when it began, when, its bytes).
        self._metrics_page: tuple[tuple[int, int], float, bytes] | None = None
        self._reexecing = False
        #: The image's start and the process (``/healthz``).
        self.started_at = IMAGE_STARTED
        self.pid = os.getpid()
        #: Work of the start-up that nobody awaits (reaping swept workers, the adoption
        #: deadline): closed at the stop.
        self._background = TaskSet("daemon")
        self._state_lock = state_lock
        #: ``elasticd run``'s stdin, for its workers (:attr:`SpawnPolicy.worker_stdin`).
        self._worker_stdin = worker_stdin
        self.clock = clock
        self._environ = dict(os.environ if environ is None else environ)
        self._job_environ = job_base_env(
            self._environ, inherit=pass_environment, passthrough=config.job_env_passthrough
        )
        # Every daemon has a token (there is no tokenless mode): the admin's, given or made
        # (made only once the settings passed: a refused start leaves nothing behind).
        given = read_token(config, self._environ)
        cluster = read_cluster_token(config)
        self.job_users = resolve_job_users(config)
        check_store(config, "present", serves_others=self.job_users.serves_others)
        if given is not None:
            self.token: str = given
            self.token_path: Path | None = config.token_file
        else:
            self.token, self.token_path = own_token(config.state_dir)
        #: What this daemon shows other daemons and the store (never a user's token).
        self.cluster_token: str = cluster or self.token
        self._store_password = read_store_password(config)
        try:
            table = IdentityTable.load(config.identities_file, daemon_uid=os.geteuid())
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        table.local = dataclasses.replace(table.local, serves_others=self.job_users.serves_others)
        #: Who is asking (api.auth): the admin, the cluster, identities, local users, jobs.
        self.authenticator = Authenticator(
            admin_token=self.token,
            cluster_token=self.cluster_token,
            table=table,
            user_name=_user_name,
        )
        #: What start() acquired, released in reverse order (a failed start rolls back).
        self._resources: contextlib.AsyncExitStack | None = None
        self._injected_store = store
        self._serve_http = serve_http
        self._console = console
        self._stop = asyncio.Event()
        #: When the wind-down after the workers must be over (``shutdown_timeout``).
        self._wind_down_until: float | None = None
        self.stop_signal: signal.Signals | None = None  # the signal that asked for the stop
        #: Set once the agents are stopped, just before the HTTP server stops: open
        #: streams (SSE, log follow) end on it so that they never hold up shutdown.
        self.closing_streams = asyncio.Event()
        self._server: _Server | None = None
        #: Connections the API serves at once (``max_connections``, else from the fd limit).
        self.max_connections: int | None = None
        #: The unix socket this daemon listens on, once bound.
        self.socket_path: Path | None = None
        self._server_task: asyncio.Task[None] | None = None
        self._listeners: list[socket.socket] = []
        self._state = DaemonState.NEW
        #: Why the store cannot be used yet (start-up waits for it), None once it answered.
        self._store_wait: str | None = None
        #: "Storage degraded since T, reason" facts (a full disk): /readyz reports them.
        self.storage = StorageHealth(clock)
        self.db = Database(
            config.state_dir / DATABASE_FILE,
            self.storage,
            on_corrupt=config.on_corrupt_database,
            now=clock.time,
        )
        self.store: Store
        self.events: EventLog
        self.jobs: JobService
        self.cluster: Cluster
        self.scheduler: FleetScheduler | None = None
        self.metrics: Metrics
        self.containment: Containment

    @property
    def ready(self) -> bool:
        return self.not_ready_reason is None

    @property
    def not_ready_reason(self) -> str | None:
        """Why the daemon does not accept jobs now (``/readyz``); None when it does."""
        if self._store_wait is not None:
            return f"waiting for the store: {self._store_wait}"
        if self._state is DaemonState.RUNNING:
            if self._reexecing:
                return "re-executing (elasticd reload): back in a moment"
            if self._reload.is_set() or self._reload_checking:
                return "reload asked (elasticd reload): checking the new program, then re-executing"
            if adopting := self.jobs.adopting:
                return f"re-adopting the workers of {adopting} job(s) after a re-exec"
            if not self.jobs.accepting:
                return "not accepting jobs (shutting down)"
            return self.storage.reason
        return {DaemonState.STOPPING: "shutting down", DaemonState.CLOSED: "stopped"}.get(
            self._state, "starting"
        )

    @property
    def warnings(self) -> list[str]:
        """What this daemon refuses although it is ready, with the fix (``/readyz``)."""
        refusal = self.job_users.refusal
        if refusal is None or self.config.store_only:
            return []
        return [f"jobs that name no user (the admin's) are refused: {refusal}"]

    def _reexec_possible(self) -> bool:
        return self._state is DaemonState.RUNNING

    @property
    def state(self) -> DaemonState:
        return self._state

    # lifecycle

    async def start(self) -> None:
        """Acquire everything in order; if a step fails, what was acquired is released."""
        if self._state is not DaemonState.NEW:
            raise RuntimeError(f"daemon cannot start from state {self._state.value}")
        self._state = DaemonState.STARTING
        try:
            async with contextlib.AsyncExitStack() as stack:
                await self._start(stack)
                self._resources = stack.pop_all()  # released by shutdown()
        except BaseException:
            self._state = DaemonState.CLOSED  # rolled back: nothing of it is left
            raise

    async def _start(self, stack: contextlib.AsyncExitStack) -> None:
        """The start-up steps; each pushes onto ``stack`` the undo of what it acquired."""
        # A state folder, log root or store file another user made or may write is refused
        # before anything is opened there (it could hold a planted store: issue 35).
        # The re-exec's lease keeper stops whatever refuses this start (the first check too).
        if self._lease_keeper is not None:
            stack.push_async_callback(asyncio.to_thread, self._lease_keeper.stop)
        refuse_foreign_state(self.config.state_dir, {"log_dir": self.config.logs})
        # One daemon per state folder, locked before anything touches it (the database,
        # the store, the sweep, the cgroup subtree): a second one exits 2 naming this pid.
        if self._state_lock is None or not self._state_lock.held:
            lock = self._lock_state_dir()
            self._state_lock = lock
            stack.callback(lock.release)
        # Born private whatever the umask (secure_state_dir opens them up as far as needed).
        make_private_dir(self.config.state_dir)
        make_private_dir(self.config.logs)
        self.db.open()
        stack.callback(self.db.close)
        self.store = self._injected_store or self._open_store()
        stack.push_async_callback(self.store.close)
        if isinstance(self.store, EmbeddedStore):
            self.store.health = self.storage  # a full disk under its journal is reported too
        secure_state_dir(self.config.state_dir, self.config.logs, self.job_users)
        if self.job_users.refusal is not None and not self.config.store_only:
            log.warning("%s; every job sent to this node will fail", self.job_users.refusal)
        self.events = EventLog(
            self.db,
            self.config.node_name,
            self.clock,
            store=self.store,
            retention=EventRetention(
                first=self.config.event_retention_first,
                last=self.config.event_retention_last,
                # Decide every quarter of the kept tail (at most 64): bounded overshoot.
                every=max(1, min(64, self.config.event_retention_last // 4)),
                finished_first=self.config.event_retention_finished_first,
                finished_last=self.config.event_retention_finished_last,
                finished_total=self.config.event_retention_finished_total,
            ),
        )
        self.metrics = Metrics()
        self.events.add_listener(self.metrics.on_event)
        gpus = await detect_gpus(self.config.nvidia_smi, self._environ)
        slots = min(
            self.config.slots or (len(gpus) if gpus else os.cpu_count() or 1), MAX_NODE_SLOTS
        )
        token_file = str(self.token_path.resolve()) if self.token_path else None
        if self._serve_http:
            await self._start_http()  # binds first: the port is part of this node's record
            stack.push_async_callback(self._stop_http)
        record = NodeRecord(
            name=self.config.node_name,
            url=self.config.url,
            addr=self.config.advertise,
            labels=self.config.labels,
            slots=slots,
            free_slots=slots,
            gpus=gpus,
            version=__version__,
            started_at=self.clock.time(),
        )
        self.cluster = Cluster(
            self.store,
            record,
            on_jobs=self._on_jobs,
            on_refused=self._on_refused_job,
            on_renewed=self._on_store_answers,
            lease_ttl=self.config.lease_ttl,
            clock=self.clock,
        )
        self.jobs = JobService(
            self.config,
            self.events,
            self.store,
            self.cluster,
            token_file=token_file,
            slots=slots,
            gpu_ids=gpus,
            console=self._console,
            clock=self.clock,
            base_env=self._environ,
            job_base_env=self._job_environ,
            storage=self.storage,
            db=self.db,
        )
        plan = lambda: self.scheduler.plan if self.scheduler is not None else None  # noqa: E731
        self.health = node_health(self.config, self.store, self.clock, self.events, plan)
        self.jobs.supervisor.attribute = self.health.attribute
        self.lighthouses = NodeLighthouses(
            self.store,
            self.config.node_name,
            self.cluster.lease,
            None if self.config.store_only else self.job_users,
            heartbeat_timeout=self.config.lighthouse_heartbeat_timeout,
            join_timeout=self.config.lighthouse_join_timeout,
            running=self.jobs.supervisor.parents_running,
            said=self._said_quorum,
            clock=self.clock,
        )
        self.jobs.use_lighthouse(self.lighthouses.address)
        agents = self.jobs.supervisor.agents
        self.metrics.standbys = lambda: {
            job_id: agent.standby_memory() for job_id, agent in agents.items() if agent.prewarm
        }
        manifest = self._handover
        if not self.config.store_only:
            self.jobs.check_user = self.job_users.check
            kept = {a.job_id for a in manifest.agents} if manifest is not None else set()
            self.jobs.use_job_tokens(self.authenticator.jobs, self._token_dir(kept))
            for job_id, digest in (manifest.job_tokens if manifest else {}).items():
                if job_id in kept:  # its workers read the token before the re-exec
                    self.authenticator.jobs.restore(job_id, digest)
        stack.push_async_callback(self._background.aclose)
        if not await self._wait_for_store_fenced(self._wait_for_store):
            return  # asked to stop before the store ever answered: serve() shuts down
        if manifest is not None and manifest.lease is not None and not self.config.store_only:
            # Before its TTL runs out: the node's keys, presence and leadership stay.
            await self.cluster.resume_lease(manifest.lease)
        if self.job_users.serves_others and not self.config.allow_insecure_store:
            await self.refuse_open_store()
        await self.events.start()
        stack.push_async_callback(self._stop_events)
        self.containment = self._contain()
        stack.callback(self.containment.close)  # the daemon's cgroup subtree, once empty
        if self.containment.mode == "subreaper":
            # Orphans re-parented to the daemon must be waited for, or they stay zombies.
            reaper = asyncio.create_task(self.containment.reap_zombies(), name="zombie-reaper")
            stack.push_async_callback(cancel_and_wait, reaper)
        self.jobs.spawn_policy = SpawnPolicy(
            users=self.job_users,
            registry=self.db,
            containment=self.containment,
            worker_stdin=self._worker_stdin,
        )
        # The wrapper and the root stage are probed once (each runs a program): in a
        # thread now, not on the event loop at the first worker's spawn.
        await asyncio.to_thread(self.jobs.spawn_policy.warm)
        if manifest is not None:
            manifest.check(cgroup_ok=self.containment.mode == "cgroup")
        self._sweep_orphans(manifest)
        stack.push_async_callback(self.lighthouses.aclose)  # after the workers' stop
        stack.push_async_callback(self._stop_jobs)
        if manifest is None:
            await self.jobs.recover()
        else:
            refused = {**manifest.not_handed, **manifest.refused}
            await self.jobs.recover(manifest.agents, refused, manifest.failures)
            # The handed workers' Managers call their Lighthouse's port again.
            await self.lighthouses.serve_again(manifest.lighthouses)
            self._said_reexec(manifest)
            if manifest.agents:
                self._background.spawn(self._adoption_deadline(), name="adoption-deadline")
        if not self.config.store_only:
            stack.push_async_callback(self._leave_cluster)
            await self.cluster.start()
            if self._lease_keeper is not None:  # the node's keep-alive runs: it renews now
                await asyncio.to_thread(self._lease_keeper.stop)
            self.scheduler = FleetScheduler(
                self.store,
                self.events,
                on_plan=self._on_plan,
                node=self.config.node_name,
                lease=self.cluster.lease,
                clock=self.clock,
            )
            stack.push_async_callback(self.scheduler.stop)
            await self.scheduler.start()
            self._background.spawn(self.health.release_when_due(), name="quarantine-ttl")
            if self.config.slurm_drain:
                drain = SlurmDrain(self.store, self.config.node_name, self.clock)
                self._background.spawn(drain.run(), name="slurm-drain")
        self._state = DaemonState.RUNNING
        systemd.notify(
            f"READY=1\nSTATUS=serving on {self.config.host}:{self.config.port}", self._environ
        )
        if self.config.job_retention > 0 and not self.config.store_only:
            retention = asyncio.create_task(self._retain(), name="job-retention")
            stack.push_async_callback(cancel_and_wait, retention)
        if not self.config.store_only:
            logs = asyncio.create_task(self._retain_logs(), name="log-retention")
            stack.push_async_callback(cancel_and_wait, logs)
        interval = systemd.watchdog_interval(self._environ)
        if interval is not None:
            watchdog = asyncio.create_task(
                systemd.watchdog(interval, self._environ), name="systemd-watchdog"
            )
            stack.push_async_callback(cancel_and_wait, watchdog)
        if manifest is not None:
            self._log_window(manifest)
        log.info(
            "elasticd %s ready on %s:%s (%d slots, state in %s)",
            self.config.node_name,
            self.config.host,
            self.config.port,
            slots,
            self.config.state_dir,
        )

    def _open_store(self) -> Store:
        """The configured store; an embedded one that cannot open its journal (a damaged or
        unreadable ``store.sqlite3``) is a refusal to start (exit 2, one line), not a crash:
        a restart cannot mend it."""
        try:
            return configured_store(
                self.config, token=self.cluster_token, password=self._store_password
            )
        except StoreUnavailable as exc:
            if self.config.store_url is not None:
                raise
            raise ConfigError(str(exc)) from None

    async def refuse_open_store(self) -> None:
        """Refuse a daemon's HTTP store that answers without a credential (loopback too).

        This daemon runs jobs as other users, and a job document names the user
        its workers run as: a store anyone may write is a way to run programs
        as anyone. Asked once, as no client: a store that answers ``200`` to a
        read without the token is open. (etcd's settings are checked before
        connecting: :func:`elasticd.config.check_store`.)
        """
        url = self.config.store_url
        if url is None or store_endpoints(url).kind != "http":
            return
        import httpx

        try:
            async with httpx.AsyncClient(base_url=url.rstrip("/"), timeout=5.0) as client:
                answer = await client.get("/store/kv", params={"key": NODE_PROBE_KEY})
        except httpx.HTTPError:
            return  # unreachable now: the store client's own errors say so
        if answer.status_code == 200:
            raise ConfigError(
                f"refusing store_url {redact_url(url)!r}: it answers without a token, and "
                "this daemon runs jobs as other users, so any local user could write a job "
                "into it that runs as another user (loopback is no boundary). Give the store "
                "a token (python -m api.store_server --token-file, or a daemon's own store), "
                "or set allow_insecure_store = true where every local user is trusted"
            )

    async def _wait_for_store(self) -> bool:
        """Until the store answers (nodes of a cluster start in any order); False if stopped first.

        Meanwhile ``/healthz`` answers and ``/readyz`` says what is awaited.
        The wait is logged once when it starts and once when it ends. A store
        that answers but refuses this daemon (:class:`StoreAuthError`: no or
        wrong credentials, no access) is not waited for: its error, which names
        the setting to change, ends the start-up (``elasticd serve`` exits 2).
        """
        delay, started = 0.1, self.clock.monotonic()
        while True:
            try:
                await self.store.get(NODE_PROBE_KEY)
            except StoreAuthError:
                raise
            except StoreError as exc:
                if self._store_wait is None:
                    log.warning(
                        "the store is not reachable yet (%s); retrying until it answers", exc
                    )
                self._store_wait = str(exc)
            else:
                if self._store_wait is not None:
                    log.warning(
                        "the store answers after %.1f s; starting",
                        self.clock.monotonic() - started,
                    )
                self._store_wait = None
                return True
            with contextlib.suppress(TimeoutError):  # the next try, unless a stop comes first
                async with asyncio.timeout(delay):
                    await self._stop.wait()
            if self._stop.is_set():
                return False
            delay = min(delay * 2, 5.0)

    async def _start_http(self) -> None:
        from api.app import create_app  # the API depends on the daemon, not the reverse
        from api.protocol import AcceptErrors, connection_cap, uvicorn_settings

        asyncio.get_running_loop().set_exception_handler(AcceptErrors())

        manifest = self._handover
        soft, hard = raise_nofile_limit()
        self.max_connections = self.config.max_connections or connection_cap(soft)
        log.info(
            "descriptor limit %d (hard %d); serving at most %d connections at once",
            soft,
            hard,
            self.max_connections,
        )
        app = create_app(self)
        uv_config = uvicorn.Config(
            app,
            host=self.config.host,
            port=self.config.port,
            log_level="warning",
            access_log=False,
            lifespan="off",
            # Set from what is left of shutdown_timeout when the server stops (_stop_http).
            timeout_graceful_shutdown=math.ceil(self.config.shutdown_timeout),
            # Bounded request heads, head read time and connections (api.protocol).
            **uvicorn_settings(self.max_connections),
        )
        self._server = _Server(uv_config, self.metrics.loop_lag)
        if manifest is not None and manifest.tcp_fd is not None:
            sock = inherited_socket(manifest.tcp_fd)  # it listened through the exec
        else:
            sock = bind_socket(self.config.host, self.config.port)
        self.config.port = sock.getsockname()[1]
        sockets = [sock]
        path = self.config.socket_path
        if manifest is not None and manifest.unix_fd is not None:
            sockets.append(inherited_socket(manifest.unix_fd))
            self.socket_path = path
        elif self.config.unix_socket is None and len(os.fsencode(path)) > UNIX_PATH_MAX:
            log.warning("no unix socket: its default path %s is too long; set unix_socket", path)
        else:
            try:
                sockets.append(
                    bind_unix_socket(
                        path,
                        group=self.config.unix_socket_group,
                        everyone=self.job_users.serves_others
                        and self.config.unix_socket_group is None,
                    )
                )
            except BaseException:
                sock.close()
                raise
            self.socket_path = path
        self._listeners = sockets
        self._server_task = asyncio.create_task(self._server.serve(sockets), name="http")

    def _token_dir(self, keep: set[str] | None = None) -> Path:
        """The folder of the jobs' own token files: the daemon's, 0711 (no listing)."""
        folder = self.config.state_dir / "tokens"
        folder.mkdir(mode=0o711, exist_ok=True)
        st = folder.lstat()
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            raise ConfigError(f"{folder} must be a folder of the daemon's own user")
        folder.chmod(0o711)
        for stale in folder.iterdir():  # a previous run's: its jobs' workers are gone
            if stale.name.removesuffix(".token") in (keep or ()):
                continue  # a job carried across a re-exec: its workers hold this token
            with contextlib.suppress(OSError):
                stale.unlink()
        return folder

    def _contain(self) -> Containment:
        """Set up the containment of job attempts (a cgroup subtree, or the subreaper fallback)."""
        try:
            containment = Containment.setup(
                self.config.containment,
                node=self.config.node_name,
                state_dir=self.config.state_dir,
                known=lambda: live_children() | adopted_children(),
                move_budget=self.config.prewarm_move_budget,
            )
        except OSError as exc:
            raise ConfigError(
                f"containment = cgroup, but no cgroup can be made for the jobs: {exc}; "
                "run as root on a host with cgroup v2 (under systemd: Delegate=yes), "
                'or set containment = "auto"'
            ) from exc
        if containment.partial:
            log.log(
                partial_log_level(self.config.containment, os.geteuid()),
                "job processes are contained only partly (child subreaper, no cgroup): %s; %s",
                containment.reason,
                containment.fix,
            )
        else:
            log.info("each job attempt runs in its own cgroup under %s", containment.base)
        return containment

    def _sweep_orphans(self, manifest: Manifest | None = None) -> None:
        """Kill the workers a previous run of this daemon left alive, and say so in their jobs.

        First the recorded workers (by pid), then every attempt cgroup left in the
        daemon's subtree: what is still in one is a stray (a process that left its
        worker's process group), reported in ``workers.strays``. After a re-exec the
        workers handed over and taken up (``manifest``) are spared, with their cgroups;
        every other child of the old image is reaped (killed first when nobody reads its
        end: :meth:`Manifest.inherited_to_end`).
        """
        killed: set[int] = set()
        keep = manifest.adopted_pids() if manifest is not None else set()
        live = {Path(a.cgroup).name for a in manifest.agents if a.cgroup} if manifest else set()
        for orphan in sweep_orphans(self.db, keep=keep):
            killed.update(orphan.pids)
            record = orphan.record
            if not record.job_id:
                continue
            what = "worker" if orphan.leader_alive else "leftover processes of worker"
            self.events.emit(
                record.job_id,
                "daemon",
                EventKind.WORKER_ORPHAN_KILLED,
                f"killed {what} pid {record.pid} (local rank {record.local_rank}, attempt "
                f"{record.attempt}) left running by a previous run of the daemon: "
                f"{len(orphan.pids)} process(es)",
                pid=record.pid,
                local_rank=record.local_rank,
                attempt=record.attempt,
            )
        for leftover in self.containment.sweep(live):
            pids = [pid for pid in leftover.pids if pid not in killed]
            killed.update(pids)
            if not pids:
                continue
            self.events.emit(
                leftover.name.job_id,
                "daemon",
                EventKind.WORKERS_STRAYS,
                f"killed {len(pids)} process(es) of attempt {leftover.name.attempt} on "
                f"{self.config.node_name} left running by a previous run of the daemon "
                f"(found in its cgroup): pids {', '.join(str(p) for p in pids)}",
                attempt=leftover.name.attempt,
                count=len(pids),
                pids=pids,
            )

        if manifest is not None:
            # Every child of the old image this one does not supervise (those swept just
            # now, a health check still running): killed if nobody reads its end, reaped.
            kill, reap = manifest.inherited_to_end()
            if reap:
                self._background.spawn(
                    end_inherited(kill, reap, manifest.children), name="reap-inherited"
                )

    async def _retain(self) -> None:
        """Delete finished jobs once they are older than ``job_retention``, forever."""
        retention = self.config.job_retention
        every = min(max(retention / 10, 0.5), 600.0)  # a job outlives its retention by <= 10%
        while True:
            await asyncio.sleep(every)
            try:
                await self.jobs.expire(retention)
            except ElasticdError as exc:  # the store is away: try again next time
                log.warning("job retention: %s", exc)

    def _on_store_answers(self) -> None:
        if self._state in (DaemonState.RUNNING, DaemonState.STARTING):
            self.jobs.store_answers()

    async def _retain_logs(self) -> None:
        """Apply log retention to every job's folder every ``log_retention_interval``."""
        while True:
            await asyncio.sleep(self.config.log_retention_interval)
            try:
                await self.jobs.retain_logs()
            except Exception:  # a pass that failed is tried again next time
                log.exception("log retention failed")

    async def metrics_text(self) -> bytes:
        """``/metrics``: the series, with the goodput of the jobs run here and the nodes'
        health computed now; or the page rendered less than ``PAGE_MAX_AGE`` ago, when no
        input of the metrics changed since it began (:attr:`Metrics.changes`, a node record
        this daemon wrote)."""
        now, changes = self.clock.monotonic(), (self.metrics.changes, self.health.book.writes)
        page = self._metrics_page
        if page is not None and page[0] == changes and now - page[1] < PAGE_MAX_AGE:
            return page[2]
        body = await self._render_metrics()
        self._metrics_page = (changes, now, body)
        return body

    async def _render_metrics(self) -> bytes:
        wanted = self.metrics.goodput_to_refresh(self.jobs.running_here())
        self.metrics.on_goodput(await self.jobs.goodput_of(wanted))
        with contextlib.suppress(StoreError):  # the store away: the last figures stay
            live = [r.name for r in await self.cluster.nodes()]
            records = await self.health.records()
            now = self.clock.time()
            self.metrics.on_nodes(*node_series(records, live, self.health.policy.window, now))
        return self.metrics.render()

    def _on_refused_job(self, key: str, reason: str) -> None:
        if self._state in (DaemonState.RUNNING, DaemonState.STARTING):
            self.jobs.on_refused(key, reason)

    def _on_plan(self, plan: FleetPlan) -> None:
        self.metrics.on_plan(plan)
        self.jobs.on_plan(plan)

    def _on_jobs(self, jobs: list[Job]) -> None:
        self.metrics.on_jobs(jobs)
        if self._state in (DaemonState.RUNNING, DaemonState.STARTING):
            self.jobs.on_jobs(jobs)
            if self.scheduler is not None:
                self.scheduler.wake()
            if self.lighthouses.served and self._state == DaemonState.RUNNING:
                running = self.jobs.supervisor.parents_running()
                self._background.spawn(self.lighthouses.prune(running), name="lighthouse-prune")

    def _said_quorum(self, parent: Job, words: str) -> None:
        """A new quorum of a job's Lighthouse, formed by this node's leader: its event."""
        self.events.emit(
            parent.id,
            "daemon",
            EventKind.LIGHTHOUSE_QUORUM,
            words,
            job_tag=incarnation_tag(parent),
        )

    def request_stop(self, sig: signal.Signals | None = None) -> None:
        """Ask the daemon to shut down (what SIGTERM/SIGINT do; ``sig`` is remembered)."""
        if sig is not None and self.stop_signal is None:
            self.stop_signal = sig
        self._stop.set()

    async def stop_requested(self) -> None:
        """Return once a stop was asked for (a signal, or :meth:`request_stop`)."""
        await self._stop.wait()

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop, sig)
        if self.can_reexec:
            loop.add_signal_handler(signal.SIGHUP, self.request_reload)

    async def serve(self) -> None:
        """Run until asked to stop, then shut down in order; re-exec when asked to."""
        while not self._stop.is_set():
            await race(self._stop.wait(), self._reload.wait())
            if self._reload.is_set() and not self._stop.is_set():
                self._reload_checking = True  # still not ready: the request is being served
                self._reload.clear()
                try:
                    await self.reexec()
                finally:
                    self._reload_checking = False
        await self._take_up_before_the_stop()
        await self.shutdown()

    async def shutdown(self) -> None:
        """Stop in order (see the module); safe to call in any state, and more than once."""
        if self._state in (DaemonState.STOPPING, DaemonState.CLOSED):
            return
        self._state = DaemonState.STOPPING
        systemd.notify("STOPPING=1\nSTATUS=stopping workers", self._environ)
        log.info("shutting down: stop accepting jobs, stop workers, flush, exit")
        if self._resources is not None:
            # The graceful part first (workers stopped, events published), while the
            # node is still in the cluster; then the rest, in reverse order of start.
            await self._stop_jobs()
            loop = asyncio.get_running_loop()
            self._wind_down_until = loop.time() + self.config.shutdown_timeout
            with contextlib.suppress(Exception):
                self.db.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            await self._stop_events()
            await self._resources.aclose()
        self._state = DaemonState.CLOSED
        log.info("elasticd stopped")

    async def _stop_jobs(self) -> None:
        if self.scheduler is not None:
            await self.scheduler.stop()  # no new placement from a node that is leaving
        self.jobs.stop_accepting()
        await self.jobs.stop_agents()

    async def _stop_events(self) -> None:
        with contextlib.suppress(Exception):
            # Bounded: publish what is queued to the store (briefly when the disk refuses).
            await self.events.stop(self._write_bound())

    async def _leave_cluster(self) -> None:
        with contextlib.suppress(Exception):  # bounded: a full disk may hold the revoke back
            async with asyncio.timeout(self._write_bound()):
                await self.cluster.stop()  # revoke the node's lease: peers see it gone at once

    async def _stop_http(self) -> None:
        self.closing_streams.set()  # open streams (SSE, log follow) end first
        if self._server is not None and self._server_task is not None:
            # Requests still running get what is left of the wind-down, then are cancelled.
            self._server.config.timeout_graceful_shutdown = math.ceil(
                step_bound(self._wind_down_left(), degraded=False)
            )
            self._server.should_exit = True
            with contextlib.suppress(Exception):
                await self._server_task
        if self.socket_path is not None:
            with contextlib.suppress(OSError):
                self.socket_path.unlink()

    def _wind_down_left(self) -> float:
        """Seconds left of ``shutdown_timeout``, counted from when the workers were stopped."""
        if self._wind_down_until is None:  # a failed start rolling back: the whole budget
            return self.config.shutdown_timeout
        return self._wind_down_until - asyncio.get_running_loop().time()

    def _write_bound(self) -> float:
        """How long a stopping daemon waits on one write (:func:`step_bound`)."""
        degraded = self.storage.state_degraded() is not None
        return step_bound(self._wind_down_left(), degraded=degraded)

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.shutdown()
