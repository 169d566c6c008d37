"""Replica groups (torchft): a job of ``replica_groups`` is a parent of child jobs.

A job whose spec sets ``replica_groups: N`` runs no workers itself
(:attr:`~elasticd.models.Launcher.GROUPS`: the scheduler, the agents and
recovery skip it). Its groups are N ordinary jobs, ``<parent>.g0`` ..
``<parent>.g<N-1>`` (:func:`children_of`), each an independent gang with
everything a job has: its own rendezvous, master, ranks, restart count and
budget, prewarm and placement. A failure in one group restarts that group
only; the others' workers keep running.

The parent's state is derived (:func:`derive_parent`), a pure function of its
children's states and ``min_replicas`` (M):

- RUNNING while at least M groups run (or have succeeded); PENDING before the
  first time, RESTARTING when it falls below M after having run;
- FAILED once fewer than M groups can still run (the others FAILED: their
  budget spent, or CANCELLED), its ``error`` naming the groups and causes;
- SUCCEEDED once every group ended and at least M of them did not fail
  (so at least one succeeded);
- a CANCELLED or FAILED parent ends its groups that still run (cancel of the
  parent cancels every child, whichever daemon finishes it).

Submission writes the parent and then its children, each by compare-and-set
(:meth:`~elasticd.node.jobs.service.JobService.submit`); a daemon that dies
between the writes leaves a parent with missing children, which any daemon
creates when its job watch shows them missing (:func:`plan_groups`, applied
by :class:`GroupKeeper`): nothing acknowledged is lost. Every daemon may apply
a plan: each write is a compare-and-set, and the plan of the result is empty.

Which side of the boundary: the daemon; the decisions are pure, the keeper
is the thin loop that applies them.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field

from elasticd.errors import ElasticdError, JobNotFound
from elasticd.models import Job, JobEdit, Launcher, RootCause
from elasticd.replicas import ReplicaGroupView, child_id, majority
from elasticd.sched.plan import FleetPlan
from elasticd.states import JobState
from elasticd.tasks import TaskSet

log = logging.getLogger("elasticd.node.jobs")

__all__ = [
    "GroupKeeper",
    "GroupPlan",
    "belongs",
    "child_id",
    "children_of",
    "derive_parent",
    "group_views",
    "parent_of_spec",
    "plan_groups",
]

#: Most derived-state writes one pass makes (PENDING -> RUNNING -> SUCCEEDED at most).
MAX_STEPS = 3


def parent_of_spec(job: Job) -> Job:
    """``job`` as its parent document is written: run by its groups (pure)."""
    return job.model_copy(update={"launcher": Launcher.GROUPS})


def children_of(parent: Job) -> list[Job]:
    """The child jobs of a job of ``replica_groups`` (pure): one per group, each the
    parent's spec less ``replica_groups``/``min_replicas``, its owner, user and priority,
    and the parent's creation (so :func:`belongs` tells them from another job of the id).
    An ordinary job has none."""
    groups = parent.spec.replica_groups
    if groups is None:
        return []
    children = []
    for k in range(groups):
        cid = child_id(parent.id, k)
        spec = parent.spec.model_copy(
            update={"id": cid, "replica_groups": None, "min_replicas": None}
        )
        children.append(
            Job(
                id=cid,
                spec=spec,
                state=JobState.PENDING,
                max_restarts=spec.max_restarts,
                created_at=parent.created_at,
                submitted_to=parent.submitted_to,
                owner=parent.owner,
                replica_group=k,
                group_of=parent.id,
                num_replica_groups=groups,
            )
        )
    return children


def belongs(child: Job, parent: Job) -> bool:
    """Whether ``child`` is a group of this very ``parent`` (pure): not a job that took
    one of its ids, nor a group of an earlier job of the parent's id."""
    return (
        child.group_of == parent.id
        and child.created_at == parent.created_at
        and child.submitted_to == parent.submitted_to
        and child.owner == parent.owner
    )


def _label(child: Job) -> str:
    return f"group {child.replica_group} ({child.id})"


def _failure(child: Job) -> str:
    error = child.error
    cause = f"{error.who()}: {error.message}" if error is not None else child.reason or "failed"
    return f"{_label(child)} {child.state.value}: {cause}"


def derive_parent(parent: Job, children: Mapping[int, Job]) -> JobEdit:
    """The edit that brings ``parent``'s document to what its groups say (pure; see the
    module). ``children``: the groups written so far, by group number (a missing one is
    PENDING: it is about to be written). Empty when nothing changes, and for a parent
    that ended (terminal states are final). One step at a time: a PENDING parent whose
    groups all succeeded goes RUNNING first, then SUCCEEDED on the next call."""
    spec = parent.spec
    if parent.state.is_terminal or spec.replica_groups is None:
        return {}
    total, least = spec.replica_groups, spec.min_replicas or majority(spec.replica_groups)
    states = [children[k].state if k in children else JobState.PENDING for k in range(total)]
    lost = sorted(
        (children[k] for k in range(total) if states[k] in (JobState.FAILED, JobState.CANCELLED)),
        key=lambda c: (c.finished_at or 0.0, c.id),
    )
    healthy = sum(s in (JobState.RUNNING, JobState.SUCCEEDED) for s in states)
    edit: JobEdit = {"restart_count": sum(c.restart_count for c in children.values())}
    if total - len(lost) < least:  # fewer than M groups can still run: the job failed
        first = lost[0]
        causes = "; ".join(_failure(c) for c in lost)
        reason = (
            f"{len(lost)} of {total} replica groups ended, fewer than {least} can run: {causes}"
        )
        error = first.error or RootCause(message=_failure(first))
        edit |= {
            "state": JobState.FAILED,
            "reason": reason,
            "error": error.model_copy(update={"message": f"{_label(first)}: {error.message}"}),
        }
    elif all(s.is_terminal for s in states):
        edit |= {"state": JobState.SUCCEEDED, "reason": None}
    elif healthy >= least:
        edit |= {"state": JobState.RUNNING}
    else:
        waiting = f"{healthy} of {total} replica groups run, {least} needed"
        edit |= {"reason": waiting}
        if parent.state is JobState.RUNNING:
            edit |= {"state": JobState.RESTARTING}
    if edit.get("state") is JobState.SUCCEEDED and parent.state is JobState.PENDING:
        edit |= {"state": JobState.RUNNING, "reason": None}  # PENDING -> SUCCEEDED is refused
    return _changes(parent, edit)


