"""The rules of replica groups' ids and counts (torchft), pure, and the served views of a
job's groups and quorum (pydantic only).

A job of ``replica_groups: N`` is a parent whose groups are child jobs
``<parent>.g0`` .. ``<parent>.g<N-1>`` (:mod:`elasticd.node.jobs.groups`); the
models check their documents by these rules, since anyone holding the store's
credentials can write one.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from elasticd.states import JobState

#: The longest job id (``models.JOB_ID_PATTERN``): a parent's leaves room for ``.g<k>``.
MAX_JOB_ID = 128
#: Most replica groups one job may have (each is a child job with its own document).
MAX_REPLICA_GROUPS = 256


def child_id(parent_id: str, group: int) -> str:
    """The id of the ``group``-th replica group of ``parent_id``."""
    return f"{parent_id}.g{group}"


def majority(groups: int) -> int:
    """``min_replicas`` when a spec sets none: a majority of the groups."""
    return groups // 2 + 1


def spec_problem(job_id: str | None, groups: int | None, least: int | None) -> str | None:
    """What is wrong with a spec's ``replica_groups`` and ``min_replicas`` (None: nothing)."""
    if groups is None:
        return None if least is None else "min_replicas goes with replica_groups"
    if least is not None and least > groups:
        return f"min_replicas ({least}) must not exceed replica_groups ({groups})"
    longest = MAX_JOB_ID - len(child_id("", groups - 1))
    if job_id is not None and len(job_id) > longest:
        return (
            f"a job of {groups} replica groups has an id of at most {longest} characters "
            f"(its groups are '<id>.g<k>'), not {len(job_id)}"
        )
    return None


def child_problem(
    job_id: str, group: int | None, parent: str | None, groups: int | None, nested: bool
) -> str | None:
    """What is wrong with a job document's replica-group fields (None: nothing, or an
    ordinary job); ``nested``: its spec sets ``replica_groups`` of its own."""
    fields = (group, parent, groups)
    if all(v is None for v in fields):
        return None
    if group is None or parent is None or groups is None:
        return "replica_group, group_of and num_replica_groups go together"
    if group >= groups:
        return "replica_group must be below num_replica_groups"
    if job_id != child_id(parent, group):
        return f"a replica group's id is '<group_of>.g<replica_group>', not {job_id!r}"
    return "a replica group has no replica_groups of its own" if nested else None


class ReplicaGroupView(BaseModel):
    """One replica group of a job of ``replica_groups`` (served with the job, derived)."""

    group: int = Field(ge=0, description="Its REPLICA_GROUP_ID.")
    job: str = Field(description="The child job that runs it (`<parent>.g<group>`).")
    state: JobState | None = Field(
        default=None, description="The child's state; None: its document is not written yet."
    )
    restart_count: int = 0
    nodes: list[str] | None = None


class QuorumView(BaseModel):
    """The last quorum of a job's torchft Lighthouse (served with the job, read from the
    store's quorum document; :mod:`elasticd.lighthouse`)."""

    quorum_id: int = Field(ge=0, description="Rises with each change of its members.")
    participants: list[str] = Field(
        default_factory=list, description="The replica ids of its members (torchft's)."
    )
    groups: list[int] = Field(
        default_factory=list,
        description="The replica groups of its members, where known (their groups' stores).",
    )
    leader: str | None = Field(default=None, description="The node whose leader formed it.")
    created: float | None = Field(default=None, description="When it formed (wall clock).")
