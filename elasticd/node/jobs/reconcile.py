"""Plan application: the agents the fleet's plan places on this node, on its slots.

Every daemon watches the job prefix (:meth:`Reconciler.on_jobs`) and the
fleet's plan (:meth:`Reconciler.on_plan`, :mod:`elasticd.node.scheduler`); it
starts an agent for each active job the plan places here as soon as the job
fits its free slots, and stops the agent of a job the plan no longer places
here (the job goes back to the queue, uncharged, when it is placed nowhere).
The rendezvous decides which of those agents actually run workers. What this
node gave up (``declined``) is published with its free slots, so the scheduler
places those jobs elsewhere. When this node first saw each finished job end is
kept here too (retention counts from it: :mod:`elasticd.node.retention`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from elasticd.agent.handover import AgentHandover
from elasticd.errors import InvalidTransition, JobConflict, JobNotFound, StoreError
from elasticd.models import Job, JobEdit, Launcher, incarnation, incarnation_tag
from elasticd.node.db import Database
from elasticd.node.jobs.documents import JobsSide
from elasticd.node.jobs.supervision import AgentEnded, AgentSupervisor
from elasticd.node.retention import EndSeen, seen_end
from elasticd.sched.plan import FleetPlan
from elasticd.states import JOB_ACTIVE, JobState
from elasticd.supervise.sweep import boot_id
from elasticd.tasks import TaskSet

log = logging.getLogger("elasticd.node.jobs")


class Slots:
    """This node's worker slots: which are free, and which each job's agent holds."""

    def __init__(self, count: int, gpu_ids: list[str] | None = None) -> None:
        self.count = count
        self.gpu_ids = gpu_ids
        self.free = list(range(count))
        self.held: dict[str, list[int]] = {}

    @property
    def busy(self) -> int:
        """How many slots the jobs' agents hold."""
        return sum(len(held) for held in self.held.values())

    def fits(self, n: int) -> bool:
        return n <= len(self.free)

    def take(self, job_id: str, n: int) -> str | None:
        """Hold ``n`` free slots for the job; the CUDA devices they name (None: no GPUs)."""
        slots = self.free[:n]
        del self.free[:n]
        self.held[job_id] = slots
        if self.gpu_ids is None:
            return None
        return ",".join(self.gpu_ids[s] for s in slots)

    def take_exact(self, job_id: str, slots: list[int]) -> str | None:
        """Hold these slots for the job (re-adopted after a re-exec: the GPUs it runs on)."""
        if not slots or not set(slots) <= set(self.free):
            return self.take(job_id, len(slots))
        self.free = [s for s in self.free if s not in slots]
        self.held[job_id] = list(slots)
        if self.gpu_ids is None:
            return None
        return ",".join(self.gpu_ids[s] for s in slots)

    def release(self, job_id: str) -> list[int]:
        """The job no longer holds its slots; the caller frees them (``give_back``)."""
        return self.held.pop(job_id, [])

    def give_back(self, slots: list[int]) -> None:
        self.free.extend(slots)
        self.free.sort()


