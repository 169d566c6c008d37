"""torchrun's rendezvous on elasticd: ``torchrun --rdzv-backend=elasticd``.

``torchrun --rdzv-backend=elasticd --rdzv-endpoint=127.0.0.1:7070
--rdzv-id=JOB --nnodes=2:4 --nproc-per-node=1 train.py`` runs torch's own
agent (its worker processes, restarts and exit barrier) with elasticd's
rendezvous (:mod:`elasticd.rendezvous`) on the daemons' cluster store,
reached through a daemon's ``/store`` API. torch finds the backend through
the ``torchrun.handlers`` entry point (``pyproject.toml``): it calls
:func:`create_handler` with no argument and registers what it returns, the
creator of a handler from torch's ``RendezvousParameters``.

Where it runs, and why it is shaped so:

* **In torchrun's process, on the job's side** of the privilege boundary
  (docs/design.md section 6): as the user who started torchrun, holding only
  the token it was given (``--rdzv-conf token_file=PATH``, else
  ``ELASTICD_TOKEN_FILE``). The daemon never imports this module
  (``tests/unit/test_layering.py``); it imports torch only when torch asks
  for a handler.
* **One node = one torchrun process**, named ``<host>-<pid>-<random>``. It
  holds a lease of its own (``lease_ttl``, 3 s by default), kept alive from
  the backend's thread and revoked on :meth:`shutdown`; its presence key is
  bound to it, so a torchrun that dies is dropped by the others within
  ``lease_ttl``, as a daemon would be.
* **torch's agent is synchronous; the rendezvous is async.** The rendezvous,
  the lease and a watch on the round run on a private event loop in one
  daemon thread; torch's calls block on it. ``num_nodes_waiting`` (called
  every monitor interval) reads a number the watch keeps, so it costs no
  request. When the watch sees that the round must re-form, it says at once
  that this node is heading for the next round (``StoreRendezvous.leaving``),
  before torch gets round to stopping its workers, so the others do not
  presume it dead.
* **The agent's store is fresh every round**: a ``torch.distributed.Store``
  over ``/store`` under ``jobs/<run id>/torchrun/<round>/``
  (:func:`elasticd.keys.torchrun_store_prefix`), so a re-formed group never
  reads what the last one left. ``use_agent_store`` is False: workers get
  ``MASTER_ADDR``/``MASTER_PORT`` of the round (group rank 0's address and a
  port it picked, fresh every round) and build their own store there, as
  torch's c10d backend's workers do with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
  (by default c10d shares its agent's TCPStore with them).
* The rendezvous options are torch's (``--rdzv-conf join_timeout=...,
  last_call_timeout=...``, torch's defaults 600 and 30 s); a re-formation
  after a failure completes as soon as every live node is back, without the
  last call. :meth:`shutdown` closes the rendezvous, as torch's handler does:
  a run id is used once (choose a fresh ``--rdzv-id`` per run, or
  ``DELETE /jobs/<id>`` once it ended).

What operators see (read-only; the daemons never run, cancel or resume
it): the run's job document ``job/<run id>`` with ``launcher: torchrun``
(state, round, the torchrun command, restarts: rounds that ended in a
node's worker failure), written by the torchruns by compare-and-set
(:func:`run_edit`) off torch's path; each torchrun's events under
``ev/<run id>/<node>/`` and its group view (round, rank, master; no
workers: torch's agent owns them). The end is SUCCEEDED when torch's
launcher calls :meth:`shutdown` with nothing raised, FAILED when it calls
it while an error (the workers failed) is on its way out. A torchrun
killed by a signal never calls it (torch's launcher skips it then), so a
run all of whose torchruns were killed keeps its last state; its nodes'
presence keys are gone once their leases expire.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import importlib
import ipaddress
import logging
import os
import re
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

from pydantic import ValidationError

from elasticd.errors import (
    InvalidTransition,
    LeaseNotFound,
    RendezvousClosed,
    RendezvousError,
    RendezvousTimeout,
    StoreAuthError,
    StoreError,
)
from elasticd.eventkinds import EventKind
from elasticd.keys import event_key, group_key, job_key, torchrun_store_prefix
from elasticd.models import Event, EventSource, GroupView, Job, JobSpec, valid_job_id
from elasticd.rendezvous import Change, RoundInfo, Settings, StoreRendezvous
from elasticd.states import JobState, WorkerState, job_transition
from elasticd.store import Store
from elasticd.store.http import HttpStore
from elasticd.tokens import read_token_file

__all__ = [
    "BACKEND",
    "BackendConfig",
    "TorchrunRendezvous",
    "RunStep",
    "backend_config",
    "create_handler",
    "endpoint_url",
    "node_name",
    "run_edit",
    "run_spec",
    "waiting_nodes",
]

log = logging.getLogger("elasticd.torchrun")

#: The name torchrun knows the backend by (``--rdzv-backend``).
BACKEND = "elasticd"
#: A daemon's default port, for an endpoint given without one.
DEFAULT_PORT = 7070
#: Pause between tries while the store cannot be reached during a watch.
_RETRY_FIRST, _RETRY_MAX = 0.05, 1.0
#: The node selector of a torchrun run's document: no node can have this label (``--labels``
#: splits at the first ``=``), so a daemon of a version that knows no ``Job.launcher``
#: never starts an agent for it. Today's daemons skip it by its launcher anyway.
NEVER_SCHEDULED = {"elasticd=torchrun": "run by torch's agents"}
#: Tries of one compare-and-set on the run's document against other torchruns' writes.
_CAS_ATTEMPTS = 50
#: Longest a shutdown waits for the run's record to be written.
_RECORD_DRAIN = 5.0

T = TypeVar("T")


@dataclass(frozen=True)
class BackendConfig:
    """Everything the backend takes from torchrun's rendezvous parameters."""

    url: str
    run_id: str
    settings: Settings
    token_file: str | None
    lease_ttl: float
    store_timeout: float
    local_addr: str | None


