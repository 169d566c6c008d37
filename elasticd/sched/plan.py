"""Fleet placement, pure: which nodes run each job, which jobs wait, and in what order.

:func:`schedule` is a function of the stored :class:`FleetPlan`, the active jobs, the
live nodes and ``now``; it returns the next plan and what changed
(:class:`Notice`). The daemon's thin loop (:mod:`elasticd.node.scheduler`)
reads the three inputs from the store, calls it, and writes the plan back by
compare-and-set on one key (:data:`elasticd.keys.SCHED_PLAN`), so placements
of different jobs can never count the same slot twice; every daemon then
starts agents only for the jobs the plan places on it.

The rules, in the order they are applied:

* **Guaranteed, then lent.** A placed job keeps ``min_nodes`` of its live
  nodes (its *hard* share). Nodes above ``min_nodes`` (up to ``max_nodes``)
  and hot spares are *lent*: they are counted as free when a waiting job is
  placed, and given back (the job shrinks, the spare stops) only when that
  makes the waiting job fit. A spare therefore never holds capacity another
  job could use.
* **Order.** Waiting jobs are taken by ``priority`` (higher first), then
  FIFO (``created_at``, then id).
* **Gang admission.** A job is placed only when ``min_nodes`` matching nodes
  each have ``nproc_per_node`` free slots at once; it never holds part of
  the fleet while it waits, so two jobs cannot split it and wait on each
  other.
* **Spread.** Among the nodes that fit, the least loaded (fraction of slots
  in use), then the one with the fewest jobs, then the name.
* **Preemption.** A job that does not fit may stop running jobs of a
  *lower* priority (lowest priority first, then newest first; any of them
  that turns out not to be needed is spared); they go back to the queue
  (:attr:`FleetPlan.preempted` names who preempted them) and resume as a new
  attempt when capacity returns. The reservations a waiting job made are
  kept from pass to pass while they can still serve it.
* **Reservation and backfill.** A job that still does not fit reserves
  ``nproc_per_node`` slots on its ``min_nodes`` best nodes (those with the
  most free slots). Jobs behind it may start only on what those
  reservations leave (backfill): on other nodes, or on slots of a reserved
  node beyond what the reserving job will need there. elasticd has no
  run-time limits, so it cannot compute Slurm's "earliest start"; the
  reservation is what guarantees that backfilled jobs never take the slots
  the waiting job is waiting for.
* **Whole or not at all.** A placed job that lost nodes and cannot be
  topped up to ``min_nodes`` gives back what it holds and waits whole, so
  two short gangs can never hold each other's missing nodes. Shares a stored
  plan claims beyond a node's slots are not kept (the plan is read from the
  store and re-checked on every pass).
* **Unplaceable.** A job that no set of live nodes could ever hold (fewer
  than ``min_nodes`` matching nodes have ``nproc_per_node`` slots in all)
  is flagged ``unplaceable`` with the numbers, never left waiting silently.
* **Owners' rights.** A job whose owner may not preempt never stops
  another job: it waits. A job whose owner's placed jobs hold (or would,
  with it) more than the owner's ``slot_quota`` waits with the reason
  ``quota``; it neither preempts nor reserves, and lending stops at the
  quota too. A job without an owner (from before identities) may preempt
  and has no quota.
* **A bad job never stops the others.** The planner copies only bounded
  text into the plan (:func:`clip`); a job whose fields fail
  :func:`demand_problem`, or whose planning raises anything, is flagged
  ``unplaceable`` with the reason, and the pass is planned again without
  it, from the start, so nothing it half did stays.
* **Lending last.** Once every waiting job has had its turn, placed jobs
  grow toward ``max_nodes`` and then take one hot spare each, on capacity
  no reservation holds; a lent node it already had is kept first, so the
  plan is stable when nothing changes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

#: Hot spares a job takes, at most, once it runs on ``max_nodes`` nodes.
SPARES_PER_JOB = 1

QueueReason = Literal["capacity", "unplaceable", "quota"]

#: What names in a stored plan may look like (the API's job-id and node-name rules):
#: the plan is read from the store, which the daemon does not trust.
JOB_ID = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
NODE_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$"
_STRICT = ConfigDict(allow_inf_nan=False, extra="forbid")
_Node = Annotated[str, Field(pattern=NODE_NAME)]
#: The longest message a queue entry holds (longer ones are clipped, never refused).
MAX_MESSAGE = 2000
#: Bounds of a job's node selector as the planner accepts it (the API's, :mod:`elasticd.models`).
MAX_SELECTOR_ITEMS = 64
MAX_SELECTOR_KEY = 128
MAX_SELECTOR_VALUE = 256
#: Bounds of the numbers a demand may carry (the API's bounds on a job spec).
MAX_NPROC = 1024
MAX_NODES = 100_000
MAX_PRIORITY = 1000
NoticeKind = Literal["placed", "queued", "unplaceable", "preempted", "shrunk"]


class Placement(BaseModel):
    """Where one job runs: ``nodes`` (its hard share first) and its hot ``spares``."""

    model_config = _STRICT
    nodes: list[_Node] = Field(max_length=100_000)
    spares: list[_Node] = Field(default_factory=list, max_length=100_000)
    placed_at: float


class QueueEntry(BaseModel):
    """A job that waits, and why (``GET /queue``)."""

    model_config = _STRICT
    job: str = Field(pattern=JOB_ID)
    position: int = Field(description="1 is the next job to be placed.")
    priority: int
    reason: QueueReason = Field(
        description="capacity: not enough free slots now; unplaceable: the live nodes could "
        "never hold it (too few match the selector with enough slots), or the job cannot be "
        "planned at all (the message says why); quota: its owner's placed jobs hold its slot "
        "quota."
    )
    message: str = Field(max_length=2000)
    since: float = Field(description="When the job started waiting (this time).")
    preempted_by: str | None = Field(
        default=None,
        pattern=JOB_ID,
        description="The job whose placement stopped this one, if it was preempted.",
    )
    reserved: list[_Node] = Field(
        max_length=100_000,
        default_factory=list,
        description="Nodes whose slots are held for it against backfill.",
    )


class Preemption(BaseModel):
    """Why a job is back in the queue: the job that took its place."""

    model_config = _STRICT
    by: str = Field(pattern=JOB_ID)
    at: float


class FleetPlan(BaseModel):
    """The fleet's placement document (one key, written by compare-and-set)."""

    model_config = _STRICT
    placements: dict[str, Placement] = Field(default_factory=dict)
    queue: list[QueueEntry] = Field(default_factory=list)
    preempted: dict[str, Preemption] = Field(default_factory=dict)

    def nodes_of(self, job_id: str) -> list[str]:
        """Every node that runs or stands by for the job (empty when it waits)."""
        p = self.placements.get(job_id)
        return [*p.nodes, *p.spares] if p is not None else []

    def entry(self, job_id: str) -> QueueEntry | None:
        return next((e for e in self.queue if e.job == job_id), None)


