"""Goodput: where a job's wall time went, folded from a timeline of facts (issue 26).

Pure: no IO, no clock (``now`` comes in). The facts are what the daemons
saw of each attempt (:class:`AttemptFacts`: spawned, first progress, the
highest step and when, checkpoints, how it ended and when that was
detected), kept per node in the store (``gp/<job>/<node>``, one writer each,
see :mod:`elasticd.keys`) by the agent's goodput hook
(:mod:`elasticd.agent.goodput`). :func:`merge_nodes` joins the nodes'
records into one attempt per rendezvous round; :func:`account` folds them,
with the job's submission, placement and end, into a :class:`Goodput`.

How the time is split (``docs/goodput.md`` defines each figure): the
interval from submission to the end (or ``now``) is walked once, left to
right, and every second of it is charged to exactly one kind, so
``productive_s + sum(badput_s) == wall_s`` by construction:

* ``queue``: submitted → placed (the fleet scheduler gave it nodes);
* ``startup``: placed → the first attempt's first progress, and a later
  attempt's spawn → its first progress when no failure preceded it
  (a preemption or a daemon stop);
* ``productive``: first progress → the attempt's end (its failure's
  detection, its last progress before a hang, its stop, the job's end); an
  attempt that showed no progress has none: its time stays in the kind
  before it (start-up, recovery), which lasts until a first progress;
* ``hang``: a hung attempt's last progress → the hang's detection;
* ``recovery``: a failure's (or hang's) detection → the next attempt's
  first progress;
* ``preempted``: a preemption → the next attempt's spawn;
* ``lost_work``: at each failure, hang or preemption, the steps past the
  job's last checkpoint, converted to time at that attempt's own step rate
  (its productive time over the steps it made), and moved from productive
  to this kind (never more than the attempt's productive time);
* ``other``: anything else (after a daemon stop until the next spawn, after
  a failed job's last failure, gaps the facts do not explain).

An attempt that never reported a step has no step rate: the lost work of its
failure is unknown (``lost_work_known`` false, ``lost_steps`` None), and its
time after its first progress stays productive. A job that never reported
progress at all (it does not use :mod:`elasticd.worker`) has no productive
time, and says so (``progress_reported`` false): nothing is evidence that
its workers did useful work (issue 33).

Wall-clock steps (issue 33): each node's facts are stamped on a steady clock
(:class:`elasticd.clock.SteadyWallClock`, see :mod:`elasticd.agent.goodput`),
but the job's own stamps (submission, end, events) come from wall clocks.
So nothing here depends on times being in order: attempts are ordered by
their round, checkpoints by their attempt (then as read), and the walk only
moves forward (a stamp behind it charges nothing; the end is never before
the last fact nor the submission). A finished job's end is its last
attempt's end as that attempt's node saw it (on the facts' clock) when that
attempt is the one that finished it.

Which side of the boundary: shared (pure; the daemon and the CLI).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pydantic import BaseModel, Field

from elasticd.eventkinds import EventKind
from elasticd.models import JOB_TAG_PATTERN, Event, Job

__all__ = [
    "BADPUT_KINDS",
    "FACT_KINDS",
    "MAX_ATTEMPTS",
    "MAX_CHECKPOINTS",
    "MAX_PAGES",
    "MAX_SAMPLES",
    "PAGE_ATTEMPTS",
    "AttemptFacts",
    "End",
    "FailureMark",
    "Goodput",
    "GoodputSteps",
    "JobFacts",
    "NodeGoodput",
    "Observation",
    "StepPoint",
    "account",
    "add_sample",
    "begin_attempt",
    "end_attempt",
    "job_facts",
    "join_pages",
    "merge_nodes",
    "observe",
    "seal",
    "walk_end",
]

#: The badput kinds, in the order they are shown.
BADPUT_KINDS = ("startup", "queue", "recovery", "lost_work", "hang", "preempted", "other")

#: Attempts one node's record keeps (the oldest go first; their time becomes ``other``).
MAX_ATTEMPTS = 256
#: Ended attempts sealed into one page (``gp/<job>/<node>/<page>``, written once): the
#: record a node rewrites at every attempt holds its newest attempts only, so a write's
#: size, and the copies a store's watch history keeps, do not grow with the job's age
#: (issue 34: 62 KB records rewritten at every attempt were most of that history).
PAGE_ATTEMPTS = 16
#: Pages kept per node (the oldest is deleted when a new one is sealed): with the record's
#: own attempts (at most twice a page and the open one), never more than MAX_ATTEMPTS.
MAX_PAGES = MAX_ATTEMPTS // PAGE_ATTEMPTS - 3
#: Step samples one attempt keeps (thinned to every other one when full).
MAX_SAMPLES = 64
#: Checkpoints one attempt keeps (the latest).
MAX_CHECKPOINTS = 16


class End(enum.StrEnum):
    """How an attempt ended, as its node saw it."""

    FAILED = "failed"
    """A worker failed (exit, failed health check): detected at ``ended_at``."""
    HUNG = "hung"
    """A worker missed its progress deadline: detected at ``ended_at``."""
    PREEMPTED = "preempted"
    """The fleet scheduler took the job's nodes (a higher-priority job)."""
    STOPPED = "stopped"
    """Stopped for no fault of the job: the daemon stopped, the node gave it back."""
    FINISHED = "finished"
    """The job ended (succeeded, cancelled) with this attempt."""


