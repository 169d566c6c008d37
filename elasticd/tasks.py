"""Structured concurrency helpers: no task outlives the code that started it.

:func:`race` runs awaitables side by side and returns the first result; the
others are cancelled *and awaited* before it returns, so their clean-up (a
watch closed, a timer dropped, a sub-task cancelled) is done before the
caller acts on the winner, and nothing is left running behind it. If the
race itself is cancelled, every contender is cancelled and awaited first.
It replaces the hand-written ``asyncio.wait(..., FIRST_COMPLETED)`` blocks,
which cancelled the losers without waiting for them.

Which side of the boundary: the daemon (and the launcher); no IO.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any, TypeVar

__all__ = ["cancel_and_wait", "race"]

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