class Reconciler:
    """The fleet's plan and the job documents as last seen, applied to this node's agents."""

    def __init__(
        self,
        side: JobsSide,
        supervisor: AgentSupervisor,
        slots: Slots,
        background: TaskSet,
        *,
        retain_logs: Callable[[list[str]], Coroutine[Any, Any, object]],
        db: Database | None = None,
    ) -> None:
        """``retain_logs``: applies log retention to jobs whose agent here ended;
        ``db``: where this node keeps when it saw jobs end (None: in memory only)."""
        self.side = side
        self.supervisor = supervisor
        self.slots = slots
        self._background = background
        self._retain_logs = retain_logs
        #: The fleet's plan as last seen (``sched/plan``): agents run only where it places them.
        self.plan: FleetPlan | None = None
        #: Every job document, once the first watch answered (``watched``).
        self.known: dict[str, Job] = {}
        self.watched = False
        self.accepting = True
        #: Active jobs this node gave up (declined): the scheduler places them elsewhere.
        self.done_here: set[str] = set()
        #: Jobs whose agent here is being stopped because the plan no longer places them here.
        self.unplaced: set[str] = set()
        self.crashing: set[str] = set()  # jobs whose dead agent is being cleaned up
        #: Attempts handed over by the daemon's previous program image (re-exec), by job:
        #: taken up by the job's next agent here (:meth:`reconcile`).
        self.adoptions: dict[str, AgentHandover] = {}
        #: When this node saw each finished job end, on its monotonic clock
        #: (:mod:`elasticd.node.retention`); loaded from ``db`` at the first watch.
        self._db = db
        self._boot_id = boot_id()
        self.ends: dict[str, EndSeen] = {}
        #: Jobs whose log retention runs now, and those to run it again after (an attempt
        #: ended meanwhile): one pass per job at a time, never two on one folder.
        self._retaining: set[str] = set()
        self._retain_again: set[str] = set()

    def on_jobs(self, jobs: list[Job]) -> None:
        """Called with every job document whenever one changes."""
        first = not self.watched
        self.watched = True  # known now mirrors the store
        known = {j.id: j for j in jobs}
        for gone in self.known.keys() - known.keys():
            # Deleted (by a user, or by retention) on some daemon: drop our records too.
            self.forget(gone)
        for job_id, before in self.known.items():
            now = known.get(job_id)
            if now is not None and incarnation(now) != incarnation(before):
                # Deleted and its id taken again between two looks: what this node kept of
                # the old job is not the new one's (declined here, its agent's crashes, its events).
                self.done_here.discard(job_id)
                self.supervisor.forget(job_id)
                self.side.events.forget_others(job_id, incarnation_tag(now))
        self.known = known
        self._see_ends(first)
        self.reconcile()

    def _see_ends(self, first: bool) -> None:
        """Record when this node first saw each finished job end (retention counts from it)."""
        if first and self._db is not None and self._db.is_open:
            self.ends = self._db.job_ends()  # from before a restart: still counting
        now = self.side.clock.monotonic()
        for job_id in list(self.ends):
            job = self.known.get(job_id)
            if job is None or not job.state.is_terminal:  # deleted while down, or id reused
                self.forget_end(job_id)
        for job in self.known.values():
            if not job.state.is_terminal:
                continue
            before = self.ends.get(job.id)
            end = seen_end(job, before, self._boot_id, now)
            if end != before:
                self.ends[job.id] = end
                if self._db is not None and self._db.is_open:
                    self._db.record_job_end(job.id, end)
            # Its events here shrink to the finished policy (once per end; again after a
            # restart of the daemon, which lost the count of the finished jobs' events).
            self.side.events.job_ended(job.id, end.at)

    def forget_end(self, job_id: str) -> None:
        if self.ends.pop(job_id, None) is not None and self._db is not None and self._db.is_open:
            self._db.forget_job_end(job_id)

    def forget(self, job_id: str) -> None:
        """The job was deleted (here or on another daemon): drop what this node kept of it."""
        self.side.events.forget(job_id)
        self.done_here.discard(job_id)
        self.supervisor.forget(job_id)
        self.forget_end(job_id)

    def on_plan(self, plan: FleetPlan) -> None:
        """Called with the fleet's plan whenever it changes (:mod:`elasticd.node.scheduler`)."""
        self.plan = plan
        self.reconcile()

    def reconcile(self) -> None:
        """Start the agents the plan places here; stop the ones it no longer places here.

        A placement is a share of this node's slots held for the job; the
        agent starts as soon as the slots are free here (a job the plan took
        them from may still be stopping its workers within their grace).
        """
        if not self.accepting or self.plan is None:
            return
        plan = self.plan
        for job in sorted(self.known.values(), key=lambda j: (-j.spec.priority, j.created_at)):
            if job.state not in JOB_ACTIVE:
                continue
            here = self.side.node in plan.nodes_of(job.id)
            if job.id in self.supervisor.agents:
                if not here and job.id not in self.unplaced:
                    self.unplaced.add(job.id)  # preempted, shrunk, spare given back
                    self.supervisor.stop(job.id)
                continue
            if (
                not here
                or job.launcher != Launcher.ELASTICD  # torch's agents run it: shown, never run
                or job.id in self.done_here
                or job.id in self.crashing  # its dead agent's workers are still being stopped
                or not self.slots.fits(job.spec.nproc_per_node)
            ):
                continue
            handover = self.adoptions.pop(job.id, None)
            if handover is not None:
                cuda = self.slots.take_exact(job.id, handover.slots)
            else:
                cuda = self.slots.take(job.id, job.spec.nproc_per_node)
            self.supervisor.start(job, cuda, handover)
            self.publish_slots()

    async def _after_unplaced(self, ended: AgentEnded) -> None:
        """A job the plan no longer places anywhere goes back to PENDING (queued), uncharged:
        decided inside the write, on the plan as it is then (:func:`back_to_queue`)."""
        plan = self.plan
        if plan is None or plan.nodes_of(ended.job_id):
            return  # still placed elsewhere (shrunk) or here again: nothing to record
        try:
            await self.side.documents.update(
                ended.job_id, mutate=lambda job: back_to_queue(job, self.plan, ended.ran)
            )
        except (StoreError, InvalidTransition, JobNotFound, JobConflict) as exc:
            log.warning("job %s: could not record its return to the queue: %s", ended.job_id, exc)

    def attempt_ended(self, job_id: str) -> None:
        """An attempt of the job ended here: its older attempts' log folders past
        ``log_retention_attempts`` (or ``log_retention_bytes``) go now. Between two passes of
        the periodic retention (``log_retention_interval``), three crash-looping jobs left
        about 680 folders (issue 34); now a job has at most the bound and its running one."""
        if job_id in self._retaining:
            self._retain_again.add(job_id)
            return
        self._retaining.add(job_id)
        self._background.spawn(self._retain_attempts(job_id), name=f"attempt-logs-{job_id}")

    async def _retain_attempts(self, job_id: str) -> None:
        try:
            while True:
                self._retain_again.discard(job_id)
                await self._retain_logs([job_id])
                if job_id not in self._retain_again:
                    return
        finally:
            self._retaining.discard(job_id)
            self._retain_again.discard(job_id)

    def agent_ended(self, ended: AgentEnded) -> None:
        """An agent of this node ended: what its slots and its job do next."""
        job_id = ended.job_id
        if ended.crash is not None and ended.agent is not None:
            # No new agent until the dead one's workers are stopped and its slots,
            # taken now, are given back (a new agent would get the same ones).
            self.crashing.add(job_id)
            slots = self.slots.release(job_id)
            self._background.spawn(self._after_crash(ended, slots), name=f"agent-crash-{job_id}")
            return
        # The job is done here (for now): its old attempts' logs go (log retention).
        self._background.spawn(self._retain_logs([job_id]), name=f"log-retention-{job_id}")
        if job_id in self.unplaced:
            self.unplaced.discard(job_id)
            self._background.spawn(self._after_unplaced(ended), name=f"unplaced-{job_id}")
        elif not ended.cancelled and self._still_known(ended):
            self.done_here.add(job_id)  # declined (published with the slots) if active
            if ended.gave_back:
                # The node's own trouble (elasticd.agent.nodefail): declined for a
                # while so another node may take it, then this one tries again.
                self._background.spawn(
                    self._take_back_later(job_id, self.side.config.node_failure_grace),
                    name=f"take-back-{job_id}",
                )
        self.slots.give_back(self.slots.release(job_id))
        self.publish_slots()
        self.reconcile()

    def _still_known(self, ended: AgentEnded) -> bool:
        """The job the agent ran is still in the store as this node last saw it: a job
        deleted meanwhile (forgotten already) or replaced by a new job of its id is not
        declined here for the dead one's sake (the new one would never run here)."""
        job = self.known.get(ended.job_id)
        return job is not None and ended.ran in (None, incarnation(job))

    async def _after_crash(self, ended: AgentEnded, slots: list[int]) -> None:
        """The dead agent's workers are stopped and its death recorded; then its slots free."""
        assert ended.agent is not None
        assert ended.crash is not None
        give_up = False
        try:
            give_up = await self.supervisor.after_crash(ended.job_id, ended.agent, ended.crash)
        finally:
            self.slots.give_back(slots)
            if give_up:
                self.done_here.add(ended.job_id)
            self.publish_slots()
            self.crashing.discard(ended.job_id)
            if not give_up and self.accepting:
                self.reconcile()  # a new agent takes the job up

    async def _take_back_later(self, job_id: str, after: float) -> None:
        """Stop declining a job this node gave back for its own trouble, ``after`` seconds on.

        On a single node that is when the job is tried again (it waited PENDING or
        RESTARTING meanwhile, with the reason); elsewhere another node may have it.
        """
        await asyncio.sleep(max(after, 1.0))
        if job_id in self.done_here and job_id not in self.supervisor.agents:
            log.info("job %s: %s takes it up again after giving it back", job_id, self.side.node)
            self.done_here.discard(job_id)
            self.publish_slots()
            self.reconcile()

    def publish_slots(self) -> None:
        """Publish the free slots, and the active jobs this node gave up (the scheduler's
        ``declined``: it places them on other nodes)."""
        if self.accepting:
            declined = sorted(
                j
                for j in self.done_here
                if (job := self.known.get(j)) is not None and job.state in JOB_ACTIVE
            )
            self._background.spawn(
                self.side.cluster.publish(free_slots=len(self.slots.free), declined=declined),
                name="publish-slots",
            )


def back_to_queue(job: Job, plan: FleetPlan | None, ran: str | None) -> JobEdit:
    """The edit that puts ``job``, whose agent here stopped when the plan took its
    placement away, back in the queue: PENDING with the queue's reason, and nothing its
    workers met on the way out (a peer already stopped) charged, not even later.

    Decided on the document it is written over, with the plan as it is at that moment:
    no edit when the plan places the job again by then (it may be RUNNING elsewhere, in a
    round its own failures are charged for), when the job ended, or when it is another
    job of its id than the agent ran (``ran``: :func:`incarnation`; None: unknown).
    """
    if plan is None or plan.nodes_of(job.id) or job.state.is_terminal:
        return {}
    if ran is not None and incarnation(job) != ran:
        return {}
    entry = plan.entry(job.id)
    reason = f"waiting in the queue: {entry.message}" if entry else "waiting in the queue"
    edit: JobEdit = {"pending_failure": None, "charged_round": max(job.charged_round, job.round)}
    if job.state in (JobState.RUNNING, JobState.RESTARTING):
        edit |= {"state": JobState.PENDING, "reason": reason}
    return edit