class StepPoint(BaseModel):
    """A step seen at a wall time."""

    t: float
    step: int = Field(ge=0)


class AttemptFacts(BaseModel):
    """What one node saw of one attempt (a rendezvous round's workers on it)."""

    round: int = Field(ge=0)
    spawned_at: float
    first_progress_at: float | None = None
    """The first ping (with or without a step)."""
    first_step: int | None = Field(default=None, ge=0)
    """The step of the first ping that carried one."""
    first_step_at: float | None = None
    max_step: int | None = Field(default=None, ge=0)
    max_step_at: float | None = None
    last_progress_at: float | None = None
    checkpoints: list[StepPoint] = Field(default_factory=list, max_length=MAX_CHECKPOINTS)
    samples: list[StepPoint] = Field(default_factory=list, max_length=MAX_SAMPLES)
    end: End | None = None
    ended_at: float | None = None
    """When the end was detected (a failure, a hang) or happened (a stop)."""


class NodeGoodput(BaseModel):
    """One node's record of a job (``gp/<job>/<node>``): its attempts, oldest first.

    The stored record holds the newest attempts; older ones are sealed, a page of
    :data:`PAGE_ATTEMPTS` at a time, into pages of the same shape
    (``gp/<job>/<node>/<page>``, :func:`seal`), which :func:`join_pages` puts back in
    front. An older daemon's record has no pages (and an older reader sees the newest
    attempts only)."""

    node: str
    attempts: list[AttemptFacts] = Field(default_factory=list, max_length=MAX_ATTEMPTS)
    job_tag: str | None = Field(default=None, pattern=JOB_TAG_PATTERN)
    """Which job of its id the record is about (``models.incarnation_tag``): a deleted
    job's agent may still publish it after the id was taken again (None: an older
    daemon's)."""
    pages: int = Field(default=0, ge=0)
    """The record: how many pages its node sealed before its first attempt."""
    page: int | None = Field(default=None, ge=0)
    """A page: its number (None: the record itself)."""


def seal(record: NodeGoodput) -> tuple[NodeGoodput, NodeGoodput | None]:
    """The record with its oldest :data:`PAGE_ATTEMPTS` attempts taken out, and the page
    that holds them; or the record as it is and None, while it holds fewer than two pages
    of attempts or the oldest page's are not all ended (an open attempt stays in the
    record, where it is rewritten)."""
    head = record.attempts[:PAGE_ATTEMPTS]
    if len(record.attempts) < 2 * PAGE_ATTEMPTS or any(a.end is None for a in head):
        return record, None
    page = NodeGoodput(node=record.node, job_tag=record.job_tag, attempts=head, page=record.pages)
    rest = record.model_copy(
        update={"attempts": record.attempts[PAGE_ATTEMPTS:], "pages": record.pages + 1}
    )
    return rest, page


def join_pages(record: NodeGoodput, pages: Iterable[NodeGoodput]) -> NodeGoodput:
    """The record with its pages' attempts in front (the :data:`MAX_PAGES` before it; a
    round the record holds too is the record's: a page may be written before the record
    that no longer holds its attempts)."""
    kept = [
        p
        for p in pages
        if p.page is not None
        and p.node == record.node
        and p.job_tag == record.job_tag
        and record.pages - MAX_PAGES <= p.page < record.pages
    ]
    own = {a.round for a in record.attempts}
    earlier = {
        a.round: a
        for p in sorted(kept, key=lambda p: p.page or 0)
        for a in p.attempts
        if a.round not in own
    }
    attempts = [*sorted(earlier.values(), key=lambda a: a.round), *record.attempts]
    return record.model_copy(update={"attempts": attempts[-MAX_ATTEMPTS:]})