@dataclass(frozen=True)
class NodeCapacity:
    """A live node as the scheduler sees it."""

    name: str
    slots: int
    labels: Mapping[str, str] = field(default_factory=dict)
    #: Jobs this node gave up (it left them for good, e.g. a failed health check).
    declined: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Demand:
    """What an active job asks of the fleet."""

    id: str
    nproc: int
    min_nodes: int = 1
    max_nodes: int = 1
    priority: int = 0
    created_at: float = 0.0
    selector: Mapping[str, str] = field(default_factory=dict)
    #: The identity that submitted it (None: a job from before identities).
    owner: str | None = None
    #: Whether it may stop lower-priority jobs to start.
    may_preempt: bool = True
    #: The most slots the owner's placed jobs may hold together (None: any).
    slot_quota: int | None = None
    #: The only nodes it may run on, by name (None: any); a Slurm allocation's nodes.
    nodes: frozenset[str] | None = None

    def matches(self, node: NodeCapacity) -> bool:
        return (
            self.id not in node.declined
            and (self.nodes is None or node.name in self.nodes)
            and all(node.labels.get(k) == v for k, v in self.selector.items())
        )


@dataclass(frozen=True)
class Notice:
    """A change worth an event of ``job``; ``by`` is the job that caused it, if another."""

    job: str
    kind: NoticeKind
    message: str
    by: str | None = None


