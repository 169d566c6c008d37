"""The job document as one node's agent writes it: each write one compare-and-set edit.

The edits themselves are pure (:mod:`elasticd.agent.edits`); this hook
applies them through the node's ``update_job`` and says what goes with them
(the event, closing the rendezvous). An edit the document refuses
(:class:`~elasticd.errors.InvalidTransition`: the job ended meanwhile) is
dropped where the agent's behaviour does not depend on it.

Which side of the boundary: the daemon; it reads and writes the job's document.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

from elasticd.agent.context import AgentContext, Emit, JobUpdater
from elasticd.agent.edits import record_failure, settle_failure
from elasticd.errors import ElasticdError, InvalidTransition
from elasticd.eventkinds import EventKind
from elasticd.keys import goodput_key, goodput_page_key, group_key, job_key, keys_of_job
from elasticd.models import EventSource, Job, JobEdit, RootCause
from elasticd.rendezvous import Change, Rendezvous, RoundInfo
from elasticd.states import JobState, WorkerState
from elasticd.store import Store

__all__ = ["JobRecord", "states_on_close", "sweep_leftovers"]


async def sweep_leftovers(store: Store, job_id: str) -> int:
    """Delete the keys that earlier jobs of this id left; how many went.

    Those are the keys under the id's prefixes (:func:`~elasticd.keys.keys_of_job`)
    created before its current document, every one when there is none. The listings
    are read before the document, so a job submitted under the id meanwhile has a
    newer document than any key of its own that they hold: its keys are never
    touched. Each key goes by compare-and-set on its listed version (one written
    again since is someone's now). Safe to run at any time.
    """
    listings = [await store.list(prefix) for prefix in keys_of_job(job_id)]
    current = await store.get(job_key(job_id))
    swept = 0
    for listing in listings:
        for entry in listing.entries:
            if current is None or entry.created < current.created:
                swept += await store.delete(entry.key, entry.version)
    return swept


@dataclass(frozen=True)
class JobRecord:
    """One job's document, for this node's agent."""

    job_id: str
    node: str
    store: Store
    update_job: JobUpdater
    rendezvous: Rendezvous
    emit: Emit
    #: Which job of its id this is (its submission: node and time); None: not checked.
    submitted: tuple[str | None, float] | None = None

    @classmethod
    def of(cls, job: Job, ctx: AgentContext, emit: Emit) -> JobRecord:
        """``job``'s record for its agent on ``ctx``'s node, checked to be that job."""
        submitted = (job.submitted_to, job.created_at)
        return cls(job.id, ctx.node, ctx.store, ctx.update_job, ctx.rendezvous, emit, submitted)

    async def read(self) -> Job:
        entry = await self.store.get(job_key(self.job_id))
        if entry is None:
            raise ElasticdError(f"job {self.job_id} vanished from the store")
        return Job.model_validate_json(entry.value)

    async def close_rendezvous(self) -> None:
        """Close the rendezvous for every node (the job ended), then :meth:`sweep_if_gone`:
        a delete may land between the job's end and this close (the end is all it waits
        for), and the next job of its id would find the rendezvous closed and never run."""
        await self.rendezvous.close()
        await self.sweep_if_gone()

    async def sweep_if_gone(self) -> None:
        """The job was deleted while this agent still wrote its keys (the close, its
        goodbye to the rendezvous, its group's and goodput's last records): sweep what
        the deleted job left. When a new job took its id meanwhile, this node's records
        of the old one (written after the new document, so no sweep of leftovers takes
        them) go: the new job's agent here starts only once this one has ended."""
        entry = await self.store.get(job_key(self.job_id))
        if entry is None:
            await sweep_leftovers(self.store, self.job_id)
        elif self.submitted is not None and _submitted(entry.value) != self.submitted:
            pages = await self.store.list(goodput_page_key(self.job_id, self.node))
            for key in (group_key(self.job_id, self.node), goodput_key(self.job_id, self.node)):
                await self.store.delete(key)
            for page in pages.entries:
                await self.store.delete(page.key, page.version)
            await sweep_leftovers(self.store, self.job_id)  # what it changed as the delete swept

    async def sweep_quietly(self, bound: float | None = None) -> None:
        """:meth:`sweep_if_gone` at the agent's end, within ``bound`` seconds: a store that
        fails or stalls then costs the sweep, never the agent's end."""
        with contextlib.suppress(ElasticdError, TimeoutError):
            await asyncio.wait_for(self.sweep_if_gone(), bound)

    async def settle(self, round_: RoundInfo) -> Job:
        """A round formed: charge the last round's failure once (or free it: a node lost)."""
        return await self.update_job(self.job_id, mutate=settle_failure(round_))

    async def record_failure(
        self, named: RoundInfo, root: RootCause, what: str, seq: int, *, alone: bool = False
    ) -> Job:
        """The round's failure (the round with its participants named): ``group.restarting``,
        unless it ended the job (``alone``: charged now, the budget spent; the job's state
        change says so)."""
        job = await self.update_job(self.job_id, mutate=record_failure(named, root, alone=alone))
        if job.state.is_terminal:
            return job
        self.emit(
            EventKind.GROUP_RESTARTING,
            f"{what}; re-forming the group",
            state=WorkerState.STOPPED.value,
            attempt=seq,
            rank=root.rank,
            local_rank=root.local_rank,
            exit_code=root.exit_code,
            signal=root.signal,
            error=root,
        )
        return job

    async def fail(
        self,
        kind: EventKind,
        reason: str,
        *,
        source: EventSource = "agent",
        error: str | None = None,
        attempt: int | None = None,
    ) -> None:
        """The job cannot go on (a join timeout, a spawn that failed, an internal error):
        the event, the job FAILED with the reason (``error``: its root cause's message,
        naming this node), the rendezvous closed for every node."""
        self.emit(kind, reason, source, state="FAILED", attempt=attempt)
        with contextlib.suppress(InvalidTransition):
            if error is None:
                await self.update_job(self.job_id, state=JobState.FAILED, reason=reason)
            else:
                root = RootCause(message=error, node=self.node, attempt=attempt)
                await self.update_job(self.job_id, state=JobState.FAILED, reason=reason, error=root)
        await self.close_rendezvous()

    async def note(self, reason: str) -> None:
        """The reason of a job that waits (PENDING or RESTARTING): why (a node gave it back)."""

        def edit(job: Job) -> JobEdit:
            if job.state in (JobState.PENDING, JobState.RESTARTING):
                return {"reason": reason}
            return {}

        with contextlib.suppress(InvalidTransition):
            await self.update_job(self.job_id, mutate=edit)

    async def gave_back(self, error: str, cause: str, waited: float, seq: int) -> None:
        """This node stops trying to start the job: ``agent.gave_back``, the reason in the job.

        The job keeps its state (PENDING or RESTARTING, or RUNNING where other
        nodes run it); no restart is spent.
        """
        reason = (
            f"{self.node} could not start the job's workers for {waited:.0f} s "
            f"({cause}: {error}); it gave the job back to the scheduler"
        )
        self.emit(
            EventKind.AGENT_GAVE_BACK,
            reason + "; no restart spent",
            attempt=seq,
            cause=cause,
            duration_s=waited,
        )
        await self.note(reason)

    async def reforming(self, change: Change, seq: int) -> None:
        """A membership change: ``rendezvous.change``; a RUNNING job RESTARTING (free)."""
        self.emit(
            EventKind.RENDEZVOUS_CHANGE,
            f"re-forming the group: {change.value} (no restart spent)",
            attempt=seq,
            source="rendezvous",
        )

        def edit(job: Job) -> JobEdit:
            if job.state is JobState.RUNNING:
                return {"state": JobState.RESTARTING, "reason": change.value}
            return {}

        with contextlib.suppress(InvalidTransition):
            await self.update_job(self.job_id, mutate=edit)

    async def succeeded(self, round_: RoundInfo) -> None:
        """Every worker of the round exited 0: the job SUCCEEDED (for its round), closed.

        Closed only if the job has ended: one that went on meanwhile (a later round runs
        it elsewhere, or the plan put it back in the queue: PENDING, which cannot succeed)
        keeps its rendezvous, since whoever closes one writes the job's end first (a
        closure found while the job runs is undone as a new round, restarting the
        workers of the round that runs it).
        """

        def edit(job: Job) -> JobEdit:
            if job.round == round_.round and not job.state.is_terminal:
                return {"state": JobState.SUCCEEDED, "reason": "every worker exited 0"}
            return {}

        try:
            job = await self.update_job(self.job_id, mutate=edit)
        except InvalidTransition:
            return  # PENDING: back in the queue, not ended
        if job.state.is_terminal:
            await self.close_rendezvous()


def _submitted(raw: bytes) -> tuple[str | None, float] | None:
    """Which job of its id a stored document is (:attr:`JobRecord.submitted`)."""
    try:
        job = Job.model_validate_json(raw)
    except ValueError:  # a refused document is no job's: not this agent's either
        return None
    return job.submitted_to, job.created_at


def states_on_close(job: JobState, group: WorkerState) -> tuple[WorkerState, ...]:
    """The group's steps once the rendezvous closed with the job ``job`` (pure)."""
    if job is JobState.SUCCEEDED and group in (WorkerState.HEALTHY, WorkerState.UNHEALTHY):
        return (WorkerState.SUCCEEDED,)
    if job is JobState.FAILED and not group.is_terminal:
        first = (WorkerState.STOPPED,) if group is WorkerState.INIT else ()
        return (*first, WorkerState.FAILED)
    if not group.is_terminal and group is not WorkerState.STOPPED:
        return (WorkerState.STOPPED,)
    return ()