@dataclass(frozen=True)
class JobFacts:
    """What the job document and the events say around the attempts."""

    submitted_at: float
    placed_at: float | None = None
    """When the job first got nodes (None: at once, no queue)."""
    finished_at: float | None = None
    preempted_at: tuple[float, ...] = ()
    """Preemptions (``job.preempted``): an attempt running then ended by one."""


#: The event kinds :func:`job_facts` reads (the rest it ignores, so a caller need read no other).
FACT_KINDS = frozenset({EventKind.JOB_PLACED, EventKind.JOB_PREEMPTED})


def job_facts(job: Job, events: Iterable[Event]) -> JobFacts:
    """The job's submission and end (its document), its first placement and its preemptions
    (its ``job.placed`` and ``job.preempted`` events)."""
    placed: list[float] = []
    preempted: list[float] = []
    for event in events:
        if event.kind == EventKind.JOB_PLACED:
            placed.append(event.time)
        elif event.kind == EventKind.JOB_PREEMPTED:
            preempted.append(event.time)
    finished = job.finished_at if job.state.is_terminal else None
    if job.state.is_terminal and finished is None:
        finished = job.started_at or job.created_at
    return JobFacts(
        submitted_at=job.created_at,
        placed_at=min(placed) if placed else None,
        finished_at=finished,
        preempted_at=tuple(sorted(preempted)),
    )


class GoodputSteps(BaseModel):
    max_step: int | None = Field(description="The highest step any attempt reported.")
    checkpoint_step: int | None = Field(description="The last durable checkpoint's step.")
    lost_steps: int | None = Field(
        description="Steps past the last checkpoint at each failure, summed (None: unknown)."
    )
    failures: int = Field(description="Attempts that ended by a failure or a hang.")


class FailureMark(BaseModel):
    t: float
    end: End
    step: int | None = None


class Goodput(BaseModel):
    """Where a job's time went (``GET /jobs/{id}/goodput``; docs/goodput.md)."""

    job_id: str
    as_of: float = Field(description="The wall time the figures are computed at.")
    finished: bool
    wall_s: float
    productive_s: float
    goodput: float = Field(ge=0, le=1, description="productive_s / wall_s (0 when wall_s is 0).")
    badput_s: dict[str, float] = Field(description=f"Seconds per kind: {', '.join(BADPUT_KINDS)}.")
    steps: GoodputSteps
    progress_reported: bool = Field(
        default=True,
        description="Some attempt reported progress (a ping, with or without a step); "
        "false: no time is counted as productive (nothing shows that the job progressed). "
        "An older daemon's answer lacks it: true.",
    )
    steps_reported: bool = Field(description="Some attempt reported a step.")
    lost_work_known: bool = Field(
        description="Every failure's attempt reported steps, so lost_work is measured."
    )
    attempts: int
    series: list[StepPoint] = Field(default_factory=list, description="Steps over time.")
    checkpoints: list[StepPoint] = Field(default_factory=list)
    failures: list[FailureMark] = Field(default_factory=list)


def add_sample(samples: list[StepPoint], point: StepPoint) -> None:
    """Append a step sample, thinning to every other one when :data:`MAX_SAMPLES` is reached.

    The first and the newest samples are always kept; the spacing doubles
    each time the list fills, so a long attempt costs a bounded record.
    """
    if samples and samples[-1].step == point.step:
        return
    if len(samples) >= MAX_SAMPLES:
        samples[:] = samples[::2]
    samples.append(point)


@dataclass(frozen=True)
class Observation:
    """One worker's heartbeat as read now (``ProgressHook.observations``)."""

    last_progress_at: float | None
    """Wall time of its last ping; None when it never pinged."""
    step: int | None = None
    """The step of its last ``ping(step=)``; None when it never gave one."""
    checkpoint_step: int | None = None
    """Its last ``checkpointed(step)``; None when none."""