@dataclass
class ScheduleResult:
    plan: FleetPlan
    notices: list[Notice]


def clip(text: str, limit: int = MAX_MESSAGE) -> str:
    """``text`` cut to ``limit`` characters (an ellipsis says so): plan text is bounded."""
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


_JOB_ID_RE = re.compile(JOB_ID)


def demand_problem(job: Demand) -> str | None:
    """Why ``job`` cannot be planned at all (its fields out of bounds), or None.

    The fields come from a job document in the store, which a store writer
    can fill: everything the planner computes with or copies is checked here.
    """
    if not isinstance(job.id, str) or not _JOB_ID_RE.match(job.id):
        return "its id is not a valid job id"
    for name, value, low, high in (
        ("nproc_per_node", job.nproc, 1, MAX_NPROC),
        ("min_nodes", job.min_nodes, 1, MAX_NODES),
        ("max_nodes", job.max_nodes, 1, MAX_NODES),
        ("priority", job.priority, -MAX_PRIORITY, MAX_PRIORITY),
    ):
        if type(value) is not int or not low <= value <= high:
            return f"{name} must be an integer from {low} to {high}"
    if job.min_nodes > job.max_nodes:
        return "min_nodes must not exceed max_nodes"
    if not isinstance(job.created_at, int | float) or not math.isfinite(job.created_at):
        return "created_at must be a finite number"
    if len(job.selector) > MAX_SELECTOR_ITEMS:
        return f"node_selector has more than {MAX_SELECTOR_ITEMS} labels"
    for key, label in job.selector.items():
        if not isinstance(key, str) or not 1 <= len(key) <= MAX_SELECTOR_KEY:
            return f"a node_selector key must be 1 to {MAX_SELECTOR_KEY} characters"
        if not isinstance(label, str) or len(label) > MAX_SELECTOR_VALUE:
            return (
                f"node_selector[{clip(key, 40)!r}] must be a string of at most "
                f"{MAX_SELECTOR_VALUE} characters"
            )
    if job.nodes is not None and (
        not isinstance(job.nodes, frozenset)
        or len(job.nodes) > MAX_NODES
        or not all(isinstance(n, str) for n in job.nodes)
    ):
        return f"nodes must be a set of at most {MAX_NODES} node names"
    if job.slot_quota is not None and (type(job.slot_quota) is not int or job.slot_quota < 0):
        return "its owner's slot_quota must be a non-negative integer"
    return None


class _JobFailed(Exception):
    """Planning ``job`` raised: the pass is planned again without it."""

    def __init__(self, job: str, reason: str) -> None:
        super().__init__(job, reason)
        self.job = job
        self.reason = reason


@contextmanager
def _blame(job: str) -> Iterator[None]:
    """Charge any exception raised here to ``job``."""
    try:
        yield
    except _JobFailed:
        raise
    except Exception as exc:
        raise _JobFailed(job, f"{type(exc).__name__}: {exc}") from exc


def order_key(job: Demand) -> tuple[int, float, str]:
    """Higher priority first, then first come, first served."""
    return (-job.priority, job.created_at, job.id)


@dataclass
class _Ledger:
    """Slots per node: the hard shares, the reservations, the lent ones (this pass)."""

    nodes: dict[str, NodeCapacity]
    hard: dict[str, int] = field(default_factory=dict)
    reserved: dict[str, int] = field(default_factory=dict)
    lent: dict[str, int] = field(default_factory=dict)
    jobs_on: dict[str, int] = field(default_factory=dict)

    def free(self, node: str, *, lent: bool = False, reserved: bool = True) -> int:
        used = self.hard.get(node, 0)
        if lent:
            used += self.lent.get(node, 0)
        if reserved:
            used += self.reserved.get(node, 0)
        return self.nodes[node].slots - used

    def take(self, book: dict[str, int], node: str, n: int) -> None:
        book[node] = book.get(node, 0) + n
        self.jobs_on[node] = self.jobs_on.get(node, 0) + 1

    def give(self, book: dict[str, int], node: str, n: int) -> None:
        book[node] = book.get(node, 0) - n
        self.jobs_on[node] = self.jobs_on.get(node, 0) - 1

    def preference(self, node: str, prev_lent: Mapping[str, int]) -> tuple[float, int, int, str]:
        """Least loaded first; a node whose lent slots would be taken back comes after."""
        slots = max(1, self.nodes[node].slots)
        load = self.hard.get(node, 0) + self.reserved.get(node, 0) + prev_lent.get(node, 0)
        return (load / slots, self.jobs_on.get(node, 0), 0, node)


