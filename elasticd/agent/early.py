"""A round's formation, with the early restart: workers started before the store says so.

When the machine planned an early restart (:class:`elasticd.agent.machine.AgentState`
``early``: this node alone failed a round it can predict), the workers of the
next round start at once while the store forms that round in the background;
the round the store forms then confirms them or not. Unconfirmed workers run
without a round watch, so their wait for the store is bounded like a node
that loses the store (``fence_after``): past it they are stopped, and the
round's own start starts them again once the store answers.

:class:`Formation` owns that background store work (cancelled with the agent);
the agent hands in how to form a round, start workers early and stop them.

Which side of the boundary: the daemon; it reads the store and the rendezvous.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from elasticd.clock import Clock
from elasticd.errors import WorkerSpawnError
from elasticd.models import Job
from elasticd.rendezvous import RoundInfo
from elasticd.tasks import cancel_and_wait

__all__ = ["Formation", "Formed"]

log = logging.getLogger("elasticd.agent")

#: Forms the round (the rendezvous, then the last failure charged): round, job, when.
FormRound = Callable[..., Coroutine[Any, Any, tuple[RoundInfo, Job, float]]]


@dataclass(frozen=True)
class Formed:
    """A formed round and what the early start did before it."""

    round: RoundInfo
    job: Job
    #: When the round formed (wall time).
    formed_at: float
    #: Workers were started early and still run.
    started: bool
    #: They run as this very round's (the store formed the round they predicted).
    confirmed: bool
    #: When they were started (wall time; None: not started early).
    spawned_at: float | None


class Formation:
    """Forms each round of one agent, starting the workers early when the machine says so."""

    def __init__(
        self,
        job_id: str,
        node: str,
        clock: Clock,
        fence_after: float,
        form: FormRound,
        launch_early: Callable[[RoundInfo, int], Awaitable[None]],
        stop_early: Callable[[], Awaitable[None]],
    ) -> None:
        self._who = (job_id, node)
        self._clock = clock
        self._fence_after = fence_after
        self._form = form
        self._launch_early = launch_early
        self._stop_early = stop_early
        #: The store work of an early restart while it runs (cancelled with the agent).
        self._task: asyncio.Task[tuple[RoundInfo, Job, float]] | None = None

    async def next(self, early: RoundInfo | None, count: int) -> Formed:
        """The next round; ``early``, the predicted one, with its restart ``count``:
        its workers start now. Raises what forming a round raises."""
        if early is None:
            round_, job, formed_at = await self._form()
            return Formed(round_, job, formed_at, started=False, confirmed=False, spawned_at=None)
        store = self._task = asyncio.create_task(self._form(port=early.master_port))
        started = await self._launch(early, count, store)
        spawned_at = self._clock.time() if started else None
        if started and not await self._answers_in_time(store):
            log.warning(
                "job %s on %s: the store is slow; stopping the early workers until it "
                "forms the round",
                *self._who,
            )
            await self._stop_early()
            started, spawned_at = False, None
        round_, job, formed_at = await store
        self._task = None
        confirmed = round_ == early and job.restart_count == count
        if started and not confirmed:
            log.info("job %s on %s: the early start did not match the round", *self._who)
            spawned_at = None
        return Formed(round_, job, formed_at, started, confirmed, spawned_at)

    async def cancel(self) -> None:
        """Stop the store work of an early restart, if it still runs."""
        task, self._task = self._task, None
        if task is not None and not task.done():  # a done one was awaited where it ended
            await cancel_and_wait(task)

    async def _launch(
        self, round_: RoundInfo, count: int, store: asyncio.Task[tuple[RoundInfo, Job, float]]
    ) -> bool:
        """Start the predicted round's workers; False when they could not be started:
        the round's own start (after the store) tries again and reports the error."""
        try:
            await self._launch_early(round_, count)
        except WorkerSpawnError as exc:
            log.info("job %s: early start failed (%s); starting after the round", self._who[0], exc)
            return False
        except BaseException:
            await cancel_and_wait(store)
            raise
        return True

    async def _answers_in_time(self, store: asyncio.Task[tuple[RoundInfo, Job, float]]) -> bool:
        """Unconfirmed workers run without a round watch: bounded, like a node that loses
        the store (``fence_after``), they stop when it is slow to form the round."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._fence_after):
                await asyncio.shield(store)
        return store.done()
