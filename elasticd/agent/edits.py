"""The job-document edits of the agent: pure functions of the current document.

Each returns a :data:`~elasticd.models.JobMutation` that
``JobService.update_job(mutate=...)`` applies by compare-and-set (so it may
run more than once, on whatever document won the race, and must decide from
that document alone):

* :func:`record_failure`: remember the round's failures, the earliest in time
  the root cause and the others collateral (:func:`in_time_order`), until the
  next round forms (the job goes RESTARTING); a hang's cause is the rank whose
  stack differs from the others' (:func:`elasticd.agent.hangs.blame`);
* :func:`settle_failure`: when a round forms, charge the previous round's
  failure once, or free it when a participant did not come back (a node loss);
  a charged failure also closes the attempt's progress and may fail the job
  for ``max_no_progress_restarts`` (:func:`elasticd.agent.checkpoints.close_attempt`);
* :func:`record_carried_failure`: the same, in the daemon's next program image, for a
  failure the re-exec cut its agent off from recording;
* :func:`charge_now`: spend a restart at once (a failed health check);
* :func:`merge_recovery`: fold one node's recovery timeline into the job's.

Which side of the boundary: the daemon; pure, no IO.
"""

from __future__ import annotations

import signal as signals
from collections.abc import Iterable
from pathlib import Path

from elasticd.agent.checkpoints import close_attempt
from elasticd.agent.hangs import blame, innermost
from elasticd.agent.progress import Hang
from elasticd.models import (
    MAX_ROUND_FAILURES,
    Job,
    JobEdit,
    JobMutation,
    PendingFailure,
    RankStack,
    Recovery,
    RecoveryTotals,
    RootCause,
    incarnation_tag,
    tagged_for,
)
from elasticd.rendezvous import RoundInfo
from elasticd.rendezvous.ranks import WorkerRanks
from elasticd.states import JobState
from elasticd.supervise.process import WorkerExit

__all__ = [
    "charge_now",
    "in_time_order",
    "merge_recovery",
    "record_carried_failure",
    "record_failure",
    "root_cause_of",
    "root_cause_of_hang",
    "settle_failure",
]


def root_cause_of(
    failure: WorkerExit, ranks: WorkerRanks, node: str, attempt: int, round_: int, log_dir: Path
) -> RootCause:
    """What the job reports about one failed worker."""
    sig_name = None
    if failure.signal is not None:
        try:
            sig_name = signals.Signals(failure.signal).name
        except ValueError:
            sig_name = f"signal {failure.signal}"
    if failure.error is not None:
        message = failure.error.message
    elif sig_name is not None:
        message = f"worker was killed by {sig_name}"
    else:
        message = f"worker exited with code {failure.exit_code}"
    return RootCause(
        message=message,
        node=node,
        local_rank=failure.local_rank,
        rank=ranks.rank,
        exit_code=failure.exit_code,
        signal=failure.signal,
        signal_name=sig_name,
        traceback=failure.error.traceback if failure.error else None,
        timestamp=failure.error.timestamp if failure.error else failure.exited_at,
        attempt=attempt,
        round=round_,
        exited_at=failure.exited_at,
        log_dir=str(log_dir),
        source=failure.error.source if failure.error else None,
    )


def root_cause_of_hang(
    hang: Hang,
    rank: int,
    node: str,
    attempt: int,
    round_: int,
    log_dir: Path,
    at: float,
    stacks: list[RankStack] | None = None,
) -> RootCause:
    """What the job reports about a worker that stopped reporting progress, with where each
    of the node's ranks was (``stacks``, when they could be read)."""
    where = next((s.stack for s in stacks or [] if s.local_rank == hang.local_rank), None)
    return RootCause(
        message=f"rank {rank} hung"
        + (f" in {innermost(where)}" if where else "")
        + f": {hang.describe()}",
        stacks=stacks or None,
        node=node,
        local_rank=hang.local_rank,
        rank=rank,
        timestamp=at,
        exited_at=at,
        attempt=attempt,
        round=round_,
        log_dir=str(log_dir),
    )