def _selector_text(job: Demand) -> str:
    text = ""
    if job.nodes is not None:
        text += " among " + clip(",".join(sorted(job.nodes)), 200)
    if job.selector:
        labels = ",".join(f"{k}={v}" for k, v in sorted(job.selector.items()))
        text += " matching " + clip(labels, 200)
    return text


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def schedule(
    plan: FleetPlan, jobs: Iterable[Demand], nodes: Iterable[NodeCapacity], now: float
) -> ScheduleResult:
    """The next plan for these active jobs on these live nodes, and what changed.

    A job that cannot be planned (:func:`demand_problem`, or an exception
    while planning it) is flagged ``unplaceable`` with the reason and the
    pass is planned again from the start without it: at most one pass per
    such job, and never a half-applied one.
    """
    fleet = list(nodes)
    good: list[Demand] = []
    broken: dict[str, tuple[Demand, str]] = {}
    for job in jobs:
        try:
            problem = demand_problem(job)
        except Exception as exc:  # a field that breaks even the check
            problem = f"its fields cannot be read ({type(exc).__name__})"
        if problem is None:
            good.append(job)
        elif isinstance(job.id, str) and _JOB_ID_RE.match(job.id):
            broken[job.id] = (job, problem)
    while True:
        try:
            return _schedule(plan, [j for j in good if j.id not in broken], fleet, now, broken)
        except _JobFailed as exc:
            if exc.job in broken:  # even its flag cannot be written: it is left out
                del broken[exc.job]
                good = [j for j in good if j.id != exc.job]
                continue
            failed = next(j for j in good if j.id == exc.job)
            broken[exc.job] = (failed, f"planning it failed: {exc.reason}")
            good.remove(failed)


