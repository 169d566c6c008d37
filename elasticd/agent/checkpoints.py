"""Training progress across attempts: steps, the last checkpoint, and the no-progress rule.

Workers report their step (``ping(step=N)``) and their durable checkpoints
(``checkpointed(step, path)``) through their heartbeat files
(:mod:`elasticd.worker.heartbeat`). Each node's agent folds what its
workers' files say into one :class:`~elasticd.models.AttemptProgress` per
attempt (:func:`observe`, pure), and merges it into the job document
(:func:`merge_attempt`, a compare-and-set edit) when a checkpoint lands and
when its workers stop. The job document (:class:`~elasticd.models.JobProgress`)
is the one place that survives a node: the last checkpoint (any attempt, any
node; rank 0 may move), the highest step of the attempts that ended, the
current attempt, and how many restarts in a row made no progress. A
restarted attempt gets the job's last checkpoint as ``ELASTICD_CHECKPOINT_STEP``
(and ``ELASTICD_CHECKPOINT_PATH``).

**The rule** (``max_no_progress_restarts``), decided by :func:`close_attempt`
when the failure of an attempt is charged (:func:`elasticd.agent.edits.settle_failure`):
an attempt made progress when it reported a checkpoint past the one it
started from; for a job that never reported a checkpoint, when it reported a
step past every earlier attempt's. A failed attempt that was itself a
restart (a restart had been spent before it) and made no progress adds one
to ``no_progress_restarts``; one that made progress resets it to 0. Once it
reaches ``max_no_progress_restarts`` the job fails, with a reason that says so.
A job that reports neither steps nor checkpoints never makes progress in
this sense: set the rule only for jobs that report.

Nothing here is kept elsewhere: a daemon that restarts rebuilds its
attempt's record from the heartbeat files and the job document.

Which side of the boundary: the daemon; pure, no IO.
"""

from __future__ import annotations

from collections.abc import Iterable

from elasticd.agent.progress import Beat
from elasticd.models import AttemptProgress, Job, JobEdit, JobMutation, JobProgress

__all__ = ["close_attempt", "made_progress", "merge_attempt", "observe"]


def _max(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)


def _min_f(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


def _max_f(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else max(a, b)


def observe(
    progress: AttemptProgress, beats: Iterable[Beat], wall_offset: float
) -> AttemptProgress:
    """``progress`` with what ``beats`` say (the highest step and checkpoint win).

    ``wall_offset`` turns the beats' monotonic times into wall time
    (``time() - monotonic()`` of the daemon at the read).
    """
    out = progress
    since: float | None = None
    for beat in beats:
        update: dict[str, object] = {"max_step": _max(out.max_step, beat.step)}
        if beat.checkpoint_step is not None and (
            out.checkpoint_step is None or beat.checkpoint_step > out.checkpoint_step
        ):
            update["checkpoint_step"] = beat.checkpoint_step
            update["checkpoint_path"] = beat.checkpoint_path
        if beat.last_ping is not None:
            at = beat.last_ping + wall_offset
            update["first_step_at"] = _min_f(out.first_step_at, at)
            update["last_step_at"] = _max_f(out.last_step_at, at)
        if beat.checkpointing_since is not None:
            since = _min_f(since, beat.checkpointing_since + wall_offset)
        out = out.model_copy(update=update)
    return out.model_copy(update={"checkpointing_since": since})


def _combine(old: AttemptProgress, new: AttemptProgress) -> AttemptProgress:
    """Two nodes' (or two reports') views of one attempt."""
    take_new = new.checkpoint_step is not None and (
        old.checkpoint_step is None or new.checkpoint_step > old.checkpoint_step
    )
    return old.model_copy(
        update={
            "started_from": old.started_from if old.started_from is not None else new.started_from,
            "max_step": _max(old.max_step, new.max_step),
            "checkpoint_step": new.checkpoint_step if take_new else old.checkpoint_step,
            "checkpoint_path": new.checkpoint_path if take_new else old.checkpoint_path,
            "first_step_at": _min_f(old.first_step_at, new.first_step_at),
            "last_step_at": _max_f(old.last_step_at, new.last_step_at),
            "checkpointing_since": new.checkpointing_since,
        }
    )


def merge_attempt(mine: AttemptProgress, now: float) -> JobMutation:
    """Job-document edit: fold one node's report of an attempt into the job's progress.

    The job's checkpoint moves only forward. A report of a newer round
    replaces the current attempt (whose highest step joins the job's); one of
    an older round only adds its step and checkpoint.
    """

    def edit(job: Job) -> JobEdit:
        if job.state.is_terminal:
            return {}
        p = job.progress
        current = p.attempt
        max_step = p.max_step
        if current is None or current.round < mine.round:
            if current is not None:
                max_step = _max(max_step, current.max_step)
            attempt: AttemptProgress | None = mine
        elif current.round == mine.round:
            attempt = _combine(current, mine)
        else:  # a late report of an attempt that already ended
            attempt, max_step = current, _max(max_step, mine.max_step)
        update: dict[str, object] = {"attempt": attempt, "max_step": max_step}
        if mine.checkpoint_step is not None and (
            p.checkpoint_step is None or mine.checkpoint_step > p.checkpoint_step
        ):
            update.update(
                checkpoint_step=mine.checkpoint_step,
                checkpoint_path=mine.checkpoint_path,
                checkpoint_at=now,
            )
        new = p.model_copy(update=update)
        return {} if new == p else {"progress": new}

    return edit


def made_progress(
    attempt: AttemptProgress | None, earlier_max_step: int | None, *, checkpoints: bool
) -> bool:
    """Whether an attempt made progress (see the module's rule).

    ``checkpoints``: the job has reported a checkpoint (any attempt);
    ``earlier_max_step``: the highest step of every earlier attempt.
    """
    if attempt is None:
        return False
    if attempt.checkpoint_step is not None and (
        attempt.started_from is None or attempt.checkpoint_step > attempt.started_from
    ):
        return True
    if checkpoints:
        return False
    return attempt.max_step is not None and (
        earlier_max_step is None or attempt.max_step > earlier_max_step
    )


def close_attempt(job: Job, failed_round: int) -> tuple[JobProgress, str | None]:
    """The job's progress once the failure of ``failed_round`` is charged, and why to stop.

    Returns the new :class:`~elasticd.models.JobProgress` (the attempt's
    highest step joined to the job's, the no-progress count moved) and, when
    ``max_no_progress_restarts`` is reached, the reason the job fails.
    """
    p = job.progress
    attempt = p.attempt if p.attempt is not None and p.attempt.round == failed_round else None
    progressed = made_progress(attempt, p.max_step, checkpoints=p.checkpoint_step is not None)
    was_restart = job.restart_count > 0
    count = 0 if progressed else p.no_progress_restarts + (1 if was_restart else 0)
    new = p.model_copy(
        update={
            "max_step": _max(p.max_step, attempt.max_step if attempt else None),
            "no_progress_restarts": count,
        }
    )
    limit = job.spec.max_no_progress_restarts
    if limit is None or count < limit:
        return new, None
    where = (
        f"the last checkpoint is step {p.checkpoint_step}"
        if p.checkpoint_step is not None
        else "no checkpoint was reported"
        if new.max_step is None
        else f"no checkpoint was reported; the highest step is {new.max_step}"
    )
    return new, (
        f"no progress in {count} restarts in a row (max_no_progress_restarts = {limit}): {where}"
    )