def endpoint_url(endpoint: str) -> str:
    """torchrun's ``--rdzv-endpoint`` as a daemon's base URL.

    ``host[:port]`` means ``http://host:port`` (port 7070 if absent, as the
    daemon's default); an ``http://`` or ``https://`` URL is kept as given.
    """
    endpoint = endpoint.strip()
    if not endpoint:
        raise ValueError("--rdzv-endpoint is required: a daemon's host:port")
    if "://" in endpoint:
        parts = urlsplit(endpoint)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"--rdzv-endpoint {endpoint!r}: expected host:port or an http URL")
        return endpoint.rstrip("/")
    parts = urlsplit(f"//{endpoint}")
    try:
        port = parts.port or DEFAULT_PORT
    except ValueError as exc:
        raise ValueError(f"--rdzv-endpoint {endpoint!r}: {exc}") from None
    host = parts.hostname
    if not host or parts.path:
        raise ValueError(f"--rdzv-endpoint {endpoint!r}: expected host:port")
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


def _number(conf: Mapping[str, Any], key: str, default: float) -> float:
    value = conf.get(key, default)
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"--rdzv-conf {key}={value!r} is not a number") from None
    if number <= 0:
        raise ValueError(f"--rdzv-conf {key}={value!r} must be positive")
    return number


