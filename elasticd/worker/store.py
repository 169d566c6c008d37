"""A ``torch.distributed.Store`` backed by the cluster store, reached through the daemon.

Why not a ``TCPStore``: torchrun's store is hosted by rank 0 (or the agent);
when that process dies the store dies with it, and the survivors cannot even
agree that they should restart. This store lives in the daemon's cluster
store (embedded or etcd), so it outlives every rank; that is what in-process
restart (:mod:`elasticd.inprocess`) coordinates through.

Two layers:

* :class:`ClusterStoreClient` — torch-free and synchronous (safe to share
  between threads). It reaches the daemon's ``/store`` API through the one
  store client, :class:`elasticd.store.http.HttpStore`, by its synchronous
  facade :class:`elasticd.store.blocking.BlockingStore` with the workers'
  retry (:data:`elasticd.store.http.RIDE_OUT`) and the bearer token read
  from ``ELASTICD_TOKEN_FILE``, and implements torch's store semantics:
  ``get`` and ``wait`` block until the key exists, by *watching* the key
  (a long-poll answered when the key is written), never by sleeping and
  re-reading; ``compare_set`` is torch's, built on the cluster store's
  compare-and-set on a version; ``add`` is the store's atomic counter.
* :func:`torch_store` — a Python subclass of ``torch.distributed.Store`` that
  forwards to the client (torch calls Python store methods through its
  trampoline). torch 2.13 accepts it for ``init_process_group(store=...)``
  with gloo, also wrapped in ``PrefixStore``.

Keys are namespaced: by default ``jobs/<job>/torch/<attempt>/`` where
``<attempt>`` is ``ELASTICD_ATTEMPT`` when the daemon sets it, else
``restart<TORCHELASTIC_RESTART_COUNT>``, so a restarted group never sees the
keys of the previous one. A torch key is escaped so that any string is a
valid store key (``%``-quoting, ``/`` kept; ``.`` and ``..`` segments quoted).

Values are bytes in and out; nothing is ever unpickled. A failure to reach
the daemon (or its 503) is retried with backoff until the operation's
deadline (the daemon may be restarting), then raised, like any other store
error, as :class:`StoreUnreachable`; a wait
that passes its timeout raises :class:`TimeoutError` (torch's adapter turns
both into ``torch.distributed.DistStoreError``).
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from elasticd.errors import StoreError
from elasticd.store.base import Entry, WatchEvent
from elasticd.store.blocking import BlockingStore
from elasticd.store.http import RIDE_OUT
from elasticd.tokens import TokenFileError, read_token_file
from elasticd.worker.names import attempt_tag, default_namespace, escape_key

T = TypeVar("T")

__all__ = [
    "ClusterStoreClient",
    "Entry",
    "StoreUnreachable",
    "WatchEvent",
    "attempt_tag",
    "default_namespace",
    "escape_key",
    "torch_store",
]

#: Longest single long-poll; a longer wait is several polls.
MAX_POLL_SECONDS = 60.0


class StoreUnreachable(RuntimeError):
    """The daemon's store API could not be reached, refused us, or answered nonsense."""


