"""A virtual-time event loop: time moves only when nothing is ready to run.

The simulation runs the project's real async code on it. Every timer (a
watch's timeout, a lease's expiry, a sleep) fires in virtual time, so an hour
of a cluster's life takes as long as its callbacks do, and one seed replays the
same callbacks in the same order.

The loop is asyncio's own selector loop with one change: its selector never
blocks. When asyncio would wait ``timeout`` seconds for the next timer, the
selector moves the clock by ``timeout`` instead. No descriptor is polled: the
simulated code does no IO (no threads, no signals reach this loop).
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class Deadlock(RuntimeError):
    """Nothing is ready and no timer is set: the simulated world can never move again."""


class _VirtualSelector(selectors.DefaultSelector):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0

    def select(self, timeout: float | None = None) -> list[Any]:
        # Nothing simulated waits on a descriptor (the loop's self-pipe serves only
        # threads and signals), so no poll is made: time simply moves to the next timer.
        if timeout is None:
            raise Deadlock("no task is ready and no timer is set")
        self.now += max(timeout, 0.0)
        return []


class VirtualLoop(asyncio.SelectorEventLoop):
    """An event loop whose ``time()`` is virtual (see the module docstring)."""

    def __init__(self) -> None:
        self._virtual = _VirtualSelector()
        super().__init__(self._virtual)

    def time(self) -> float:
        return self._virtual.now


def run_virtual(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to its end on a fresh :class:`VirtualLoop`, then close the loop."""
    loop = VirtualLoop()
    try:
        return loop.run_until_complete(main)
    finally:
        try:
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()