def backend_config(
    *,
    endpoint: str,
    run_id: str,
    min_nodes: int,
    max_nodes: int,
    local_addr: str | None,
    conf: Mapping[str, Any],
    environ: Mapping[str, str],
) -> BackendConfig:
    """The backend's settings from torchrun's parameters (pure; tested as a table).

    The run id names store keys, so it must be a valid job id. The token
    file comes from ``--rdzv-conf token_file=`` first, then
    ``ELASTICD_TOKEN_FILE``; without either, requests carry no token (a
    loopback daemon without a token file).
    """
    if not valid_job_id(run_id):
        raise ValueError(
            f"--rdzv-id {run_id!r} must be letters, digits, '.', '_' or '-' (at most 128), "
            "as an elasticd job id"
        )
    settings = Settings(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        join_timeout=_number(conf, "join_timeout", 600.0),
        last_call_timeout=_number(conf, "last_call_timeout", 30.0),
        close_timeout=_number(conf, "close_timeout", 30.0),
    )
    token_file = conf.get("token_file") or environ.get("ELASTICD_TOKEN_FILE") or None
    return BackendConfig(
        url=endpoint_url(endpoint),
        run_id=run_id,
        settings=settings,
        token_file=None if token_file is None else str(token_file),
        lease_ttl=_number(conf, "lease_ttl", 3.0),
        store_timeout=_number(conf, "store_timeout", 300.0),
        local_addr=local_addr or None,
    )


def waiting_nodes(change: Change | None) -> int:
    """What ``num_nodes_waiting`` answers once the watch on the round saw ``change``.

    torch's agent re-forms its group when the answer is above zero, so any
    reason to re-form is 1, including a loss and a new round (torch's own
    handler counts only arrivals). A closed rendezvous is 0: the run is
    ending, not re-forming.
    """
    if change is None or change is Change.CLOSED:
        return 0
    return 1


@dataclass(frozen=True)
class RunStep:
    """What one torchrun says about the run: the state it saw, in which round, and why."""

    state: JobState
    round: int = 0
    reason: str | None = None
    #: The round ends because this node's workers failed (torch's agent spends a restart).
    failed: bool = False


def run_edit(
    job: Job | None, step: RunStep, *, run_id: str, spec: JobSpec, node: str, now: float
) -> Job | None:
    """The run's job document after ``step`` (None: no change); pure, tested as a table.

    Several torchruns write the same document (by compare-and-set), so every
    step is idempotent and a stale one changes nothing: a round older than
    the document's, a re-formation of a round already left, anything after
    the end (the first terminal state wins). A run that ends before any round
    formed is FAILED. A run id that names a job of the daemons is refused
    (ValueError): torch's agents must never write an elasticd job. A round
    that ends because a node's workers failed counts one restart
    (``restart_count``; torch's agents spend their budgets per node).
    """
    if job is None:
        job = Job(
            id=run_id,
            spec=spec,
            state=JobState.PENDING,
            max_restarts=spec.max_restarts,
            created_at=now,
            submitted_to=node,
            launcher="torchrun",
        )
        fresh: Job | None = job
    else:
        fresh = None
        if job.launcher != "torchrun":
            raise ValueError(
                f"--rdzv-id {run_id!r} names a job the elasticd daemons run; "
                "choose another id for this torchrun"
            )
    if job.state.is_terminal:
        return fresh
    target, updates = step.state, dict[str, Any]()
    if target is JobState.PENDING:
        return fresh
    if target is JobState.RUNNING:
        if step.round < job.round or (
            step.round == job.round and job.state is not JobState.PENDING
        ):
            return fresh
        updates["round"] = step.round
    elif target is JobState.RESTARTING:
        if step.failed and job.charged_round < step.round <= job.round:
            # One restart per round that ended in a failure, however many nodes failed.
            updates["restart_count"] = job.restart_count + 1
            updates["charged_round"] = step.round
        if job.state is not JobState.RUNNING or step.round != job.round:
            return job.model_copy(update=updates) if updates else fresh
    elif target is JobState.SUCCEEDED and job.state is JobState.PENDING:
        target, updates["reason"] = JobState.FAILED, "torchrun ended before any round formed"
    if target is not job.state:
        try:
            job_transition(job.state, target)
        except InvalidTransition:
            return fresh
        updates["state"] = target
        if target is JobState.RUNNING and job.started_at is None:
            updates["started_at"] = now
        if target.is_terminal:
            updates["finished_at"] = now
    updates.setdefault("reason", step.reason)
    return job.model_copy(update=updates)