def in_time_order(failures: list[RootCause]) -> list[RootCause]:
    """A round's failures, one per node, as listed in the order the store recorded them,
    put in the order they happened: the first is the root cause.

    Wall clocks are not compared across nodes (a node whose clock is behind would
    always look first): each failure carries ``since_round_s``, the time from its
    node seeing the round form to its detecting the failure on that node's
    monotonic clock, and the round forms for every node at once (one store
    write, seen through each node's watch). Failures without it (a daemon that
    re-executed lost its reference) keep their place in the store's order, which
    is the order the nodes noticed and wrote them; so do exact ties.
    """
    order = sorted(
        range(len(failures)),
        key=lambda i: (
            failures[i].since_round_s is None,
            failures[i].since_round_s if failures[i].since_round_s is not None else 0.0,
            i,
        ),
    )
    return [failures[i] for i in order]


def record_failure(round_: RoundInfo, root: RootCause, *, alone: bool = False) -> JobMutation:
    """Job-document edit: add this node's failure to the round's; the first in time is the
    job's ``error``, the rest its ``collateral``, until the next round forms. When the
    first is a hang, the ranks' stacks may name another cause (:func:`blame`): the rank
    whose stack differs (asleep while the others wait in ``all_reduce``).

    ``alone``: no participant can be lost before the next round (a job of one node, this
    one): the failure is charged now, not when that round forms, so a job with no restart
    left fails at once instead of saying it restarts (issue 41)."""

    def edit(job: Job) -> JobEdit:
        if job.state.is_terminal:
            return {}
        pending = job.pending_failure
        recorded: list[RootCause] = []
        if pending is not None and pending.round == round_.round:
            recorded = list(pending.failures) or [pending.error]
            if any(f.node == root.node for f in recorded):
                return {}  # this node's failure of the round is in already (an edit run twice)
        failures = [*recorded, root]
        ordered = in_time_order(failures)
        kept = ordered[:MAX_ROUND_FAILURES]
        failures = [f for f in failures if any(f is k for k in kept)]
        first, rest = kept[0], kept[1:]
        blamed = blame(kept)
        if blamed is not None:  # a hang: the rank whose stack differs is the cause
            index, first = blamed
            rest = [f for i, f in enumerate(kept) if i != index]
        changes: JobEdit = {
            "pending_failure": PendingFailure(
                round=round_.round,
                participants=sorted(round_.participants),
                error=first,
                failures=failures,
            ),
            "error": first,
            # Their stacks stay in pending_failure only (the edit's next run reads them):
            # the job document holds no third copy of every rank's stack.
            "collateral": [f.model_copy(update={"collateral": True, "stacks": None}) for f in rest],
        }
        said = first.message if blamed else f"{first.who(attempt=False)} failed: {first.message}"
        reason = f"{said}; restarting the group"
        if job.state is JobState.RUNNING:
            changes["state"] = JobState.RESTARTING  # RUNNING -> RESTARTING
            changes["reason"] = reason
        elif job.state is JobState.RESTARTING and first != job.error:
            changes["reason"] = reason  # an earlier failure came in: it is the cause
        if alone and job.restart_count >= job.max_restarts:
            seen = job.model_copy(update=changes)
            return {**changes, **_charge(seen, seen.pending_failure, round_.participants)}
        return changes

    return edit


def record_carried_failure(
    round_: RoundInfo,
    root: RootCause,
    *,
    alone: bool,
    job_tag: str | None,
    early_count: int | None = None,
) -> JobMutation:
    """Job-document edit, in the daemon's next program image: :func:`record_failure` of a
    failure its agent saw and had not recorded when the re-exec cut it off
    (:class:`~elasticd.agent.handover.CarriedFailure`). Not on another job of the id
    (``job_tag``), nor once the round's failure is charged (or freed) already: its record
    landed after all, and the next round formed; one that landed and waits is not recorded
    twice (:func:`record_failure` keeps one failure per node and round).

    ``early_count``: the workers were started early (a job of one node) and the store had
    not confirmed their round at the exec, the restart count it would carry. Formed as
    predicted (the failure before it charged, the count as predicted): recorded, as any.
    Not formed yet, or its failure before not charged yet (the exec cut the formation
    short; the next image forms the round anew, maybe under the same number, where the
    failure would never be charged): that failure is charged as the round's formation
    would have, and this one at once. Anything else (the count changed): the store's
    answer would have differed, and the early start never counted
    (:class:`~elasticd.agent.early.Formation`)."""
    record = record_failure(round_, root, alone=alone)

    def edit(job: Job) -> JobEdit:
        if round_.round <= job.charged_round or not tagged_for(job_tag, incarnation_tag(job)):
            return {}
        if early_count is None:
            return record(job)
        pending = job.pending_failure
        if pending is None or pending.round >= round_.round:
            return record(job) if job.restart_count == early_count else {}
        if job.restart_count != early_count - 1:
            return {}
        settled = _charge(job, pending, round_.participants)
        seen = job.model_copy(update=settled)
        if seen.state.is_terminal:
            return settled
        return {**settled, **charge_now(root)(seen)}

    return edit


