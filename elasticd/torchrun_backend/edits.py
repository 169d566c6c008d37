"""The run's job document as torchruns see it: the pure edits several torchruns apply by CAS."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from elasticd.errors import InvalidTransition
from elasticd.models import Job, JobSpec, Launcher
from elasticd.rendezvous import Change
from elasticd.states import JobState, job_transition
from elasticd.torchrun_backend.config import BackendConfig

#: The node selector of a torchrun run's document: no node can have this label (``--labels``
#: splits at the first ``=``), so a daemon of a version that knows no ``Job.launcher``
#: never starts an agent for it. Today's daemons skip it by its launcher anyway.
NEVER_SCHEDULED = {"elasticd=torchrun": "run by torch's agents"}


def waiting_nodes(change: Change | None) -> int:
    """What ``num_nodes_waiting`` answers once the watch on the round saw ``change``.

    torch's agent re-forms its group when the answer is above zero, so any
    reason to re-form is 1, including a loss and a new round (torch's own
    handler counts only arrivals). A closed rendezvous is 0: the run is
    ending, not re-forming.
    """
    if change is None or change is Change.CLOSED:
        return 0
    return 1


@dataclass(frozen=True)
class RunStep:
    """What one torchrun says about the run: the state it saw, in which round, and why."""

    state: JobState
    round: int = 0
    reason: str | None = None
    #: The round ends because this node's workers failed (torch's agent spends a restart).
    failed: bool = False


def run_edit(
    job: Job | None, step: RunStep, *, run_id: str, spec: JobSpec, node: str, now: float
) -> Job | None:
    """The run's job document after ``step`` (None: no change); pure, tested as a table.

    Several torchruns write the same document (by compare-and-set), so every
    step is idempotent and a stale one changes nothing: a round older than
    the document's, a re-formation of a round already left, anything after
    the end (the first terminal state wins). A run that ends before any round
    formed is FAILED. A run id that names a job of the daemons is refused
    (ValueError): torch's agents must never write an elasticd job. A round
    that ends because a node's workers failed counts one restart
    (``restart_count``; torch's agents spend their budgets per node).
    """
    if job is None:
        job = Job(
            id=run_id,
            spec=spec,
            state=JobState.PENDING,
            max_restarts=spec.max_restarts,
            created_at=now,
            submitted_to=node,
            launcher=Launcher.TORCHRUN,
        )
        fresh: Job | None = job
    else:
        fresh = None
        if job.launcher != Launcher.TORCHRUN:
            raise ValueError(
                f"--rdzv-id {run_id!r} names a job the elasticd daemons run; "
                "choose another id for this torchrun"
            )
    if job.state.is_terminal:
        return fresh
    target, updates = step.state, dict[str, Any]()
    if target is JobState.PENDING:
        return fresh
    if target is JobState.RUNNING:
        if step.round < job.round or (
            step.round == job.round and job.state is not JobState.PENDING
        ):
            return fresh
        updates["round"] = step.round
    elif target is JobState.RESTARTING:
        if step.failed and job.charged_round < step.round <= job.round:
            # One restart per round that ended in a failure, however many nodes failed.
            updates["restart_count"] = job.restart_count + 1
            updates["charged_round"] = step.round
        if job.state is not JobState.RUNNING or step.round != job.round:
            return job.model_copy(update=updates) if updates else fresh
    elif target is JobState.SUCCEEDED and job.state is JobState.PENDING:
        target, updates["reason"] = JobState.FAILED, "torchrun ended before any round formed"
    if target is not job.state:
        try:
            job_transition(job.state, target)
        except InvalidTransition:
            return fresh
        updates["state"] = target
        if target is JobState.RUNNING and job.started_at is None:
            updates["started_at"] = now
        if target.is_terminal:
            updates["finished_at"] = now
    updates.setdefault("reason", step.reason)
    return job.model_copy(update=updates)


def run_spec(
    config: BackendConfig,
    argv: list[str],
    *,
    nproc_per_node: int | None = None,
    max_restarts: int | None = None,
    role: str | None = None,
) -> JobSpec:
    """The spec shown for a torchrun run: its command line, and what torch's parser read from it.

    The entrypoint is ``torchrun`` and the arguments are the command's own,
    so operators see what was typed; a value the parser could not give keeps
    the spec's default. ``join_timeout`` and ``last_call_timeout`` are the
    rendezvous' own.
    """
    fields: dict[str, Any] = {
        "id": config.run_id,
        "entrypoint": "torchrun",
        "args": argv[1:],
        "min_nodes": config.settings.min_nodes,
        "max_nodes": config.settings.max_nodes,
        "join_timeout": config.settings.join_timeout,
        "last_call_timeout": config.settings.last_call_timeout,
        "node_selector": dict(NEVER_SCHEDULED),
    }
    for key, value in (
        ("nproc_per_node", nproc_per_node),
        ("max_restarts", max_restarts),
        ("role", role),
    ):
        if value is not None:
            fields[key] = value
    try:
        return JobSpec(**fields)
    except ValidationError:  # an odd command line (too long, ...): the essentials only
        return JobSpec(
            id=config.run_id,
            entrypoint="torchrun",
            min_nodes=config.settings.min_nodes,
            max_nodes=config.settings.max_nodes,
            node_selector=dict(NEVER_SCHEDULED),
        )