class ClusterStoreClient:
    """Blocking access to the cluster store under ``namespace``, through the daemon.

    ``timeout`` is torch's store timeout: the longest a ``get``/``wait``
    blocks, and how long an unreachable daemon is retried.
    """

    def __init__(
        self,
        base_url: str,
        token: str | None,
        namespace: str,
        *,
        timeout: float = 300.0,
        request_timeout: float = 10.0,
    ) -> None:
        if namespace and not namespace.endswith("/"):
            namespace += "/"
        self.base_url = base_url.rstrip("/")
        self.namespace = namespace
        self.timeout = timeout
        self._store = BlockingStore(
            base_url,
            token,
            timeout=request_timeout,
            retry=replace(RIDE_OUT, patience=timeout),
        )

    @classmethod
    def from_env(
        cls,
        namespace: str | None = None,
        *,
        timeout: float = 300.0,
        environ: Mapping[str, str] | None = None,
    ) -> ClusterStoreClient:
        """The client for this worker: ``ELASTICD_URL``, the token in ``ELASTICD_TOKEN_FILE``."""
        env = os.environ if environ is None else environ
        url = env.get("ELASTICD_URL")
        if not url:
            raise StoreUnreachable(
                "ELASTICD_URL is not set: the cluster store is only available to workers "
                "started by elasticd"
            )
        token = None
        token_file = env.get("ELASTICD_TOKEN_FILE")
        if token_file:
            try:
                token = read_token_file(token_file, what="ELASTICD_TOKEN_FILE")
            except TokenFileError as exc:
                raise StoreUnreachable(str(exc)) from None
        ns = default_namespace(env) if namespace is None else namespace
        return cls(url, token, ns, timeout=timeout)

    def __repr__(self) -> str:
        return f"ClusterStoreClient({self.base_url!r}, namespace={self.namespace!r})"

    def close(self) -> None:
        """Close the connections; later calls raise :class:`StoreUnreachable`."""
        self._store.close()

    def __enter__(self) -> ClusterStoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- keys ------------------------------------------------------------------

    def full_key(self, key: str) -> str:
        """The store key that holds ``key`` (escaped, under the namespace)."""
        return self.namespace + escape_key(key)

    def _do(self, call: Callable[[BlockingStore], T]) -> T:
        """``call`` on the store client; its errors as :class:`StoreUnreachable`."""
        try:
            return call(self._store)
        except StoreError as exc:
            raise StoreUnreachable(str(exc)) from exc

    # -- raw operations on full keys ---------------------------------------------

    def read(self, full_key: str) -> Entry | None:
        """The entry at ``full_key`` (not namespaced), or None."""
        return self._do(lambda s: s.get(full_key))

    def write(self, full_key: str, value: bytes) -> int:
        """Write ``full_key`` (not namespaced); return the new version."""
        return self._do(lambda s: s.put(full_key, value)).version

    def create(self, full_key: str, value: bytes) -> bool:
        """Create ``full_key`` only if it is absent; True if this call created it."""
        return self._do(lambda s: s.compare_and_set(full_key, value, None)).ok

    def listing(self, prefix: str) -> tuple[list[Entry], int]:
        """The entries under ``prefix`` (not namespaced) and the revision they were read at."""
        result = self._do(lambda s: s.list(prefix))
        return list(result.entries), result.revision

    def watch(
        self, key: str, after: int, timeout: float, *, prefix: bool = False
    ) -> list[WatchEvent]:
        """Changes to ``key`` (or under it) above revision ``after``; [] at the timeout.

        A compacted history answers ``[]`` too: the caller re-reads anyway.
        """
        poll = max(0.0, min(timeout, MAX_POLL_SECONDS))
        return self._do(lambda s: s.watch(key, after, poll, prefix=prefix))

    def wait_for(self, full_key: str, timeout: float | None = None) -> bytes:
        """Block until ``full_key`` (not namespaced) exists; return its value.

        Reads once; if absent, watches the key from the revision of that read,
        so a write in between is never missed.
        """
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        entry = self.read(full_key)
        if entry is not None:
            return entry.value
        while True:
            entries, revision = self.listing(full_key)
            for e in entries:
                if e.key == full_key:
                    return e.value
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"key {full_key!r} did not appear within {limit:g} s")
            for event in self.watch(full_key, revision, remaining):
                if event.kind == "put" and event.key == full_key and event.value is not None:
                    return event.value

    # -- torch's store semantics, on namespaced keys ------------------------------

    def set(self, key: str, value: bytes) -> None:
        """Write ``key``."""
        self.write(self.full_key(key), value)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        """The value of ``key``, waiting up to ``timeout`` (default: the store's) for it."""
        return self.wait_for(self.full_key(key), timeout)

    def get_now(self, key: str) -> bytes | None:
        """The value of ``key`` if it exists now, without waiting."""
        entry = self.read(self.full_key(key))
        return entry.value if entry is not None else None

    def add(self, key: str, delta: int) -> int:
        """Atomically add ``delta`` to the counter ``key`` (absent = 0); the new value."""
        return self._do(lambda s: s.add(self.full_key(key), delta))

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """torch's compare_set: set ``desired`` if the value is ``expected``; the value after.

        As torch's TCPStore: an absent key counts as ``b""`` for ``expected``;
        when absent and ``expected`` is not empty, ``expected`` is returned.
        """
        full = self.full_key(key)
        while True:
            entry = self.read(full)
            if entry is None:
                if expected:
                    return expected
                version: int | None = None
            elif entry.value != expected:
                return entry.value
            else:
                version = entry.version
            on = version  # this pass's version, bound now
            if self._do(lambda s: s.compare_and_set(full, desired, on)).ok:  # noqa: B023
                return desired
            # Lost a race: decide again on the winner's value.

    def delete(self, key: str) -> bool:
        """Delete ``key``; True if it existed."""
        return self._do(lambda s: s.delete(self.full_key(key)))

    def check(self, keys: Sequence[str]) -> bool:
        """Whether every key exists now."""
        return all(self.read(self.full_key(k)) is not None for k in keys)

    def wait(self, keys: Sequence[str], timeout: float | None = None) -> None:
        """Block until every key exists, or raise TimeoutError."""
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        for k in keys:
            remaining = deadline - time.monotonic()
            self.wait_for(self.full_key(k), max(remaining, 0.0))

    def num_keys(self) -> int:
        """How many keys the namespace holds."""
        entries, _ = self.listing(self.namespace)
        return len(entries)