def _schedule(
    plan: FleetPlan,
    jobs: Sequence[Demand],
    nodes: Sequence[NodeCapacity],
    now: float,
    broken: Mapping[str, tuple[Demand, str]],
) -> ScheduleResult:
    live = {n.name: n for n in nodes}
    order = sorted(jobs, key=order_key)
    by_id = {j.id: j for j in order}
    book = _Ledger(live)

    # 1. What each placed job keeps: its live, matching nodes whose slots are still there
    #    (in order, so a stored plan can never make a node hold more than it has); the
    #    first min_nodes are hard, the rest were lent.
    hard: dict[str, list[str]] = {}
    prev_lent_nodes: dict[str, list[str]] = {}  # job -> its lent nodes (above min), in order
    prev_spares: dict[str, list[str]] = {}
    prev_lent_slots: dict[str, int] = {}  # node -> slots lent before this pass
    for job in order:
        with _blame(job.id):
            old = plan.placements.get(job.id)
            if old is None:
                continue
            pool = _dedupe(
                n for n in [*old.nodes, *old.spares] if n in live and job.matches(live[n])
            )
            mine: list[str] = []
            for n in pool:
                if len(mine) < job.min_nodes and book.free(n) >= job.nproc:
                    mine.append(n)
                    book.take(book.hard, n, job.nproc)
            if not mine:
                continue
            hard[job.id] = mine
            rest = [n for n in pool if n not in mine]
            room = job.max_nodes - job.min_nodes
            prev_lent_nodes[job.id] = rest[:room] if len(mine) >= job.min_nodes else []
            prev_spares[job.id] = rest[room:] if len(mine) >= job.min_nodes else []
            for n in rest:
                prev_lent_slots[n] = prev_lent_slots.get(n, 0) + job.nproc

    # 2. Waiting jobs (and placed ones short of min_nodes), in order.
    queued: list[tuple[Demand, QueueReason, str, list[str]]] = []
    preempted: dict[str, Preemption] = {
        k: v for k, v in plan.preempted.items() if k in by_id and k not in hard
    }
    victims_of: dict[str, str] = {}  # victim -> the job that preempted it in this pass
    notices: list[Notice] = []
    for job in order:
        with _blame(job.id):
            if job.id in hard:
                short = job.min_nodes - len(hard[job.id])
                if short <= 0:
                    continue
                fit = _best(book, job, live, exclude=hard[job.id], prev_lent=prev_lent_slots)
                if len(fit) >= short:
                    for n in fit[:short]:
                        hard[job.id].append(n)
                        book.take(book.hard, n, job.nproc)
                    continue
                # A gang short of min_nodes never holds part of the fleet: it waits whole.
                for n in hard.pop(job.id):
                    book.give(book.hard, n, job.nproc)
                prev_lent_nodes.pop(job.id, None)
                prev_spares.pop(job.id, None)
            able = [n for n in live.values() if job.matches(n) and n.slots >= job.nproc]
            if len(able) < job.min_nodes:
                matching = sum(1 for n in live.values() if job.matches(n))
                message = (
                    f"needs {_plural(job.min_nodes, 'node')} with {_plural(job.nproc, 'slot')}"
                    f"{_selector_text(job)}; the cluster has {len(able)} such "
                    f"{'node' if len(able) == 1 else 'nodes'} ({_plural(matching, 'live node')} "
                    "match the selector): it cannot start until more such nodes join "
                    "(add nodes or slots, or lower nproc_per_node or min_nodes)"
                )
                queued.append((job, "unplaceable", message, []))
                continue
            over = _over_quota(job, hard, by_id, job.nproc * job.min_nodes)
            if over is not None:
                queued.append((job, "quota", over, []))
                continue
            fit = _best(book, job, live, exclude=[], prev_lent=prev_lent_slots)
            if len(fit) < job.min_nodes and job.may_preempt:
                victims = _victims(book, job, hard, by_id, live)
                if victims is not None:
                    for victim in victims:
                        for n in hard.pop(victim):
                            book.give(book.hard, n, by_id[victim].nproc)
                        prev_lent_nodes.pop(victim, None)
                        prev_spares.pop(victim, None)
                        preempted[victim] = Preemption(by=job.id, at=now)
                        victims_of[victim] = job.id
                    fit = _best(book, job, live, exclude=[], prev_lent=prev_lent_slots)
            if len(fit) >= job.min_nodes:
                hard[job.id] = fit[: job.min_nodes]
                for n in hard[job.id]:
                    book.take(book.hard, n, job.nproc)
                preempted.pop(job.id, None)
                continue
            # Wait, and hold the best nodes against backfill by the jobs behind: the ones held
            # before first (a reservation that moved would let backfill delay the job).
            before = plan.entry(job.id)
            held = set(before.reserved) if before is not None else set()
            reserve = sorted(
                (n.name for n in able),
                key=lambda n: (n not in held, -book.free(n), book.jobs_on.get(n, 0), n),
            )[: job.min_nodes]
            for n in reserve:
                book.reserved[n] = book.reserved.get(n, 0) + job.nproc
            message = (
                f"needs {_plural(job.min_nodes, 'node')} with {_plural(job.nproc, 'free slot')}"
                f"{_selector_text(job)}; {len(fit)} matching "
                f"{'node has' if len(fit) == 1 else 'nodes have'} them now"
            )
            queued.append((job, "capacity", message, sorted(reserve)))

    # 3. Lending, last: first every lent node and spare a job already had (while it
    #    fits beside the hard shares), then new ones toward max_nodes and one spare each,
    #    on capacity no reservation holds.
    mine_of = {j: list(nodes_) for j, nodes_ in hard.items()}
    spares_of: dict[str, list[str]] = {j: [] for j in hard}
    for job in order:
        with _blame(job.id):
            if job.id not in hard:
                continue
            mine = mine_of[job.id]
            for n in prev_lent_nodes.get(job.id, []):
                if (
                    len(mine) < job.max_nodes
                    and book.free(n, lent=True, reserved=False) >= job.nproc
                ):
                    mine.append(n)
                    book.take(book.lent, n, job.nproc)
            for n in prev_spares.get(job.id, []):
                if (
                    len(spares_of[job.id]) < SPARES_PER_JOB
                    and n not in mine
                    and book.free(n, lent=True, reserved=False) >= job.nproc
                ):
                    spares_of[job.id].append(n)
                    book.take(book.lent, n, job.nproc)
    for job in order:
        with _blame(job.id):
            if job.id not in hard:
                continue
            mine, spares = mine_of[job.id], spares_of[job.id]
            for n in _lendable(book, job, live, mine + spares):
                if len(mine) >= job.max_nodes or _lend_over_quota(job, mine_of, spares_of, by_id):
                    break
                mine.append(n)
                book.take(book.lent, n, job.nproc)
            if len(mine) >= job.max_nodes:
                for n in _lendable(book, job, live, mine + spares):
                    if len(spares) >= SPARES_PER_JOB or _lend_over_quota(
                        job, mine_of, spares_of, by_id
                    ):
                        break
                    spares.append(n)
                    book.take(book.lent, n, job.nproc)
    placements: dict[str, Placement] = {}
    for job in order:
        with _blame(job.id):
            if job.id in hard:
                old = plan.placements.get(job.id)
                placements[job.id] = Placement(
                    nodes=mine_of[job.id],
                    spares=spares_of[job.id],
                    placed_at=old.placed_at
                    if old is not None and job.id not in victims_of
                    else now,
                )

    # A job that cannot be planned waits last, flagged, with the reason: never a crash.
    for job, problem in broken.values():
        message = f"it cannot be planned: {problem}; cancel it, or submit it again fixed"
        queued.append((job, "unplaceable", message, []))

    # 4. The queue, and what changed since the stored plan.
    queue: list[QueueEntry] = []
    for position, (job, reason, message, reserve) in enumerate(queued, start=1):
        with _blame(job.id):
            before = plan.entry(job.id)
            by = preempted[job.id].by if job.id in preempted else None
            if by is not None:
                message += f"; preempted by job {by}"
            entry = QueueEntry(
                job=job.id,
                position=position,
                priority=job.priority if job.id not in broken else _bounded_priority(job),
                reason=reason,
                message=clip(message),
                since=before.since if before is not None else now,
                preempted_by=by,
                reserved=reserve,
            )
            queue.append(entry)
            if before is None or before.reason != reason:
                kind: NoticeKind = "unplaceable" if reason == "unplaceable" else "queued"
                notices.append(Notice(job.id, kind, entry.message))
    for victim, by in victims_of.items():
        with _blame(by):
            now_placed = placements.get(victim)
            after = (
                f"it is placed again at once on {', '.join(now_placed.nodes)} and restarts there"
                if now_placed is not None
                else "it waits in the queue and resumes when capacity returns"
            )
            notices.append(
                Notice(
                    victim,
                    "preempted",
                    f"preempted by job {by} (priority {by_id[by].priority} over "
                    f"{by_id[victim].priority}): its workers get SIGTERM and their termination "
                    f"grace; {after}, as a new attempt; no restart is charged",
                    by=by,
                )
            )
    for job_id, now_placed in placements.items():
        with _blame(job_id):
            old = plan.placements.get(job_id)
            if old is None or job_id in victims_of:
                if old is None:
                    where = ", ".join(now_placed.nodes)
                    spare = (
                        f" (hot spare {', '.join(now_placed.spares)})" if now_placed.spares else ""
                    )
                    notices.append(Notice(job_id, "placed", f"placed on {where}{spare}"))
                continue
            for n in _dedupe([*old.nodes, *old.spares]):
                if n in now_placed.nodes or n in now_placed.spares or n not in live:
                    continue
                takers = [
                    j
                    for j, p in placements.items()
                    if j != job_id and n in p.nodes and n not in plan.nodes_of(j)
                ]
                by = takers[0] if takers else None
                role = "hot spare" if n in old.spares else "lent node"
                cause = f" for job {by}" if by else ""
                notices.append(
                    Notice(
                        job_id,
                        "shrunk",
                        f"its {role} {n} is given back{cause} (nodes above min_nodes and spares "
                        "are lent); the job goes on with the others",
                        by=by,
                    )
                )
    return ScheduleResult(
        FleetPlan(placements=placements, queue=queue, preempted=preempted), notices
    )


