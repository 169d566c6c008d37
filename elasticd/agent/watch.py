"""The agent's watches on the shared state: the round, the store's loss, the exit barrier.

* :meth:`RoundWatch.change` returns the rendezvous change that ends a round
  (closed, a new round, an arrival, a loss), or :attr:`Change.FENCED` once
  this node must fence itself: its lease may have lapsed (the node's own
  timer), or the round watch failed for ``fence_after`` seconds without a
  break (:class:`StoreLoss`).
* :meth:`RoundWatch.until_store_answers` probes the store, with backoff,
  until it answers again.
* :meth:`RoundWatch.exit_barrier` waits for every participant of a round to
  finish too (bounded by the job's ``exit_barrier_timeout``).

Nothing is polled that can be awaited: the store's watches and the lease's
timer are raced (:func:`elasticd.tasks.race`).

Which side of the boundary: the daemon; it reads the store and the rendezvous.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from elasticd.agent.context import Emit
from elasticd.agent.jobdoc import JobRecord
from elasticd.agent.ports import EventSink
from elasticd.clock import Clock
from elasticd.errors import ElasticdError, RendezvousError, StoreError
from elasticd.eventkinds import EventKind
from elasticd.keys import barrier_prefix
from elasticd.models import Job
from elasticd.rendezvous import Change, Rendezvous, RoundInfo
from elasticd.store import Store
from elasticd.tasks import TaskSet, cancel_and_wait, race

__all__ = ["Departure", "RoundWatch", "StoreLoss"]

#: Bound on the rendezvous steps of a stopping agent.
LEAVE_TIMEOUT = 5.0
#: Bound on the wait, after the workers are stopped, for the "leaving" write (best effort).
LEAVING_TIMEOUT = 2.0

log = logging.getLogger("elasticd.agent")


@dataclass
class StoreLoss:
    """How long the store has been out of reach *without a break*: the fencing decision.

    A node fences (stops its workers) only after ``fence_after`` seconds of
    continuous loss: every successful store request (:meth:`reached`) starts
    the count again, so two short hiccups far apart never add up.
    """

    fence_after: float
    since: float | None = None
    """Monotonic time of the first failure since the store was last reached."""
    backoff: float = 0.1
    """Seconds to wait before the next try."""

    def reached(self) -> None:
        """A store request succeeded."""
        self.since = None
        self.backoff = 0.1

    def failed(self, now: float) -> bool:
        """A store request failed at ``now``; True when the node must fence."""
        if self.since is None:
            self.since = now
            self.backoff = 0.1
        else:
            self.backoff = min(self.backoff * 2, 1.0)
        return now - self.since >= self.fence_after

    def lost_for(self, now: float) -> float:
        return 0.0 if self.since is None else now - self.since


@dataclass(frozen=True)
class RoundWatch:
    """One job's watches on this node (see the module)."""

    node: str
    job_id: str
    store: Store
    rendezvous: Rendezvous
    clock: Clock
    emit: Emit
    events: EventSink
    record: JobRecord
    fence_after: float
    """Seconds of failed round watches without a break after which the node fences."""
    lease_lapsed: Callable[[], Coroutine[Any, Any, float]] | None = None
    """Returns once the node's lease may have expired (None: only failed watches count)."""

    async def form(self, *, port: int | None = None) -> tuple[RoundInfo, Job, float]:
        """Rendezvous, then charge the last round's failure: (round, job, when it formed).

        Raises what :meth:`Rendezvous.next_round` raises (closed, timed out, the store).
        """
        started = self.clock.monotonic()
        round_ = await self.rendezvous.next_round(port=port)
        # The store served a whole rendezvous: an outage in progress is over (one event).
        self.events.store_back(self.job_id)
        names = sorted(round_.participants)
        who = ", ".join(names) if round_.roster_known else "nodes named in the round's roster"
        self.emit(
            EventKind.RENDEZVOUS_COMPLETE,
            f"round {round_.round}: {self.node} is group rank {round_.group_rank} of "
            f"{round_.group_world_size} ({who}), "
            f"master {round_.master_addr}:{round_.master_port}",
            duration_s=self.clock.monotonic() - started,
            source="rendezvous",
        )
        rendezvous_done = self.clock.time()
        if not round_.roster_known:
            # A large round's seat names no peers (O(1) bytes per node); settling a
            # failure of the last round compares its participants with this one's.
            pending = (await self.record.read()).pending_failure
            if pending is not None and pending.round < round_.round:
                round_ = await self.named(round_)
        return round_, await self.record.settle(round_), rendezvous_done

    async def change(self, my_round: int) -> Change:
        """The rendezvous change that ends this round.

        A store that stays unreachable for longer than the node's lease means
        the other nodes have declared this one dead and re-formed without it:
        the node fences itself (stops its workers) instead of letting them
        hang in a collective with peers that are gone.
        """
        if self.lease_lapsed is None:
            return await self._watch(my_round)
        # The node's lease is the truth the other nodes act on: once it may have
        # expired they re-form without this node, whatever the round watch says.
        # A watch can hang silently (a member cut off from quorum, a black hole),
        # so the lapse is awaited on its own timer, not inferred from watch errors.
        watch: Awaitable[Change | float] = self._watch(my_round)
        lapse: Awaitable[Change | float] = self.lease_lapsed()
        which, result = await race(watch, lapse)
        if which == 0:
            assert isinstance(result, Change)
            return result
        self.emit(
            EventKind.AGENT_FENCED,
            f"{self.node} lost the store for {result:.1f}s (no lease renewal got "
            "through for the lease TTL; the other nodes count it as gone); stopping its workers",
        )
        return Change.FENCED

    async def _watch(self, my_round: int) -> Change:
        """The round watch, fencing after ``fence_after`` seconds of failed watches."""
        loss = StoreLoss(self.fence_after)
        while True:
            try:
                return await self.rendezvous.wait_for_change(my_round, on_contact=loss.reached)
            except StoreError as exc:
                now = self.clock.monotonic()
                if loss.failed(now):
                    self.emit(
                        EventKind.AGENT_FENCED,
                        f"{self.node} lost the store for {loss.lost_for(now):.1f}s "
                        f"({exc}); stopping its workers",
                    )
                    return Change.FENCED
                log.warning("job %s: rendezvous watch failed: %s", self.job_id, exc)
                await asyncio.sleep(loss.backoff)  # back off while the store is unreachable

    async def outage(self, message: str, key: str) -> None:
        """``store.lost`` (once for the whole outage; the node says ``store.back`` for it,
        also when this agent is gone by then), then probe the store (a read of ``key``)
        with backoff (0.1 s to 2 s) until it answers."""
        self.emit.store_lost(
            f"{self.node} cannot reach the store ({message}); "
            "its workers are stopped until the store is back",
        )
        backoff = 0.1
        while True:
            await asyncio.sleep(backoff)
            try:
                await self.store.get(key)
                return
            except StoreError:
                backoff = min(backoff * 2, 2.0)

    async def named(self, round_: RoundInfo) -> RoundInfo:
        """``round_`` with every participant named, read only when needed (large rounds)."""
        if round_.roster_known:
            return round_
        try:
            return await self.rendezvous.roster(round_)
        except RendezvousError as exc:  # the roster is gone: callers fall back to counts
            log.info("%s: %s", self.job_id, exc)
            return round_

    async def exit_barrier(self, round_: RoundInfo, timeout: float) -> Change | None:
        """Wait for every participant of the round to finish too (up to ``timeout``).

        None: they did (or the wait timed out: ``exit_barrier.timeout``); else the
        rendezvous change that came first.
        """
        started = self.clock.monotonic()
        prefix = barrier_prefix(self.job_id, round_.round)
        await self.store.put(prefix + self.node, b"done")
        round_ = await self.named(round_)
        wanted = set(round_.participants)
        change_task = asyncio.create_task(self.rendezvous.wait_for_change(round_.round))
        watching: Awaitable[Change | list[Any]]
        try:
            async with asyncio.timeout(timeout):
                while True:
                    listing = await self.store.list(prefix)
                    done = {e.key[len(prefix) :] for e in listing.entries}
                    if wanted <= done and len(done) >= round_.group_world_size:
                        break
                    if change_task.done():
                        return change_task.result()
                    watching = self.store.watch(prefix, listing.revision, 30.0, prefix=True)
                    changing: Awaitable[Change | list[Any]] = asyncio.shield(change_task)
                    which, result = await race(changing, watching)
                    if which == 0:
                        assert isinstance(result, Change)
                        return result
        except TimeoutError:
            self.emit(
                EventKind.EXIT_BARRIER_TIMEOUT,
                f"not every node finished within {timeout}s; finishing anyway",
            )
        finally:
            await cancel_and_wait(change_task)
        self.emit(
            EventKind.EXIT_BARRIER_DONE,
            "every node of the round finished",
            duration_s=self.clock.monotonic() - started,
        )
        return None