def _changes(job: Job, edit: JobEdit) -> JobEdit:
    """``edit`` less what ``job`` has already (pure): an empty edit is no write."""
    return {k: v for k, v in edit.items() if getattr(job, k) != v}  # type: ignore[return-value]


@dataclass(frozen=True)
class GroupPlan:
    """What a pass over one parent does (:func:`plan_groups`)."""

    create: list[Job] = field(default_factory=list)
    """Groups with no document yet: written (by compare-and-set, absent before)."""
    end: list[Job] = field(default_factory=list)
    """Groups still active under a parent that ended (CANCELLED or FAILED): cancelled."""
    edit: JobEdit = field(default_factory=dict)  # type: ignore[assignment]
    """The parent's derived state (:func:`derive_parent`)."""
    taken: list[str] = field(default_factory=list)
    """Group ids another job holds: the parent cannot run (it fails, naming them)."""

    def __bool__(self) -> bool:
        return bool(self.create or self.end or self.edit or self.taken)


def plan_groups(parent: Job, jobs: Mapping[str, Job]) -> GroupPlan:
    """What to do for ``parent`` given every job document as seen (pure): create its
    missing groups, end its active ones once it ended, derive its state."""
    if not parent.is_parent or parent.spec.replica_groups is None:
        return GroupPlan()
    children: dict[int, Job] = {}
    create, taken = [], []
    for child in children_of(parent):
        there = jobs.get(child.id)
        if there is None:
            if not parent.state.is_terminal:
                create.append(child)
        elif belongs(there, parent):
            assert there.replica_group is not None
            children[there.replica_group] = there
        else:
            taken.append(child.id)
    if taken and not parent.state.is_terminal:
        return GroupPlan(taken=taken)  # an ended parent's taken ids are nothing to do
    end = []
    if parent.state in (JobState.CANCELLED, JobState.FAILED):
        end = [c for c in children.values() if not c.state.is_terminal]
    return GroupPlan(create=create, end=end, edit=derive_parent(parent, children))


def taken_edit(parent: Job, taken: Iterable[str]) -> JobEdit:
    """The parent fails: ids of its groups are other jobs' (pure)."""
    if parent.state.is_terminal:
        return {}
    ids = ", ".join(taken)
    message = f"the ids of its replica groups are taken by other jobs: {ids}; submit another id"
    return {"state": JobState.FAILED, "reason": message, "error": RootCause(message=message)}


def group_views(
    parent: Job, jobs: Mapping[str, Job], plan: FleetPlan | None = None
) -> list[ReplicaGroupView]:
    """Each group of ``parent`` as served with it (pure): its child's state, restarts and
    nodes (from the fleet's plan while it runs)."""
    views = []
    for child in children_of(parent):
        there = jobs.get(child.id)
        if there is None or not belongs(there, parent):
            assert child.replica_group is not None
            views.append(ReplicaGroupView(group=child.replica_group, job=child.id))
            continue
        assert there.replica_group is not None
        nodes = plan.nodes_of(there.id) if plan is not None and not there.state.is_terminal else []
        views.append(
            ReplicaGroupView(
                group=there.replica_group,
                job=there.id,
                state=there.state,
                restart_count=there.restart_count,
                nodes=list(nodes) or None,
            )
        )
    return views


class GroupKeeper:
    """Applies :func:`plan_groups` to every parent the job watch shows: one pass per
    parent at a time, again when the watch changed meanwhile (the thin loop)."""

    def __init__(self, background: TaskSet, apply: Callable[[str], Awaitable[None]]) -> None:
        """``apply(parent_id)``: one pass over a parent, read fresh from the store."""
        self._background = background
        self._apply = apply
        self._running: set[str] = set()
        self._again: set[str] = set()

    def on_jobs(self, jobs: Iterable[Job]) -> None:
        """The job watch changed: a pass for each parent whose plan is not empty."""
        known = {j.id: j for j in jobs}
        for job in known.values():
            if job.is_parent and plan_groups(job, known):
                self.kick(job.id)

    def kick(self, parent_id: str) -> None:
        if parent_id in self._running:
            self._again.add(parent_id)
            return
        self._running.add(parent_id)
        self._background.spawn(self._passes(parent_id), name=f"groups-{parent_id}")

    async def _passes(self, parent_id: str) -> None:
        try:
            while True:
                self._again.discard(parent_id)
                try:
                    await self._apply(parent_id)
                except JobNotFound:  # deleted meanwhile: its groups went with it
                    return
                except ElasticdError as exc:  # the next change of the watch tries again
                    log.warning("job %s: its replica groups: %s", parent_id, exc)
                if parent_id not in self._again:
                    return
        finally:
            self._running.discard(parent_id)
            self._again.discard(parent_id)
