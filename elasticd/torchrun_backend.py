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
  with torch's c10d backend.
* The rendezvous options are torch's (``--rdzv-conf join_timeout=...,
  last_call_timeout=...``, torch's defaults 600 and 30 s); a re-formation
  after a failure completes as soon as every live node is back, without the
  last call. :meth:`shutdown` closes the rendezvous, as torch's handler does:
  a run id is used once (choose a fresh ``--rdzv-id`` per run).

What it does not do: it does not make a job document, so the run is not in
``GET /jobs``; its rendezvous document is at ``rdzv/<run id>/m/state`` in
the store (``GET /store/kv?key=...``). See the README's compatibility table.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import importlib
import logging
import os
import re
import secrets
import socket
import threading
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

from elasticd.errors import (
    LeaseNotFound,
    RendezvousClosed,
    RendezvousError,
    RendezvousTimeout,
    StoreError,
)
from elasticd.keys import torchrun_store_prefix
from elasticd.models import valid_job_id
from elasticd.rendezvous import Change, RoundInfo, Settings, StoreRendezvous
from elasticd.store import Store
from elasticd.store.http import HttpStore
from elasticd.tokens import read_token_file

__all__ = [
    "BACKEND",
    "BackendConfig",
    "TorchrunRendezvous",
    "backend_config",
    "create_handler",
    "endpoint_url",
    "node_name",
    "waiting_nodes",
]

log = logging.getLogger("elasticd.torchrun")

#: The name torchrun knows the backend by (``--rdzv-backend``).
BACKEND = "elasticd"
#: A daemon's default port, for an endpoint given without one.
DEFAULT_PORT = 7070
#: Pause between tries while the store cannot be reached during a watch.
_RETRY_FIRST, _RETRY_MAX = 0.05, 1.0

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
            return local
    except OSError:
        return socket.getfqdn()


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
    backend's own loop.
    """

    def __init__(
        self,
        config: BackendConfig,
        *,
        node: str | None = None,
        store: Callable[[], Store] | None = None,
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
        self._lease_id: int | None = None
        self._lease_lock: asyncio.Lock | None = None
        self._waiting = 0
        self._closed_seen = False
        self._round: int | None = None
        self._watch: concurrent.futures.Future[None] | None = None
        self._stopped = False
        self._thread = _LoopThread(f"elasticd-rdzv-{config.run_id}")
        try:
            self._store, self._rdzv, self._keeper = self._thread.call(self._open())
        except BaseException:
            self._thread.stop()
            raise

    async def _open(self) -> tuple[Store, StoreRendezvous, asyncio.Task[None]]:
        self._lease_lock = asyncio.Lock()
        store = self._make_store()
        rdzv = StoreRendezvous(
            store,
            self.config.run_id,
            node=self.node,
            role="default",
            local_world_size=1,
            advertise_addr=self.addr,
            settings=self.config.settings,
            lease=self._lease,
        )
        keeper = asyncio.create_task(self._keep_alive(store), name="elasticd-rdzv-keepalive")
        return store, rdzv, keeper

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

    # -- the watch on the round --------------------------------------------------

    async def _follow(self, my_round: int) -> None:
        """Wait for a reason to re-form ``my_round``; say "leaving" first, then record it."""
        pause = _RETRY_FIRST
        while True:
            try:
                change = await self._rdzv.wait_for_change(my_round)
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
        info = self._thread.call(self._rdzv.next_round())
        self._round, self._waiting = info.round, 0
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

    def shutdown(self, close: bool = True) -> None:
        """Close the rendezvous (``close``), give up the lease, stop the thread. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._stop_watch()
        try:
            if close:
                self._thread.call(self._rdzv.close())
        finally:
            self._thread.call(self._close_store())
            self._thread.stop()

    async def _close_store(self) -> None:
        self._keeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._keeper
        if self._lease_id is not None:
            with contextlib.suppress(StoreError):
                await self._store.revoke(self._lease_id)  # our presence key goes at once
            self._lease_id = None
        await self._store.close()


# -- torch's side ----------------------------------------------------------------------

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
                try:
                    self._core.shutdown()
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
    return _torch_handler_class()(TorchrunRendezvous(config))


def create_handler() -> Callable[[Any], Any]:
    """The ``torchrun.handlers`` entry point: torch calls it and registers the creator."""
    return _create
