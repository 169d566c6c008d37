"""What the agent's runner awaits, each turned into the machine's event.

The runner (:mod:`elasticd.agent.agent`) steps the machine on events; these
functions are the waits that produce them: a start (``WorkersStarted`` or
``StartFailed``, whose side it is), a start's retry pause (``RetryDue``, or
the round's change that cuts it short), the health checks before a start
(``HealthFailed`` when they fail), and the running attempt's first outcome
(its workers' result, a hang, or the rendezvous change).

Which side of the boundary: the daemon.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from elasticd.agent import machine as m
from elasticd.agent.context import Emit, JobUpdater
from elasticd.agent.edits import charge_now
from elasticd.agent.group import LocalGroup
from elasticd.agent.hooks import HealthHook, ProgressHook
from elasticd.agent.nodefail import cause_of, side_of
from elasticd.agent.ports import Attribute
from elasticd.agent.watch import RoundWatch
from elasticd.clock import Clock
from elasticd.errors import SpawnStage, WorkerSpawnError
from elasticd.eventkinds import EventKind
from elasticd.rendezvous import Change
from elasticd.security import Identity
from elasticd.tasks import race

__all__ = ["health_failed", "monitor", "retry_later", "started"]


async def health_failed(
    health: HealthHook,
    identity: Identity | None,
    update_job: JobUpdater,
    job_id: str,
    attribute: Attribute | None = None,
) -> m.Event | None:
    """Run the health checks before a (re)start: None when healthy, else HealthFailed.

    A failure of an operator's check (the node's own, the GPU check; never the job's own
    ``health_check``) goes into the node's health record (``attribute``), which quarantines
    the node by the policy: then the job is not charged (the fleet moves it off this
    node, a membership change). Otherwise it spends one restart at once: a
    single-node job then tries again (or fails once the budget is spent); in a
    multi-node job this node leaves the rendezvous so that a spare or the others
    carry on.
    """
    failed = await health.failed_checks(identity)
    if failed is None:
        return None
    root, the_nodes = failed
    if (
        the_nodes
        and attribute is not None
        and await attribute("health_check", job_id, None, root.message)
    ):
        return m.HealthFailed(job_ended=False)  # quarantined: this node leaves, uncharged
    job = await update_job(job_id, mutate=charge_now(root))
    return m.HealthFailed(job_ended=job.state.is_terminal)


async def started(launch: Callable[[], Awaitable[None]], node: str, clock: Clock) -> m.Event:
    """Start the round's workers: WorkersStarted, or StartFailed (whose side it is)."""
    try:
        try:
            await launch()
        except OSError as exc:  # the daemon's own work
            raise WorkerSpawnError(
                f"the daemon could not prepare the start: {exc}", stage=SpawnStage.DAEMON
            ) from exc
    except WorkerSpawnError as exc:
        return m.StartFailed(
            side_of(exc),
            f"workers could not be started on {node}: {exc}",
            error=str(exc),
            cause=cause_of(exc),
            at=clock.monotonic(),
        )
    return m.WorkersStarted()


async def retry_later(
    emit: Emit, node: str, watch: RoundWatch, my_round: int, retry: m.RetryStart, spawn_seq: int
) -> m.Event:
    """Say a start is retried, then wait, but not past the round: the job may end, or the
    others re-form. RetryDue, or the change."""
    emit(
        EventKind.WORKERS_SPAWN_RETRY,
        f"{node} could not start the workers of attempt {spawn_seq} "
        f"({retry.cause}: {retry.error}); this is the node's trouble, not the job's: "
        f"trying again in {retry.delay:.2f} s (try {retry.tries}, no restart spent)",
        attempt=spawn_seq,
        cause=retry.cause,
        count=retry.tries,
    )
    which, change = await race(asyncio.sleep(retry.delay), watch.change(my_round))
    if which == 1:
        assert isinstance(change, Change)
        return m.RoundChanged(change)
    return m.RetryDue()


async def monitor(
    group: LocalGroup, progress: ProgressHook, watch: RoundWatch, my_round: int
) -> m.Event:
    """The running attempt's result, a hang, or the rendezvous change that interrupts it;
    meanwhile its steps and checkpoints are read."""

    async def outcome() -> m.Event:
        return m.WorkersEnded(await group.outcome())

    async def hang() -> m.Event:
        return m.HangSeen(await progress.hang())

    async def changed() -> m.Event:
        return m.RoundChanged(await watch.change(my_round))

    async def read_progress() -> m.Event:
        await progress.watch()
        raise AssertionError("the progress watch never returns")  # pragma: no cover

    # In order of precedence when several are ready at once: the group's own result,
    # then a hang, then a rendezvous change.
    contenders = [outcome()]
    if progress.watches_hangs:
        contenders.append(hang())
    contenders += [changed(), read_progress()]
    _, event = await race(*contenders)
    return event
