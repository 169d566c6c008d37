"""Structured concurrency helpers: no task outlives the code that started it.

:func:`race` runs awaitables side by side and returns the first result; the
others are cancelled *and awaited* before it returns, so their clean-up (a
watch closed, a timer dropped, a sub-task cancelled) is done before the
caller acts on the winner, and nothing is left running behind it. If the
race itself is cancelled, every contender is cancelled and awaited first.
It replaces the hand-written ``asyncio.wait(..., FIRST_COMPLETED)`` blocks,
which cancelled the losers without waiting for them.

:class:`TaskSet` is the owner of background work that nobody awaits at the
call site (publishing a slot count, recording a refusal, telling peers a
rank died): it keeps a reference to each task (an unreferenced task may be
collected mid-way), logs a failure instead of losing it, and
:meth:`TaskSet.aclose` cancels and awaits what is left, so the owner's
shutdown leaves nothing behind.

Which side of the boundary: the daemon (and the launcher); no IO.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar

__all__ = ["TaskSet", "cancel_and_wait", "race"]

log = logging.getLogger("elasticd.tasks")

T = TypeVar("T")


async def cancel_and_wait(*tasks: asyncio.Future[Any]) -> None:
    """Cancel ``tasks`` and wait until each has ended; their results and errors are dropped.

    A failure other than the cancellation is logged, never lost silently.
    Shielded from the caller's own cancellation: the wait completes (the
    tasks are already cancelled, so it is short), then the cancellation is
    delivered.
    """
    for task in tasks:
        task.cancel()
    if not tasks:
        return
    gathered = asyncio.gather(*tasks, return_exceptions=True)
    try:
        results = await asyncio.shield(gathered)
    except asyncio.CancelledError:
        await gathered
        raise
    for result in results:
        if isinstance(result, Exception) and not isinstance(result, asyncio.CancelledError):
            log.debug("a cancelled contender had failed: %r", result)


async def race(*contenders: Awaitable[T]) -> tuple[int, T]:
    """The first of ``contenders`` to finish: ``(its index, its result)``.

    The losers are cancelled and awaited before this returns. When several
    finish in the same step, the lowest index wins (list the outcome that
    must take precedence first). The winner's exception is raised as its
    result would be returned.
    """
    tasks = [asyncio.ensure_future(c) for c in contenders]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        await cancel_and_wait(*tasks)
        raise
    index = next(i for i, task in enumerate(tasks) if task.done())
    await cancel_and_wait(*(t for i, t in enumerate(tasks) if i != index))
    return index, tasks[index].result()


class TaskSet:
    """Background tasks with one owner; see the module."""

    def __init__(self, owner: str) -> None:
        self._owner = owner
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False

    def spawn(
        self, coro: Coroutine[Any, Any, Any], name: str | None = None
    ) -> asyncio.Task[Any] | None:
        """Run ``coro`` in the background, owned by this set (dropped, None, once closed)."""
        if self._closed:
            coro.close()  # the owner is stopping: never a task that would outlive it
            log.debug("%s: closed; %s not started", self._owner, name or "a background task")
            return None
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.warning("%s: background task %s failed: %r", self._owner, task.get_name(), exc)

    def __len__(self) -> int:
        return len(self._tasks)

    async def aclose(self, grace: float = 0.0) -> None:
        """Let the tasks finish for up to ``grace`` seconds, then cancel and await the rest."""
        self._closed = True
        if grace > 0 and self._tasks:
            await asyncio.wait(set(self._tasks), timeout=grace)
        await cancel_and_wait(*self._tasks)
