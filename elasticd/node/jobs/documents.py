"""Job documents in the store: how one is read, checked, shown and changed.

Jobs live in the cluster store, one JSON document per job (``job/<id>``),
written once by the daemon that took the POST and then updated only by
compare-and-set (:meth:`JobDocuments.update`), so every daemon serves the same
answer and concurrent updates from several nodes never lose each other. A
document is read back through one check (:func:`parse_job`, the cluster's
:func:`~elasticd.node.cluster.check_job_document`), so one written into the
store by hand never names a folder outside the log root.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from typing_extensions import Unpack

from elasticd.agent.jobdoc import sweep_leftovers
from elasticd.clock import Clock
from elasticd.config import Config
from elasticd.errors import InvalidTransition, JobConflict, JobNotFound, StoreError
from elasticd.eventkinds import EventKind
from elasticd.identity import ADMIN, JobFacts, Principal, PrincipalKind
from elasticd.keys import job_key
from elasticd.logs import LogLayout
from elasticd.models import Job, JobEdit, JobMutation, JobOwner, incarnation, incarnation_tag
from elasticd.node.cluster import JOB_PREFIX, Cluster, check_job_document, parse_jobs
from elasticd.node.events import EventLog
from elasticd.rendezvous import presence_prefix
from elasticd.replicas import child_id
from elasticd.states import JobState, job_transition
from elasticd.store import Store
from elasticd.store.parts import list_in_parts

#: Compare-and-set tries before an update gives up (only under absurd contention).
CAS_ATTEMPTS = 100


def owner_of(principal: Principal, user: str | None) -> JobOwner:
    """What a job keeps of its submitter: the name, and the rights the fleet applies to it.

    ``unix_user``: the user the job runs as by its owner's own right (a local
    caller's self, or one of an identity's ``users``), which every node then
    honours without ``allowed_users``; an admin's job obeys each node's policy.
    """
    own_right = principal.kind in (PrincipalKind.LOCAL, PrincipalKind.TOKEN)
    return JobOwner(
        name=principal.name,
        local=principal.unix_named,
        admin=principal.admin,
        unix_user=user if own_right and user in principal.users else None,
        may_preempt=principal.may_preempt,
        slot_quota=principal.slot_quota,
    )


def facts_of(job: Job) -> JobFacts:
    """What :func:`elasticd.identity.authorize` needs of a job."""
    owner = job.owner.name if job.owner is not None else ADMIN.name
    local = job.owner.local if job.owner is not None else False
    return JobFacts(
        owner=owner,
        owner_unix_named=local,
        user=job.spec.user,
        priority=job.spec.priority,
        job_id=job.id,
    )


#: What another identity sees of a job's env values and arguments.
HIDDEN = "<hidden>"


def redacted(job: Job) -> Job:
    """The job without what is its owner's alone: env values, arguments, health check, and
    what its workers said (the root cause, the collateral failures)."""
    spec = job.spec.model_copy(
        update={
            "env": dict.fromkeys(job.spec.env, HIDDEN),
            "args": [HIDDEN] if job.spec.args else [],
            "health_check": [HIDDEN] if job.spec.health_check else None,
        }
    )
    hidden: dict[str, object] = {"spec": spec, "error": None, "collateral": []}
    hidden["pending_failure"] = None
    return job.model_copy(update=hidden)


def already_ended(job: Job) -> str:
    """Why an action on an ended job is a conflict (409)."""
    return f"job {job.id!r} already ended as {job.state.value}; nothing to cancel"


def same_job(seen: Job | None, job: Job, *, tag: str | None = None) -> None:
    """Raise ``JobConflict`` when ``job`` is not the job its caller was authorized for
    (``seen``, or the job ``tag`` names: :func:`incarnation_tag`): the id was deleted
    and taken again in between."""
    if (seen is not None and incarnation(job) != incarnation(seen)) or (
        tag is not None and incarnation_tag(job) != tag
    ):
        raise JobConflict(f"job {job.id!r} was replaced by a new job of that id; try again")


def cancelled(seen: Job | None = None) -> JobMutation:
    """The cancel's edit, decided on the version of the document it is written over.

    A job that ended meanwhile (its workers failed, a peer cancelled it) is a
    conflict, never an illegal transition; so is a job that replaced ``seen``.
    """

    def edit(job: Job) -> JobEdit:
        same_job(seen, job)
        if job.state.is_terminal:
            raise JobConflict(already_ended(job))
        return {"state": JobState.CANCELLED, "reason": "cancelled by user"}

    return edit


def parse_job(job_id: str, raw: bytes) -> Job:
    """A job document from the store; a refused one is a clear JobConflict, not a crash.

    The same rule as the cluster's watch (:func:`elasticd.node.cluster.check_job_document`):
    a valid job whose id is the one in its key.
    """
    job, reason = check_job_document(job_key(job_id), raw)
    if job is None:
        raise JobConflict(
            f"the stored document of job {job_id!r} is refused: {reason}; it was not written "
            f"by elasticd: delete the store key {job_key(job_id)!r} or use another id"
        )
    return job


def apply_edit(job: Job, changes: JobEdit, now: float) -> Job:
    """``job`` with ``changes`` applied at ``now`` (pure): a state change is checked and
    stamps ``started_at``/``finished_at``; terminal states are final. A move to RUNNING
    clears ``reason`` unless the change sets one: what it said (a failure's "restarting
    the group", a requeue's cause) no longer applies to a job that runs."""
    target = changes.get("state")
    updates: dict[str, Any] = {
        k: v for k, v in changes.items() if k != "state" and getattr(job, k) != v
    }
    if target is not None and target is not job.state:
        job_transition(job.state, target)
        updates["state"] = target
        if target is JobState.RUNNING:  # RESTARTING -> RUNNING: "restarting" is over
            updates["reason"] = changes.get("reason")
            if job.started_at is None:
                updates["started_at"] = now
        if target.is_terminal:
            updates["finished_at"] = now
    elif job.state.is_terminal and updates:
        raise InvalidTransition(f"job {job.id} already ended as {job.state.value}")
    return job.model_copy(update=updates) if updates else job


class JobDocuments:
    """Reads and compare-and-set updates of the job documents; state changes are evented."""

    def __init__(self, store: Store, events: EventLog, clock: Clock) -> None:
        self.store = store
        self.events = events
        self.clock = clock

    async def read(self, job_id: str) -> Job:
        """The stored document, as it is (``JobNotFound`` when there is none)."""
        entry = await self.store.get(job_key(job_id))
        if entry is None:
            raise JobNotFound(f"no job with id {job_id!r}")
        return parse_job(job_id, entry.value)

    async def all(self) -> list[Job]:
        return parse_jobs((await list_in_parts(self.store, JOB_PREFIX)).entries)

    async def children(self, parent: Job) -> dict[str, Job]:
        """The documents at the ids of ``parent``'s replica groups, by id (one listing);
        whether each is the parent's own is :func:`~elasticd.node.jobs.groups.belongs`'."""
        groups = parent.spec.replica_groups or 0
        ids = {child_id(parent.id, k) for k in range(groups)}
        if not ids:
            return {}
        listing = await list_in_parts(self.store, job_key(parent.id) + ".g")
        return {j.id: j for j in parse_jobs(listing.entries) if j.id in ids}

    async def sweep(self, job_id: str) -> int:
        """What earlier jobs of this id left (:func:`~elasticd.agent.jobdoc.sweep_leftovers`)."""
        return await sweep_leftovers(self.store, job_id)

    async def sweep_unless_there(self, job: Job) -> None:
        """:meth:`sweep` once ``job`` is gone, or replaced by a newer job of its id: keys
        of it written after its deletion (a cancel's close of its rendezvous) must not
        be found by the next job of that id."""
        entry = await self.store.get(job_key(job.id))
        if entry is not None:
            there, _ = check_job_document(job_key(job.id), entry.value)
            if there is not None and incarnation(there) == incarnation(job):
                return
        await self.sweep(job.id)

    async def live_members(self, job_id: str) -> set[str]:
        """Nodes whose presence key in the job's rendezvous is alive."""
        prefix = presence_prefix(job_id)
        listing = await self.store.list(prefix)
        return {e.key[len(prefix) :] for e in listing.entries}

    async def update(
        self, job_id: str, *, mutate: JobMutation | None = None, **changes: Unpack[JobEdit]
    ) -> Job:
        """Change the job document by compare-and-set; state changes are checked and evented.

        ``changes`` are set as given; ``mutate(job)`` decides more from the
        current document (and may run again when another node's write wins).
        A ``state`` that is already the job's state is not a change. Terminal
        states are final: asking to leave one raises ``InvalidTransition``.
        """
        for _ in range(CAS_ATTEMPTS):
            entry = await self.store.get(job_key(job_id))
            if entry is None:
                raise JobNotFound(f"no job with id {job_id!r}")
            job = parse_job(job_id, entry.value)
            new = self._apply(job, changes, mutate)
            if new == job:
                return job
            if new.state is not job.state:
                # Whoever sees the new state must also see every event that led to it.
                await self.events.flush()
            result = await self.store.compare_and_set(
                job_key(job_id), new.model_dump_json().encode(), entry.version
            )
            if result.ok:
                if new.state is not job.state:
                    self.events.emit(
                        job_id,
                        "daemon",
                        EventKind.JOB_STATE,
                        f"job {job.state.value} -> {new.state.value}"
                        + (f": {new.reason}" if new.reason else ""),
                        state=new.state.value,
                        error=new.error if new.state is JobState.FAILED else None,
                        job_tag=incarnation_tag(new),
                    )
                    if new.state.is_terminal:
                        # A finished job's last word is in the store before anyone acts on
                        # the end (a shutdown, a deletion). On the restart path the event
                        # goes out with the publisher's next batch instead of delaying it.
                        await self.events.flush()
                return new
        raise StoreError(f"job {job_id}: too many concurrent updates")  # pragma: no cover

    def _apply(self, job: Job, given: JobEdit, mutate: JobMutation | None) -> Job:
        changes: JobEdit = {**given, **(mutate(job) if mutate is not None else {})}
        return apply_edit(job, changes, self.clock.time())

    # reads


@dataclass(frozen=True)
class JobsSide:
    """What every part of the job service works with: this node's settings, the job
    documents, its event log, its cluster membership and the log layout."""

    config: Config
    documents: JobDocuments
    events: EventLog
    cluster: Cluster
    logs: LogLayout

    @property
    def node(self) -> str:
        return self.config.node_name

    @property
    def store(self) -> Store:
        return self.documents.store

    @property
    def clock(self) -> Clock:
        return self.documents.clock
