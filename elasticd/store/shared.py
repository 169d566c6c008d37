"""Concurrent watches of one key share one request to a remote store.

A process that runs many agents of one job (a simulation of thousands of
nodes, or a daemon running several jobs' rendezvous) parks many long-polls
on the same few keys: every node of a rendezvous waits on the round's notice
key. Each long-poll holds a connection of its own for its whole wait, so ten
thousand waiters were ten thousand connections, past what a store server
accepts (``api.protocol.MAX_CONNECTIONS``). :class:`SharedWatches` lets them
share: a watch of ``(key, prefix)`` from revision ``after`` joins a request
already in flight for the same key from a revision at or below ``after``
(it cannot miss an event the later watch wants), and each watcher keeps only
the events above its own ``after``. A watcher whose share answered nothing
for it (the events were at or below its ``after``, or the request's own
timeout came first) asks again for the time it has left, so sharing never
changes what :meth:`~elasticd.store.base.Store.watch` returns, only how many
requests carry it. The request is cancelled when its last watcher leaves.

:class:`Gate` bounds the other requests a client has in flight (each holds a
connection), and lets identical reads that wait for a turn share one
request: one that has not been sent yet answers as of a moment after every
sharer called, as its own would have.
"""

from __future__ import annotations

import asyncio
import builtins
import time
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from typing import Any, TypeVar

from elasticd.store.base import WatchEvent

T = TypeVar("T")

Watch = Callable[[str, int, float, bool], Awaitable[builtins.list[WatchEvent]]]


@dataclass
class _Request:
    after: int
    task: asyncio.Future[builtins.list[WatchEvent]]
    watchers: int = 0


class SharedWatches:
    """Coalesces concurrent watches of the same key (see the module docstring)."""

    def __init__(self, watch: Watch) -> None:
        self._watch = watch
        self._requests: dict[tuple[str, bool], _Request] = {}

    async def watch(
        self, key: str, after: int, timeout: float, prefix: bool
    ) -> builtins.list[WatchEvent]:
        deadline = time.monotonic() + max(timeout, 0.0)
        slot = (key, prefix)
        while True:
            left = max(deadline - time.monotonic(), 0.0)
            request = self._requests.get(slot)
            if request is None or request.task.done() or request.after > after:
                # None to join, or it could miss what we want: a new one, from our
                # revision, which later watchers join (the one in flight runs on).
                request = self._start(key, after, left, prefix)
            request.watchers += 1
            try:
                async with asyncio.timeout(left if left > 0 else None):
                    events = await asyncio.shield(request.task)
            except TimeoutError:
                return []
            finally:
                request.watchers -= 1
                if request.watchers == 0 and not request.task.done():
                    request.task.cancel()
                    self._forget(slot, request)
            mine = [e for e in events if e.revision > after]
            if mine or deadline - time.monotonic() <= 0:
                return mine
            if events:
                # The answer held every change up to its last one and none was ours:
                # ask from there, with the watchers that already have (it converges).
                after = max(after, events[-1].revision)

    def _start(self, key: str, after: int, timeout: float, prefix: bool) -> _Request:
        slot = (key, prefix)
        task = asyncio.ensure_future(self._watch(key, after, timeout, prefix))
        request = _Request(after=after, task=task)
        self._requests[slot] = request
        task.add_done_callback(lambda _: self._forget(slot, request))
        # A cancelled or failed request nobody awaits must not log "never retrieved".
        task.add_done_callback(_consume)
        return request

    def _forget(self, slot: tuple[str, bool], request: _Request) -> None:
        if self._requests.get(slot) is request:
            del self._requests[slot]


def _consume(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


class _LeaderGone(Exception):
    """The read a caller waited on was cancelled before it was sent: ask again."""


class Gate:
    """At most ``limit`` requests in flight; identical reads waiting for a turn share one.

    Sharing a read is safe only while it has not been sent: its answer then
    reflects the store at some moment after every sharer made its call, as
    if each had sent its own. A read already sent is never joined.
    """

    def __init__(self, limit: int) -> None:
        self._turns = asyncio.Semaphore(limit)
        self._waiting: dict[Hashable, asyncio.Future[Any]] = {}

    async def run(self, call: Callable[[], Awaitable[T]]) -> T:
        """``call()`` once a turn is free."""
        async with self._turns:
            return await call()

    async def read(self, slot: Hashable, call: Callable[[], Awaitable[T]]) -> T:
        """``call()`` once a turn is free, shared with identical reads queued meanwhile."""
        while (waiting := self._waiting.get(slot)) is not None:
            try:
                result: T = await asyncio.shield(waiting)
                return result
            except _LeaderGone:
                continue
        mine: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        mine.add_done_callback(_consume)
        self._waiting[slot] = mine
        try:
            async with self._turns:
                if self._waiting.get(slot) is mine:
                    del self._waiting[slot]  # about to be sent: later reads ask again
                result = await call()
        except BaseException as exc:
            if self._waiting.get(slot) is mine:
                del self._waiting[slot]
            if not mine.done():
                gone = isinstance(exc, asyncio.CancelledError)
                mine.set_exception(_LeaderGone() if gone else exc)
            raise
        mine.set_result(result)
        return result
