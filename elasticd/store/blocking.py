"""The synchronous facade of the one store client, for code that cannot await.

:class:`BlockingStore` is :class:`~elasticd.store.http.HttpStore` for a
synchronous caller (the workers' torch store, :mod:`elasticd.worker.store`):
each method runs the async client's own on a private event loop in a daemon
thread (:class:`LoopThread`) and blocks until it returns. Nothing of the
client is copied: requests, answers, errors, retries and the keep-alive pool
are the async client's, so the two cannot drift apart (as httpx's ``Client``
and ``AsyncClient`` share one request builder).

Why a thread and not ``asyncio.run`` per call: one loop keeps the pool's
connections alive between calls, costs a thread hand-off (tens of
microseconds) instead of a loop's start and a new connection per call, and
lets any number of threads share one client. The facade is safe to share
between threads; a call made from its own loop thread would deadlock and is
refused. After a ``fork`` the child gets a fresh loop and client on its first
call (a thread does not survive a fork; the parent's connections are not the
child's to use).

Standard library plus the client (no httpx for ``http://``): workers import it.
"""

from __future__ import annotations

import asyncio
import builtins
import concurrent.futures
import os
import threading
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from elasticd.errors import StoreUnavailable
from elasticd.store.base import CasResult, Entry, Listing, WatchEvent
from elasticd.store.http import FAIL_FAST, HttpStore, Retry

T = TypeVar("T")

__all__ = ["BlockingStore", "LoopThread"]


class LoopThread:
    """A private event loop in a daemon thread; synchronous callers block on it."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and wait for it; an interrupted wait cancels it."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("a blocking call from the loop's own thread would never return")
        future = self.submit(coro)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # e.g. KeyboardInterrupt: the request must not run on unseen
            raise

    def stop(self) -> None:
        """Cancel what still runs (its callers see ``concurrent.futures.CancelledError``)
        and stop the loop and its thread."""
        if self.loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(_cancel_the_rest(), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


async def _cancel_the_rest() -> None:
    tasks = asyncio.all_tasks() - {asyncio.current_task()}
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class BlockingStore:
    """:class:`HttpStore`'s operations, blocking; same arguments, answers and errors.

    ``retry`` is the caller's choice (see :class:`~elasticd.store.http.Retry`).
    The loop thread starts with the first call; :meth:`close` stops it.
    """

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        *,
        timeout: float = 10.0,
        retry: Retry = FAIL_FAST,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._make: Callable[[], HttpStore] = lambda: HttpStore(
            base_url, token, timeout=timeout, retry=retry
        )
        self._lock = threading.Lock()
        self._pid = 0
        #: The loop thread and the client on it, made by the first call in this process.
        self._running: tuple[LoopThread, HttpStore] | None = None
        self._closed = False

    def __repr__(self) -> str:
        return f"BlockingStore({self.base_url!r})"

    def _run(self, call: Callable[[HttpStore], Coroutine[Any, Any, T]]) -> T:
        with self._lock:
            if self._closed:
                raise StoreUnavailable(f"the client of the store at {self.base_url} is closed")
            if self._running is None or self._pid != os.getpid():  # first call (in a child)
                self._pid = os.getpid()
                self._running = (LoopThread(f"elasticd-store-{self._pid}"), self._make())
            thread, store = self._running
        try:
            return thread.call(call(store))
        except concurrent.futures.CancelledError:  # closed by another thread meanwhile
            raise StoreUnavailable(
                f"the client of the store at {self.base_url} was closed during the call"
            ) from None

    def get(self, key: str) -> Entry | None:
        return self._run(lambda s: s.get(key))

    def put(self, key: str, value: bytes, *, lease: int | None = None) -> Entry:
        return self._run(lambda s: s.put(key, value, lease=lease))

    def put_batch(self, items: Sequence[tuple[str, bytes]]) -> builtins.list[Entry]:
        return self._run(lambda s: s.put_batch(items))

    def compare_and_set(
        self, key: str, value: bytes, expected_version: int | None, *, lease: int | None = None
    ) -> CasResult:
        return self._run(lambda s: s.compare_and_set(key, value, expected_version, lease=lease))

    def add(self, key: str, delta: int = 1) -> int:
        return self._run(lambda s: s.add(key, delta))

    def delete(self, key: str, expected_version: int | None = None) -> bool:
        return self._run(lambda s: s.delete(key, expected_version))

    def list(self, prefix: str) -> Listing:
        return self._run(lambda s: s.list(prefix))

    def watch(
        self, key: str, after_version: int, timeout: float, *, prefix: bool = False
    ) -> builtins.list[WatchEvent]:
        return self._run(lambda s: s.watch(key, after_version, timeout, prefix=prefix))

    def grant(self, ttl: float) -> int:
        return self._run(lambda s: s.grant(ttl))

    def keep_alive(self, lease: int) -> None:
        self._run(lambda s: s.keep_alive(lease))

    def revoke(self, lease: int) -> None:
        self._run(lambda s: s.revoke(lease))

    def close(self) -> None:
        """Close the client and stop its thread; later calls raise StoreUnavailable."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            running, self._running = self._running, None
        if running is not None and self._pid == os.getpid():
            thread, store = running
            thread.call(store.close())
            thread.stop()

    def __enter__(self) -> BlockingStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