def observe(
    attempt: AttemptFacts, seen: Sequence[Observation], now: float
) -> tuple[AttemptFacts, bool]:
    """The attempt as the workers' heartbeats say now, and whether a fact worth writing at
    once changed (the first progress, the first step, a new checkpoint); mere step samples
    may wait.

    A step's time is the ping that carried it (the worker's own clock reading,
    exact); a checkpoint's is ``now`` (the file has no time for it: the
    read that first sees it, so a checkpoint is placed at most one sampling
    interval late). The attempt's step is the highest of its workers'.
    """
    pinged = [o for o in seen if o.last_progress_at is not None]
    if not pinged:
        return attempt, False
    update: dict[str, object] = {}
    urgent = False
    last = max(o.last_progress_at for o in pinged if o.last_progress_at is not None)
    if attempt.first_progress_at is None:
        update["first_progress_at"] = min(o.last_progress_at or last for o in pinged)
        urgent = True
    update["last_progress_at"] = max(last, attempt.last_progress_at or last)
    stepped = [o for o in pinged if o.step is not None]
    samples = list(attempt.samples)
    if stepped:
        top = max(stepped, key=lambda o: (o.step or 0, o.last_progress_at or 0.0))
        step, at = top.step or 0, top.last_progress_at or now
        if attempt.first_step is None:
            update.update(first_step=step, first_step_at=at)
            urgent = True
        if attempt.max_step is None or step > attempt.max_step:
            update.update(max_step=step, max_step_at=at)
            add_sample(samples, StepPoint(t=at, step=step))
            update["samples"] = samples
    marks = [o.checkpoint_step for o in pinged if o.checkpoint_step is not None]
    if marks:
        mark = max(marks)
        known = attempt.checkpoints[-1].step if attempt.checkpoints else None
        if mark != known:
            points = [*attempt.checkpoints, StepPoint(t=now, step=mark)]
            update["checkpoints"] = points[-MAX_CHECKPOINTS:]
            urgent = True
    return attempt.model_copy(update=update), urgent


def begin_attempt(record: NodeGoodput, round_: int, spawned_at: float) -> NodeGoodput:
    """A new attempt in the node's record (the oldest dropped past :data:`MAX_ATTEMPTS`).

    An attempt still open there (its daemon stopped without saying how it
    ended) is closed as stopped at its last known time.
    """
    attempts = [close_open(a) for a in record.attempts]
    attempts.append(AttemptFacts(round=round_, spawned_at=spawned_at))
    return record.model_copy(update={"attempts": attempts[-MAX_ATTEMPTS:]})


def close_open(attempt: AttemptFacts) -> AttemptFacts:
    """An attempt with no end, ended (stopped) at the last time it was known alive."""
    if attempt.end is not None:
        return attempt
    known = [attempt.spawned_at, attempt.last_progress_at or 0.0, attempt.max_step_at or 0.0]
    return attempt.model_copy(update={"end": End.STOPPED, "ended_at": max(known)})


def end_attempt(attempt: AttemptFacts, end: End, at: float) -> AttemptFacts:
    """The attempt ended (the first end said counts: a stop after a failure is its recovery)."""
    if attempt.end is not None:
        return attempt
    return attempt.model_copy(update={"end": end, "ended_at": at})


_END_RANK = {End.HUNG: 4, End.FAILED: 3, End.PREEMPTED: 2, End.STOPPED: 1, End.FINISHED: 0}


def _merge_two(a: AttemptFacts, b: AttemptFacts) -> AttemptFacts:
    def low(x: float | None, y: float | None) -> float | None:
        return y if x is None else x if y is None else min(x, y)

    def high(x: float | None, y: float | None) -> float | None:
        return y if x is None else x if y is None else max(x, y)

    # A step of 0 is a step like any other: never ``(x.max_step or -1)``, which reads it as
    # none (the merge then kept the other node's None, in one order of the two only).
    top = (
        a
        if (-1 if a.max_step is None else a.max_step) >= (-1 if b.max_step is None else b.max_step)
        else b
    )
    first = (
        a
        if a.first_step_at is not None
        and (b.first_step_at is None or a.first_step_at <= b.first_step_at)
        else b
    )
    end, ended_at = a.end, a.ended_at
    if b.end is not None and (end is None or _END_RANK[b.end] > _END_RANK[end]):
        end, ended_at = b.end, b.ended_at
    elif b.end is not None and b.end == end:
        # A fault is detected by the first node that sees it; a stop ends with the last.
        pick = low if end in (End.FAILED, End.HUNG) else high
        ended_at = pick(ended_at, b.ended_at)
    checkpoints = {(c.step, c.t): c for c in [*a.checkpoints, *b.checkpoints]}
    # In step order: within one attempt a later checkpoint is a higher step, whatever the
    # (two nodes', possibly stepped) clocks say.
    samples = sorted([*a.samples, *b.samples], key=lambda p: p.t)
    return AttemptFacts(
        round=a.round,
        spawned_at=min(a.spawned_at, b.spawned_at),
        first_progress_at=low(a.first_progress_at, b.first_progress_at),
        first_step=first.first_step,
        first_step_at=first.first_step_at,
        max_step=top.max_step,
        max_step_at=top.max_step_at,
        last_progress_at=high(a.last_progress_at, b.last_progress_at),
        checkpoints=sorted(checkpoints.values(), key=lambda c: (c.step, c.t))[-MAX_CHECKPOINTS:],
        samples=samples[-MAX_SAMPLES:] if len(samples) > MAX_SAMPLES else samples,
        end=end,
        ended_at=ended_at,
    )