def run_spec(
    config: BackendConfig,
    argv: list[str],
    *,
    nproc_per_node: int | None = None,
    max_restarts: int | None = None,
    role: str | None = None,
) -> JobSpec:
    """The spec shown for a torchrun run: its command line, and what torch's parser read from it.

    The entrypoint is ``torchrun`` and the arguments are the command's own,
    so operators see what was typed; a value the parser could not give keeps
    the spec's default. ``join_timeout`` and ``last_call_timeout`` are the
    rendezvous' own.
    """
    fields: dict[str, Any] = {
        "id": config.run_id,
        "entrypoint": "torchrun",
        "args": argv[1:],
        "min_nodes": config.settings.min_nodes,
        "max_nodes": config.settings.max_nodes,
        "join_timeout": config.settings.join_timeout,
        "last_call_timeout": config.settings.last_call_timeout,
        "node_selector": dict(NEVER_SCHEDULED),
    }
    for key, value in (
        ("nproc_per_node", nproc_per_node),
        ("max_restarts", max_restarts),
        ("role", role),
    ):
        if value is not None:
            fields[key] = value
    try:
        return JobSpec(**fields)
    except ValidationError:  # an odd command line (too long, ...): the essentials only
        return JobSpec(
            id=config.run_id,
            entrypoint="torchrun",
            min_nodes=config.settings.min_nodes,
            max_nodes=config.settings.max_nodes,
            node_selector=dict(NEVER_SCHEDULED),
        )


def node_name(host: str, pid: int, suffix: str) -> str:
    """This torchrun's node name: ``<host>-<pid>-<suffix>``, in node-name characters."""
    clean = re.sub(r"[^A-Za-z0-9._-]", "-", host).strip(".-_")[:200] or "node"
    return f"{clean}-{pid}-{suffix}"


def _address_towards(url: str) -> str:
    """The local address this host reaches ``url``'s host from (no packet is sent)."""
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    try:
        info = socket.getaddrinfo(host, parts.port or DEFAULT_PORT, type=socket.SOCK_DGRAM)
        family, _, _, _, address = info[0]
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect(address)
            local: str = sock.getsockname()[0]
    except OSError:
        return socket.getfqdn()
    if ipaddress.ip_address(local.split("%", 1)[0]).is_loopback:
        # A daemon on this host: a loopback address would name every node's own host to
        # the others' workers. torch's c10d takes the host's name then; so does this.
        return socket.getfqdn()
    return local