# -- the torch adapter -------------------------------------------------------------

_store_class: Any = None
_class_lock = threading.Lock()


def _seconds(timeout: Any, default: float) -> float:
    if timeout is None:
        return default
    is_delta = isinstance(timeout, datetime.timedelta)
    seconds = timeout.total_seconds() if is_delta else float(timeout)
    # torch passes a zero or negative timeout for "the store's default".
    return seconds if seconds > 0 else default


def _as_bytes(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    return bytes(value)  # a list of ints, as torch passes std::vector<uint8_t>


def _store_cls() -> Any:
    """Build (once) the ``torch.distributed.Store`` subclass; imports torch."""
    global _store_class
    with _class_lock:
        if _store_class is not None:
            return _store_class
        import torch.distributed as dist

        store_error: type[Exception] = getattr(dist, "DistStoreError", RuntimeError)

        class ClusterStore(dist.Store):  # type: ignore[misc, name-defined]
            """``torch.distributed.Store`` over :class:`ClusterStoreClient` (see module doc)."""

            def __init__(self, client: ClusterStoreClient) -> None:
                super().__init__()
                self.client = client

            def _fail(self, exc: Exception) -> Exception:
                return store_error(str(exc))

            def set(self, key: str, value: Any) -> None:
                try:
                    self.client.set(key, _as_bytes(value))
                except StoreUnreachable as exc:
                    raise self._fail(exc) from exc

            def get(self, key: str) -> bytes:
                try:
                    return self.client.get(key, _seconds(self.timeout, self.client.timeout))
                except (StoreUnreachable, TimeoutError) as exc:
                    raise self._fail(exc) from exc

            def add(self, key: str, value: int) -> int:
                try:
                    return self.client.add(key, int(value))
                except StoreUnreachable as exc:
                    raise self._fail(exc) from exc

            def compare_set(self, key: str, expected_value: Any, desired_value: Any) -> bytes:
                try:
                    return self.client.compare_set(
                        key, _as_bytes(expected_value), _as_bytes(desired_value)
                    )
                except StoreUnreachable as exc:
                    raise self._fail(exc) from exc

            def wait(self, keys: list[str], timeout: Any = None) -> None:
                default = _seconds(self.timeout, self.client.timeout)
                try:
                    self.client.wait(keys, _seconds(timeout, default))
                except (StoreUnreachable, TimeoutError) as exc:
                    raise self._fail(exc) from exc

            def check(self, keys: list[str]) -> bool:
                try:
                    return self.client.check(keys)
                except StoreUnreachable as exc:
                    raise self._fail(exc) from exc

            def delete_key(self, key: str) -> bool:
                try:
                    return self.client.delete(key)
                except StoreUnreachable as exc:
                    raise self._fail(exc) from exc

            def num_keys(self) -> int:
                try:
                    return self.client.num_keys()
                except StoreUnreachable as exc:
                    raise self._fail(exc) from exc

        _store_class = ClusterStore
        return _store_class


def torch_store(
    client: ClusterStoreClient | None = None,
    *,
    namespace: str | None = None,
    timeout: float = 300.0,
) -> Any:
    """A ``torch.distributed.Store`` over ``client`` (default: from this worker's environment)."""
    if client is None:
        client = ClusterStoreClient.from_env(namespace=namespace, timeout=timeout)
    store = _store_cls()(client)
    store.set_timeout(datetime.timedelta(seconds=timeout))
    return store