def merge_nodes(records: Iterable[NodeGoodput]) -> list[AttemptFacts]:
    """One attempt per rendezvous round, joined over the nodes that ran it, in round order
    (rounds only go up; spawn times are wall stamps that a clock's step can reorder)."""
    by_round: dict[int, AttemptFacts] = {}
    for record in records:
        for attempt in record.attempts:
            seen = by_round.get(attempt.round)
            by_round[attempt.round] = attempt if seen is None else _merge_two(seen, attempt)
    return sorted(by_round.values(), key=lambda a: a.round)


class _Ledger:
    """The walk: charges ``[cursor, until)`` to one kind at a time."""

    def __init__(self, start: float, end: float) -> None:
        self.cursor, self.end = start, end
        self.productive = 0.0
        self.bad = dict.fromkeys(BADPUT_KINDS, 0.0)

    def spend(self, kind: str, until: float | None) -> float:
        """Charge up to ``until`` (clamped to the walk) to ``kind``; the seconds charged."""
        if until is None:
            return 0.0
        stop = min(max(until, self.cursor), self.end)
        seconds = stop - self.cursor
        if kind == "productive":
            self.productive += seconds
        else:
            self.bad[kind] += seconds
        self.cursor = stop
        return seconds


def _times(a: AttemptFacts) -> list[float]:
    """Every time the attempt's facts hold."""
    times = [a.spawned_at, *(c.t for c in a.checkpoints)]
    for t in (a.first_progress_at, a.first_step_at, a.max_step_at, a.last_progress_at):
        if t is not None:
            times.append(t)
    if a.ended_at is not None:
        times.append(a.ended_at)
    return times


def walk_end(job: JobFacts, attempts: Sequence[AttemptFacts], now: float) -> float:
    """Where the walk ends: the job's end (a finished job) or ``now``; never before its
    submission nor its last fact (a stamp of a wall clock that stepped back since).

    A job that finished with its last attempt ends where that attempt's node saw the end,
    on the clock of the facts (steady), not at ``finished_at`` (a wall stamp taken a
    moment later, perhaps after a step of that clock)."""
    last = attempts[-1] if attempts else None
    if job.finished_at is None:
        end = now
    elif last is not None and last.end is End.FINISHED and last.ended_at is not None:
        end = last.ended_at
    else:
        end = job.finished_at
    latest = max((t for a in attempts for t in _times(a)), default=end)
    return max(end, latest, job.submitted_at)


def _progress_end(a: AttemptFacts, end: float) -> float:
    """Where the attempt's productive time stops."""
    if a.end is End.HUNG:
        last = a.last_progress_at if a.last_progress_at is not None else a.first_progress_at
        return last if last is not None else a.spawned_at
    return _attempt_end(a, end)


def _attempt_end(a: AttemptFacts, end: float) -> float:
    """Where the attempt stops: its end (detected or happened), or the walk's."""
    if a.end is not None and a.ended_at is not None:
        return a.ended_at
    return end