class _LoopThread:
    """A private event loop in a daemon thread; synchronous callers block on it."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.submit(coro).result()

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


class TorchrunRendezvous:
    """One torchrun's side of the rendezvous, synchronous and torch-free.

    The torch handler (:func:`create_handler`) wraps it; tests drive it
    directly. ``store`` is injected in tests; by default it is an
    :class:`~elasticd.store.http.HttpStore` of ``config.url``, made on the
    backend's own loop. With ``spec`` (what the torchrun command runs), the
    run is recorded where operators look (:meth:`_record`); without, only
    the rendezvous happens.
    """

    def __init__(
        self,
        config: BackendConfig,
        *,
        node: str | None = None,
        store: Callable[[], Store] | None = None,
        spec: JobSpec | None = None,
    ) -> None:
        self.config = config
        self.node = node or node_name(socket.gethostname(), os.getpid(), secrets.token_hex(3))
        self.token = (
            None
            if config.token_file is None
            else read_token_file(config.token_file, what="elasticd token file")
        )
        self.addr = config.local_addr or _address_towards(config.url)
        self._make_store = store or (lambda: HttpStore(config.url, self.token))
        self._spec = spec
        self._lease_id: int | None = None
        self._lease_lock: asyncio.Lock | None = None
        self._waiting = 0
        self._closed_seen = False
        self._round: RoundInfo | None = None
        self._registered = False
        self._seq = 0  # this node's events, in its order (as a daemon's local seq)
        self._watch: concurrent.futures.Future[None] | None = None
        self._stopped = False
        self._thread = _LoopThread(f"elasticd-rdzv-{config.run_id}")
        try:
            self._store, self._rdzv, self._tasks = self._thread.call(self._open())
        except BaseException:
            self._thread.stop()
            raise

    async def _open(self) -> tuple[Store, StoreRendezvous, list[asyncio.Task[None]]]:
        self._lease_lock = asyncio.Lock()
        self._notes: asyncio.Queue[Callable[[], Coroutine[Any, Any, None]]] = asyncio.Queue()
        store = self._make_store()
        rdzv = StoreRendezvous(
            store,
            self.config.run_id,
            node=self.node,
            role="default",
            # torch's agent assigns its workers' ranks itself; the rendezvous only
            # needs to know that each torchrun is one node.
            local_world_size=1,
            advertise_addr=self.addr,
            settings=self.config.settings,
            lease=self._lease,
        )
        tasks = [
            asyncio.create_task(self._keep_alive(store), name="elasticd-rdzv-keepalive"),
            asyncio.create_task(self._publish(), name="elasticd-rdzv-record"),
        ]
        return store, rdzv, tasks

    # -- the lease -------------------------------------------------------------

    async def _lease(self) -> int:
        """This node's live lease, granted when it has none (first use, or lost)."""
        assert self._lease_lock is not None
        async with self._lease_lock:
            if self._lease_id is None:
                self._lease_id = await self._store.grant(self.config.lease_ttl)
            return self._lease_id

    async def _keep_alive(self, store: Store) -> None:
        """Renew the lease every third of its TTL; after a failure, retry soon.

        A lost lease is forgotten: the watch then finds this node's presence
        key gone (``FENCED``), torch re-forms, and the next announcement
        is made under a fresh lease.
        """
        interval = self.config.lease_ttl / 3
        retry = min(interval, 0.2)
        pause = interval
        while True:
            await asyncio.sleep(pause)
            lease = self._lease_id
            if lease is None:
                pause = interval
                continue
            try:
                await store.keep_alive(lease)
                pause = interval
            except LeaseNotFound:
                log.warning("%s: the lease expired; announcing again under a new one", self.node)
                if self._lease_id == lease:
                    self._lease_id = None
                pause = interval
            except StoreError as exc:
                log.warning("%s: keep-alive failed: %s", self.node, exc)
                pause = retry

    # -- the record operators see -------------------------------------------------

    async def _publish(self) -> None:
        """Write queued notes one after the other, off torch's path (a failed one is logged)."""
        while True:
            note = await self._notes.get()
            try:
                await note()
            except (StoreError, ValidationError, ValueError) as exc:
                log.warning("%s: could not record the run: %s", self.node, exc)
            finally:
                self._notes.task_done()

    def _note(
        self, step: RunStep, kind: EventKind | None, message: str, group: WorkerState
    ) -> None:
        """Queue (from the loop's thread) the record of ``step``, an event and the group view."""
        if self._spec is None:
            return
        info = self._round

        async def note() -> None:
            await self._record(step)
            if kind is not None:
                await self._emit("rendezvous", kind, message, state=group.value)
            await self._publish_group(group, info)

        self._notes.put_nowait(note)

    async def _record(self, step: RunStep) -> None:
        """Apply ``step`` to the run's job document by compare-and-set (see :func:`run_edit`)."""
        assert self._spec is not None
        key = job_key(self.config.run_id)
        for _ in range(_CAS_ATTEMPTS):
            entry = await self._store.get(key)
            current = None if entry is None else Job.model_validate_json(entry.value)
            new = run_edit(
                current,
                step,
                run_id=self.config.run_id,
                spec=self._spec,
                node=self.node,
                now=time.time(),
            )
            if new is None:
                return
            version = None if entry is None else entry.version
            result = await self._store.compare_and_set(key, new.model_dump_json().encode(), version)
            if not result.ok:
                continue  # another torchrun wrote it meanwhile: decide again on theirs
            if current is None:
                await self._emit(
                    "agent",
                    EventKind.JOB_SUBMITTED,
                    f"torchrun run {self.config.run_id} registered by {self.node}",
                    state=new.state.value,
                )
            before = JobState.PENDING if current is None else current.state
            if before is not new.state:
                why = f": {new.reason}" if new.reason else ""
                await self._emit(
                    "agent",
                    EventKind.JOB_STATE,
                    f"job {before.value} -> {new.state.value}{why}",
                    state=new.state.value,
                )
            return

    async def _emit(
        self, source: EventSource, kind: EventKind, message: str, **fields: Any
    ) -> None:
        """One event of this node under ``ev/<run>/<node>/<seq>``, as a daemon publishes its own."""
        self._seq += 1
        event = Event(
            seq=self._seq,
            time=time.time(),
            job_id=self.config.run_id,
            node=self.node,
            source=source,
            kind=kind.value,
            message=message,
            **fields,
        )
        await self._store.put(
            event_key(self.config.run_id, self.node, self._seq), event.model_dump_json().encode()
        )

    async def _publish_group(self, state: WorkerState, info: RoundInfo | None) -> None:
        """This node in ``GET /jobs/{id}/workers``: round and rank (not torch's workers)."""
        view = GroupView(
            node=self.node,
            state=state,
            role="default",
            group_rank=-1 if info is None else info.group_rank,
            group_world_size=0 if info is None else info.group_world_size,
            attempt=-1 if info is None else info.round,
            round=-1 if info is None else info.round,
            restart_count=0,
            master_addr=None if info is None else info.master_addr,
            master_port=None if info is None else info.master_port,
            updated_at=time.time(),
        )
        key = group_key(self.config.run_id, self.node)
        await self._store.put(key, view.model_dump_json().encode())

    async def _register(self) -> None:
        """Make the run's document (PENDING) before joining; refuse a daemons' job's id."""
        if self._spec is None:
            return
        try:
            await self._record(RunStep(JobState.PENDING))
        except ValueError as exc:  # run_edit's refusal (ValidationError: a malformed doc)
            raise RendezvousError(str(exc)) from None
        await self._publish_group(WorkerState.INIT, None)

    # -- the watch on the round --------------------------------------------------

    async def _follow(self, my_round: int) -> None:
        """Wait for a reason to re-form ``my_round``; say "leaving" first, then record it."""
        pause = _RETRY_FIRST
        while True:
            try:
                change = await self._rdzv.wait_for_change(my_round)
                break
            except StoreAuthError as exc:
                # A refused token never heals by retrying: the lease lapses too, and the
                # others re-form without this node. Tell torch to re-form now.
                log.warning("%s: the daemon refuses this run's token: %s", self.node, exc)
                change = Change.FENCED
                break
            except StoreError as exc:
                log.debug("%s: watch failed: %s", self.node, exc)
                await asyncio.sleep(pause)
                pause = min(pause * 2, _RETRY_MAX)
        if change is Change.CLOSED:
            self._closed_seen = True
        else:
            with contextlib.suppress(StoreError):
                await self._rdzv.leaving(my_round)
            log.info("%s: round %d must re-form: %s", self.node, my_round, change.value)
            self._note(
                RunStep(JobState.RESTARTING, my_round, change.value),
                EventKind.RENDEZVOUS_CHANGE,
                f"round {my_round} re-forms: {change.value}",
                WorkerState.STOPPED,
            )
        self._waiting = waiting_nodes(change)

    def _stop_watch(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(concurrent.futures.CancelledError, Exception):
                self._watch.result()
            self._watch = None

    # -- what the torch handler calls --------------------------------------------

    def next_round(self) -> RoundInfo:
        """Leave the current round if in one, and block until the next one completes."""
        self._stop_watch()
        if not self._registered:
            self._thread.call(self._register())
            self._registered = True
        if self._round is not None and self._waiting == 0:
            # torch asks for a new round though the watch saw no reason: its own workers
            # failed (num_nodes_waiting was 0, so it was not told to re-form).
            self._thread.loop.call_soon_threadsafe(
                self._note,
                RunStep(
                    JobState.RESTARTING,
                    self._round.round,
                    f"the workers on {self.node} failed",
                    failed=True,
                ),
                EventKind.RENDEZVOUS_CHANGE,
                f"round {self._round.round} re-forms: the workers on {self.node} failed",
                WorkerState.FAILED,
            )
        info = self._thread.call(self._rdzv.next_round())
        self._round, self._waiting = info, 0
        self._thread.loop.call_soon_threadsafe(
            self._note,
            RunStep(JobState.RUNNING, info.round),
            EventKind.RENDEZVOUS_COMPLETE,
            f"round {info.round}: {self.node} is group rank {info.group_rank} of "
            f"{info.group_world_size}, master {info.master_addr}:{info.master_port}",
            WorkerState.HEALTHY,
        )
        self._watch = self._thread.submit(self._follow(info.round))
        return info

    def num_nodes_waiting(self) -> int:
        return self._waiting

    def is_closed(self) -> bool:
        if self._closed_seen:
            return True
        state, _, _, _ = self._thread.call(self._rdzv.snapshot())
        return state.closed

    def set_closed(self) -> None:
        self._thread.call(self._rdzv.close())
        self._closed_seen = True

    def shutdown(self, close: bool = True, failure: str | None = None) -> None:
        """Record the end (``failure``: why it failed; None: it succeeded), close the
        rendezvous (``close``), give up the lease, stop the thread. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._stop_watch()
        try:
            if close:
                self._thread.call(self._rdzv.close())
        finally:
            if self._registered:
                ended = JobState.SUCCEEDED if failure is None else JobState.FAILED
                self._thread.loop.call_soon_threadsafe(
                    self._note,
                    RunStep(ended, reason=failure),
                    None,
                    "",
                    WorkerState.SUCCEEDED if failure is None else WorkerState.FAILED,
                )
            self._thread.call(self._close_store())
            self._thread.stop()

    async def _close_store(self) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_RECORD_DRAIN):
                await self._notes.join()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._lease_id is not None:
            with contextlib.suppress(StoreError):
                await self._store.revoke(self._lease_id)  # our presence key goes at once
            self._lease_id = None
        await self._store.close()


# -- torch's side ----------------------------------------------------------------------


def _failure_reason(exc: BaseException) -> str:
    """One line on why torchrun ended with ``exc``."""
    first_failure = getattr(exc, "get_first_failure", None)  # torch's ChildFailedError
    if first_failure is not None:
        try:
            rank, failure = first_failure()
            return f"the workers failed: rank {rank} exited with code {failure.exitcode}"
        except Exception:  # torch's internals changed: fall back to the message
            pass
    lines = str(exc).strip().splitlines()
    first = next((line.strip() for line in lines if line.strip()), "")
    return f"{type(exc).__name__}: {first}"[:500] if first else type(exc).__name__


_handler_cls: Any = None
_cls_lock = threading.Lock()


def _torch_handler_class() -> Any:
    """Build (once) the subclass of torch's ``RendezvousHandler``; imports torch."""
    global _handler_cls
    with _cls_lock:
        if _handler_cls is not None:
            return _handler_cls
        # Typed as Any whether torch's own annotations are installed or not.
        rapi: Any = importlib.import_module("torch.distributed.elastic.rendezvous.api")

        from elasticd.worker.store import ClusterStoreClient, torch_store

        def translate(exc: Exception) -> Any:
            """elasticd's rendezvous errors as torch's (the agent handles those)."""
            if isinstance(exc, RendezvousClosed):
                return rapi.RendezvousClosedError(str(exc))
            if isinstance(exc, RendezvousTimeout):
                return rapi.RendezvousTimeoutError(str(exc))
            if isinstance(exc, StoreError):
                return rapi.RendezvousConnectionError(str(exc))
            return rapi.RendezvousStateError(str(exc))

        base: Any = rapi.RendezvousHandler

        class ElasticdRendezvousHandler(base):  # type: ignore[misc]
            """torch's handler interface over :class:`TorchrunRendezvous`."""

            def __init__(self, core: TorchrunRendezvous) -> None:
                self._core = core
                self._client: ClusterStoreClient | None = None

            def get_backend(self) -> str:
                return BACKEND

            @property
            def use_agent_store(self) -> bool:
                return False

            def next_rendezvous(self) -> Any:
                try:
                    info = self._core.next_round()
                except (RendezvousError, StoreError) as exc:
                    raise translate(exc) from exc
                config = self._core.config
                if self._client is not None:
                    self._client.close()
                self._client = ClusterStoreClient(
                    config.url,
                    self._core.token,
                    torchrun_store_prefix(config.run_id, info.round),
                    timeout=config.store_timeout,
                )
                store = torch_store(self._client, timeout=config.store_timeout)
                bootstrap = rapi.RendezvousStoreInfo(info.master_addr, info.master_port)
                return rapi.RendezvousInfo(store, info.group_rank, info.group_world_size, bootstrap)

            def is_closed(self) -> bool:
                try:
                    return self._core.is_closed()
                except StoreError as exc:
                    raise translate(exc) from exc

            def set_closed(self) -> None:
                try:
                    self._core.set_closed()
                except (RendezvousError, StoreError) as exc:
                    raise translate(exc) from exc

            def num_nodes_waiting(self) -> int:
                return self._core.num_nodes_waiting()

            def get_run_id(self) -> str:
                return self._core.config.run_id

            def shutdown(self) -> bool:
                # torch's launcher calls this in a ``finally``: an exception on its way
                # out (ChildFailedError: the workers failed) means the run failed.
                exc = sys.exc_info()[1]
                failure = None if exc is None else _failure_reason(exc)
                try:
                    self._core.shutdown(failure=failure)
                except (RendezvousError, StoreError) as exc:
                    log.warning("closing the rendezvous of %s failed: %s", self.get_run_id(), exc)
                    return False
                finally:
                    if self._client is not None:
                        self._client.close()
                        self._client = None
                return True

        _handler_cls = ElasticdRendezvousHandler
        return _handler_cls


def _command_spec(config: BackendConfig) -> JobSpec:
    """What this torchrun runs, read from its command line by torch's own parser.

    Only when this process is torchrun (``torchrun`` or ``python -m
    torch.distributed.run``); a program that calls torch's launcher itself
    is shown by its own command line with the spec's defaults.
    """
    argv = list(sys.argv)
    name = os.path.basename(argv[0]) if argv else ""
    if name != "torchrun" and not (
        argv and argv[0].endswith(os.path.join("distributed", "run.py"))
    ):
        return run_spec(config, [name, *argv[1:]])
    try:
        run: Any = importlib.import_module("torch.distributed.run")
        args, _ = run.get_args_parser().parse_known_args(argv[1:])
        return run_spec(
            config,
            ["torchrun", *argv[1:]],
            nproc_per_node=int(run.determine_local_world_size(args.nproc_per_node)),
            max_restarts=int(args.max_restarts),
            role=str(args.role),
        )
    except (Exception, SystemExit):  # argparse exits on what it cannot parse
        return run_spec(config, ["torchrun", *argv[1:]])


def _create(params: Any) -> Any:
    """torch's handler creator: ``RendezvousParameters`` -> handler."""
    config = backend_config(
        endpoint=params.endpoint,
        run_id=params.run_id,
        min_nodes=params.min_nodes,
        max_nodes=params.max_nodes,
        local_addr=params.local_addr,
        conf=params.config,
        environ=os.environ,
    )
    core = TorchrunRendezvous(config, spec=_command_spec(config))
    return _torch_handler_class()(core)


def create_handler() -> Callable[[Any], Any]:
    """The ``torchrun.handlers`` entry point: torch calls it and registers the creator."""
    return _create