def _bounded_priority(job: Demand) -> int:
    """A broken job's priority as the plan may hold it (0 when it is not a sane integer)."""
    p = job.priority
    return p if type(p) is int and -MAX_PRIORITY <= p <= MAX_PRIORITY else 0


def _owner_slots(owner: str, held: Mapping[str, Sequence[str]], by_id: Mapping[str, Demand]) -> int:
    """Slots the owner's jobs hold in ``held`` (job -> its nodes)."""
    return sum(by_id[j].nproc * len(ns) for j, ns in held.items() if by_id[j].owner == owner)


def _over_quota(
    job: Demand, hard: Mapping[str, list[str]], by_id: Mapping[str, Demand], more: int
) -> str | None:
    """Why ``job`` may not take ``more`` slots under its owner's quota, or None when it may."""
    if job.owner is None or job.slot_quota is None:
        return None
    held = _owner_slots(job.owner, hard, by_id)
    if held + more <= job.slot_quota:
        return None
    owner = clip(job.owner, 128)
    if held >= job.slot_quota:
        return f"owner {owner} holds {held} of its {job.slot_quota} slots"
    return f"owner {owner} holds {held} of its {job.slot_quota} slots; this job needs {more} more"


def _lend_over_quota(
    job: Demand,
    mine_of: Mapping[str, list[str]],
    spares_of: Mapping[str, list[str]],
    by_id: Mapping[str, Demand],
) -> bool:
    """Whether one more lent share would take the owner past its quota."""
    if job.owner is None or job.slot_quota is None:
        return False
    held = _owner_slots(job.owner, mine_of, by_id) + _owner_slots(job.owner, spares_of, by_id)
    return held + job.nproc > job.slot_quota