def charge_now(root: RootCause) -> JobMutation:
    """Job-document edit: spend one restart now (a failed health check), or fail the job."""

    def edit(job: Job) -> JobEdit:
        if job.state.is_terminal:
            return {}
        if job.restart_count >= job.max_restarts:
            return {
                "state": JobState.FAILED,
                "error": root,
                "collateral": [],
                "reason": f"restart budget spent ({job.max_restarts} restarts); {root.message}",
            }
        return {"restart_count": job.restart_count + 1, "error": root, "collateral": []}

    return edit


def settle_failure(round_: RoundInfo) -> JobMutation:
    """Job-document edit run when a round completes: charge the previous round's failure once."""

    def edit(job: Job) -> JobEdit:
        pending = job.pending_failure
        if job.state.is_terminal or pending is None or pending.round >= round_.round:
            return {}
        return _charge(job, pending, round_.participants)

    return edit


def _charge(job: Job, pending: PendingFailure | None, participants: Iterable[str]) -> JobEdit:
    """The edit that charges ``pending`` (the job's pending failure) once, given the next
    round's ``participants``: free when one of its round's did not come back."""
    if pending is None:
        return {}
    if pending.round <= job.charged_round:
        return {"pending_failure": None}
    lost = sorted(set(pending.participants) - set(participants))
    if lost:  # a participant did not come back: a membership change, free
        return {"pending_failure": None, "charged_round": pending.round}
    err = pending.error
    root = f"root cause: {err.who(attempt=False)}: {err.message}"
    progress, stuck = close_attempt(job, pending.round)
    charged: JobEdit = {"pending_failure": None, "charged_round": pending.round}
    if progress != job.progress:
        charged["progress"] = progress
    if job.restart_count >= job.max_restarts:
        reason = f"restart budget spent ({job.max_restarts} restarts); {root}"
        return {**charged, "state": JobState.FAILED, "reason": reason}
    if stuck is not None:
        return {**charged, "state": JobState.FAILED, "reason": f"{stuck}; {root}"}
    return {**charged, "restart_count": job.restart_count + 1}


def merge_recovery(mine: Recovery) -> JobMutation:
    """Job-document edit: fold this node's view of a recovery into the job's summary.

    Nodes recover in parallel; the job's recovery spans from the earliest
    detection to the last node's spawn, each phase the slowest node's.
    """

    def edit(job: Job) -> JobEdit:
        if job.state.is_terminal:
            return {}
        old = job.last_recovery
        totals = job.recovery_totals
        if old is not None and old.round == mine.round:
            detected = min(old.detected_at, mine.detected_at)
            spawned = max(old.spawned_at or 0.0, mine.spawned_at or 0.0)

            def slowest(a: float | None, b: float | None) -> float | None:
                return max(x for x in (a, b) if x is not None) if a or b else None

            new = Recovery(
                round=mine.round,
                cause=old.cause,
                detected_at=detected,
                stop_s=slowest(old.stop_s, mine.stop_s),
                rendezvous_s=slowest(old.rendezvous_s, mine.rendezvous_s),
                spawn_s=slowest(old.spawn_s, mine.spawn_s),
                spawned_at=spawned,
                total_s=spawned - detected,
            )
            delta = (new.total_s or 0.0) - (old.total_s or 0.0)
            totals = RecoveryTotals(count=totals.count, total_s=totals.total_s + delta)
        else:
            new = mine
            totals = RecoveryTotals(
                count=totals.count + 1, total_s=totals.total_s + (mine.total_s or 0.0)
            )
        return {"last_recovery": new, "recovery_totals": totals}

    return edit


def merge_first_progress(round_: int, seconds: float) -> JobMutation:
    """Job-document edit: the new workers of round ``round_``'s recovery pinged after
    ``seconds``; the job's figure is the slowest node's."""

    def edit(job: Job) -> JobEdit:
        old = job.last_recovery
        if job.state.is_terminal or old is None or old.round != round_:
            return {}
        slowest = max(seconds, old.first_progress_s or 0.0)
        return {"last_recovery": old.model_copy(update={"first_progress_s": slowest})}

    return edit