@dataclass
class Departure:
    """This node's goodbyes to a round: "leaving" (it heads for the next round) and the leave.

    Both run as tasks of the agent's :class:`~elasticd.tasks.TaskSet`, bounded
    where the agent waits for them, so none outlives the agent.
    """

    job_id: str
    rendezvous: Rendezvous
    background: TaskSet
    leaving: asyncio.Task[None] | None = None

    def say_leaving(self, my_round: int) -> None:
        """Tell the other nodes, in the background, that this node heads for the next round.

        Said before the workers are stopped (which may take ``termination_grace``),
        so that a re-rendezvous waits for this node instead of presuming it dead
        (see :mod:`elasticd.rendezvous.protocol`). Best effort: without it the
        round waits out its last call, as before. :meth:`settle` awaits it.
        """
        if self.leaving is None:
            self.leaving = self.background.spawn(self._tell_leaving(my_round), "leaving")

    async def _tell_leaving(self, my_round: int) -> None:
        try:
            await self.rendezvous.leaving(my_round)
        except (StoreError, RendezvousError) as exc:
            log.debug("job %s: could not say this node is leaving: %s", self.job_id, exc)

    async def settle(self, *, wait: bool) -> None:
        """After the stop: the "leaving" write, awaited (``wait``: bounded) then dropped."""
        leaving, self.leaving = self.leaving, None
        if leaving is None:
            return
        if wait:
            # Best effort, and bounded: a store that does not answer (a full disk under
            # the embedded store) must not hold up what comes after the stop.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(LEAVING_TIMEOUT):
                    await asyncio.shield(leaving)
        await cancel_and_wait(leaving)

    async def leave(self) -> None:
        """Leave the rendezvous, bounded. Past the bound the leave goes on alone (a store
        that cannot write may fail it later), owned by the task set until it closes."""
        leave = self.background.spawn(self.rendezvous.leave(), "leave")
        with contextlib.suppress(ElasticdError, TimeoutError):
            async with asyncio.timeout(LEAVE_TIMEOUT):
                await (self.rendezvous.leave() if leave is None else asyncio.shield(leave))