def account(job_id: str, job: JobFacts, attempts: Sequence[AttemptFacts], now: float) -> Goodput:
    """Fold the facts into where the time went, as of ``now`` (see the module docstring)."""
    attempts = sorted(attempts, key=lambda a: a.round)
    end = walk_end(job, attempts, now)
    ledger = _Ledger(job.submitted_at, end)
    if job.placed_at is not None:
        ledger.spend("queue", job.placed_at)
    checkpoints: list[StepPoint] = []  # the attempts' so far, in their order
    gap = "startup"  # what the time until the next attempt's first progress is
    failures: list[FailureMark] = []
    lost_steps, lost_known, steps_reported = 0, True, False
    for attempt in (_preempted(a, job.preempted_at) for a in attempts):
        if gap in ("preempted", "other"):
            ledger.spend(gap, attempt.spawned_at)
            gap = "startup"
        first = attempt.first_progress_at
        if first is None:
            # No sign of progress: start-up (or the recovery) goes on until its end.
            ledger.spend(gap, _attempt_end(attempt, end))
            productive = 0.0
        else:
            ledger.spend(gap, first)
            productive = ledger.spend("productive", _progress_end(attempt, end))
        checkpoints.extend(attempt.checkpoints)
        steps_reported = steps_reported or attempt.max_step is not None
        ended = attempt.end
        if ended in (End.FAILED, End.HUNG, End.PREEMPTED):
            if attempt.max_step is None:
                lost_known = False
            else:
                # The last checkpoint so far: this attempt's last, or an earlier one's
                # (never chosen by a time: the clocks of two attempts may disagree).
                base = checkpoints[-1].step if checkpoints else 0
                lost = max(0, attempt.max_step - base)
                lost_steps += lost
                ledger.productive -= (moved := _lost_seconds(attempt, lost, productive))
                ledger.bad["lost_work"] += moved
        if ended is End.HUNG:
            ledger.spend("hang", attempt.ended_at)
        if ended in (End.FAILED, End.HUNG):
            failures.append(
                FailureMark(t=attempt.ended_at or ledger.cursor, end=ended, step=attempt.max_step)
            )
            gap = "recovery"
        elif ended is End.PREEMPTED:
            ledger.spend("preempted", attempt.ended_at)
            gap = "preempted"
        elif ended is not None:
            gap = "other"
    # The rest: a recovery still under way, or what follows a job's last attempt.
    still_recovering = job.finished_at is None and gap == "recovery"
    if attempts:
        rest = "recovery" if still_recovering else "other"
    else:  # nothing ran yet: waiting for nodes, or starting on them
        rest = "queue" if job.placed_at is None else "startup"
    ledger.spend(rest, end)
    return _result(
        job_id,
        job,
        attempts,
        ledger,
        end,
        failures,
        checkpoints,
        lost_steps if lost_known else None,
        lost_known,
        steps_reported,
    )


#: A stop this many seconds after a ``job.preempted`` event is that preemption's.
PREEMPTION_SLACK = 120.0


def _preempted(attempt: AttemptFacts, preemptions: Sequence[float]) -> AttemptFacts:
    """A stopped attempt that a preemption ended (the agent sees only a stop)."""
    at = attempt.ended_at
    if attempt.end is not End.STOPPED or at is None:
        return attempt
    if any(attempt.spawned_at <= p <= at <= p + PREEMPTION_SLACK for p in preemptions):
        return attempt.model_copy(update={"end": End.PREEMPTED})
    return attempt


def _lost_seconds(attempt: AttemptFacts, lost: int, productive: float) -> float:
    """Lost steps in time, at the attempt's own rate (never more than its productive time)."""
    if lost <= 0 or productive <= 0:
        return 0.0
    made = (attempt.max_step or 0) - (attempt.first_step or 0)
    span = (attempt.max_step_at or 0.0) - (attempt.first_step_at or 0.0)
    if made <= 0:
        return productive  # one step seen: everything since it is past the checkpoint
    if span <= 0:  # two nodes' clocks disagree: the productive time is the span
        span = productive
    return min(productive, lost * span / made)


def _result(
    job_id: str,
    job: JobFacts,
    attempts: Sequence[AttemptFacts],
    ledger: _Ledger,
    end: float,
    failures: list[FailureMark],
    checkpoints: list[StepPoint],
    lost_steps: int | None,
    lost_known: bool,
    steps_reported: bool,
) -> Goodput:
    wall = end - job.submitted_at  # >= 0: walk_end
    steps = [a.max_step for a in attempts if a.max_step is not None]
    series = sorted((p for a in attempts for p in a.samples), key=lambda p: p.t)
    return Goodput(
        job_id=job_id,
        as_of=end,
        finished=job.finished_at is not None,
        wall_s=wall,
        productive_s=ledger.productive,
        goodput=min(1.0, max(0.0, ledger.productive / wall)) if wall > 0 else 0.0,
        badput_s=ledger.bad,
        steps=GoodputSteps(
            max_step=max(steps) if steps else None,
            checkpoint_step=checkpoints[-1].step if checkpoints else None,
            lost_steps=lost_steps,
            failures=len(failures),
        ),
        progress_reported=any(a.first_progress_at is not None for a in attempts),
        steps_reported=steps_reported,
        lost_work_known=lost_known,
        attempts=len(attempts),
        series=series,
        checkpoints=checkpoints,
        failures=failures,
    )