def _dedupe(names: Iterable[str]) -> list[str]:
    seen: dict[str, None] = {}
    for n in names:
        seen.setdefault(n, None)
    return list(seen)


def _best(
    book: _Ledger,
    job: Demand,
    live: Mapping[str, NodeCapacity],
    *,
    exclude: Sequence[str],
    prev_lent: Mapping[str, int],
) -> list[str]:
    """Matching nodes with room for one more share of ``job``, best first."""
    fit = [
        n.name
        for n in live.values()
        if n.name not in exclude and job.matches(n) and book.free(n.name) >= job.nproc
    ]
    # Prefer nodes where the share fits without taking back what is lent.
    return sorted(
        fit,
        key=lambda n: (
            book.free(n) - prev_lent.get(n, 0) < job.nproc,
            *book.preference(n, prev_lent),
        ),
    )


def _lendable(
    book: _Ledger, job: Demand, live: Mapping[str, NodeCapacity], mine: Sequence[str]
) -> list[str]:
    """Nodes that could lend ``job`` a share without touching a hard share or a reservation."""
    fit = [
        n.name
        for n in live.values()
        if n.name not in mine and job.matches(n) and book.free(n.name, lent=True) >= job.nproc
    ]
    return sorted(fit, key=lambda n: book.preference(n, book.lent))


def _victims(
    book: _Ledger,
    job: Demand,
    hard: Mapping[str, list[str]],
    by_id: Mapping[str, Demand],
    live: Mapping[str, NodeCapacity],
) -> list[str] | None:
    """The fewest lower-priority jobs whose stop lets ``job`` fit; None when none would."""
    candidates = sorted(
        (j for j in hard if by_id[j].priority < job.priority),
        key=lambda j: (by_id[j].priority, -by_id[j].created_at, j),
    )
    if not candidates:
        return None
    freed: dict[str, int] = {}

    def fits() -> bool:
        able = [
            n
            for n in live.values()
            if job.matches(n) and book.free(n.name) + freed.get(n.name, 0) >= job.nproc
        ]
        return len(able) >= job.min_nodes

    chosen: list[str] = []
    for victim in candidates:
        if fits():
            break
        chosen.append(victim)
        for n in hard[victim]:
            freed[n] = freed.get(n, 0) + by_id[victim].nproc
    if not fits():
        return None
    # Spare the ones that turned out not to be needed (the last taken first).
    for victim in reversed(list(chosen)):
        for n in hard[victim]:
            freed[n] -= by_id[victim].nproc
        if fits():
            chosen.remove(victim)
        else:
            for n in hard[victim]:
                freed[n] += by_id[victim].nproc
    return chosen
