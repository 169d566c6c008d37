"""Prometheus metrics, derived from events and job documents so that they never disagree.

A :class:`Metrics` sink has two inputs, both pushed to it by the daemon:

* every event this node emits (``events.add_listener(metrics.on_event)``),
  for what happens here: worker exits, restarts, rendezvous rounds, phase
  durations, the state of this node's worker groups;
* every job document, each time the cluster's job watch sees a change
  (``metrics.on_jobs(jobs)``), for the job counts, restart budgets, rounds,
  and the seed's run metrics once a job this node ran has ended.

The per-job series (group state, restarts, remaining restarts, round,
flakiness) are built at scrape time for the active jobs and the
:data:`KEEP_FINISHED_JOBS` most recently finished ones, so a scrape after a
job ended still shows how it ended while a daemon that runs thousands of
jobs does not grow its ``/metrics`` page forever. The names are listed in
``docs/observability.md``.

The standby interpreters of ``prewarm`` jobs (their number and memory) are
read at scrape time from the agents, through :attr:`Metrics.standbys`,
which the daemon sets.

The per-node series (quarantined or not, the failures attributed to each
node by kind) come from the nodes' health records
(:mod:`elasticd.node.quarantine`), read at scrape time and decided by the
pure :func:`node_series`: node names come from the store, which anyone with
its credential can write, so at most :data:`MAX_NODE_SERIES` nodes get
series (quarantined ones first, then live ones) and the page says how many
it left out.

Two tables say which events feed what, so a new event kind from the agent
needs one line here, not a new code path:

* :data:`PHASE_BY_KIND`: events carrying ``duration_s`` whose duration is a
  recovery phase;
* :data:`EXIT_REASON_BY_KIND`: events that count as a worker exit of a given
  reason besides ``worker.exited`` (hangs, failed health checks).

Store clients report their requests with :func:`observe_store_request`;
those series are process-wide (one daemon is one process in production) and
every daemon's ``/metrics`` includes them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from elasticd import __version__
from elasticd.eventkinds import EventKind, known_kind
from elasticd.goodput import Goodput
from elasticd.models import Event, Job, incarnation, valid_node_name
from elasticd.node.looplag import LAG_BUCKETS, LoopLag
from elasticd.node.quarantine import EntryKind, NodeHealth, by_kind, in_force
from elasticd.sched.plan import FleetPlan
from elasticd.states import JobState, WorkerState

__all__ = [
    "CONTENT_TYPE",
    "EXIT_REASONS",
    "EXIT_REASON_BY_KIND",
    "KEEP_FINISHED_JOBS",
    "MAX_NODE_SERIES",
    "PHASE_BY_KIND",
    "RUN_OUTCOMES",
    "Metrics",
    "NodeSeries",
    "exit_reason",
    "flakiness",
    "node_series",
    "observe_store_request",
    "recovery_phase",
    "run_outcome",
]

log = logging.getLogger("elasticd.node.metrics")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# A ``_created`` series per counter and histogram doubles the page for a timestamp that
# Prometheus derives itself (a reset shows as a drop); the switch is the library's, and global.
disable_created_metrics()  # type: ignore[no-untyped-call]

#: Finished jobs whose per-job series stay on the page.
KEEP_FINISHED_JOBS = 100

#: The most nodes with per-node series: a bound on the page whatever the store holds
#: (thousands of real nodes fit; a flood of keys written by hand does not grow it).
MAX_NODE_SERIES = 4096

#: Event kinds (with ``duration_s``) that time one phase of a recovery, and the
#: phase label they feed (detected → stop_workers → rendezvous → spawn, total, and
#: the new workers' first progress).
PHASE_BY_KIND: dict[EventKind, str] = {
    EventKind.RECOVERY_DETECTED: "detected",
    EventKind.RECOVERY_STOP_WORKERS: "stop_workers",
    EventKind.RECOVERY_RENDEZVOUS: "rendezvous",
    EventKind.RECOVERY_SPAWN: "spawn",
    EventKind.RECOVERY_TOTAL: "total",
    EventKind.RECOVERY_FIRST_PROGRESS: "first_progress",
}

#: Event kinds that count as a worker exit of this reason (the agent's hang and
#: health-check detection); ``worker.exited`` is classified by :func:`exit_reason`.
EXIT_REASON_BY_KIND: dict[EventKind, str] = {
    EventKind.WORKER_HANG: "hang",
    EventKind.WORKER_HEALTH_CHECK_FAILED: "health_check",
}

#: Every label value of ``elasticd_worker_exits_total{reason}``, shown from zero.
EXIT_REASONS = ("success", "exit_code", "signal", "hang", "health_check", "stopped")

#: Every label value of ``elasticd_run_total{outcome}``: torch's four run counters
#: (``run_success_with_retries`` ...) as one counter; their sum is torch's ``run_total``.
RUN_OUTCOMES = (
    "success_no_retries",
    "success_with_retries",
    "failed_no_retries",
    "failed_with_retries",
)

_DURATION_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600,
)  # fmt: skip
_STORE_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30,
)  # fmt: skip

# Process-wide store client series (see the module docstring).
_STORE_REGISTRY = CollectorRegistry(auto_describe=True)
_STORE_LATENCY = Histogram(
    "elasticd_store_request_duration_seconds",
    "Latency of requests to the cluster store, by operation.",
    ["op"],
    buckets=_STORE_BUCKETS,
    registry=_STORE_REGISTRY,
)
_STORE_ERRORS = Counter(
    "elasticd_store_request_errors",
    "Requests to the cluster store that failed (unreachable, server error, timeout).",
    ["op"],
    registry=_STORE_REGISTRY,
)


def observe_store_request(op: str, seconds: float, error: bool = False) -> None:
    """Record one store request: ``op`` is the operation ("get", "cas", "watch", ...).

    Cheap and never raises; store clients call it around every request.
    Long-polls (watch) are best given their own ``op`` so that they do not
    swamp the latency of the short requests.
    """
    try:
        _STORE_LATENCY.labels(op).observe(max(0.0, seconds))
        if error:
            _STORE_ERRORS.labels(op).inc()
    except Exception:  # pragma: no cover - a metric must never break a store call
        log.exception("cannot record store request metric")


def flakiness(*, failed: bool, restart_count: int, max_restarts: int) -> float:
    """torch's run flakiness as a 0-1 ratio: 1 for a failed run, else the share of the
    restart budget (plus one, for the first attempt) that the run needed.

    ``SimpleElasticAgent._record_flakiness_metric`` gives the same in percent:
    ``100 - 100 * (remaining_restarts + 1) / (max_restarts + 1)``; Prometheus' convention
    is a ratio.
    """
    if failed:
        return 1.0
    remaining = max(0, max_restarts - restart_count)
    return 1.0 - (remaining + 1) / (max_restarts + 1)


def run_outcome(*, failed: bool, restart_count: int) -> str:
    """The ``outcome`` label of ``elasticd_run_total`` for a run that ended (pure)."""
    return f"{'failed' if failed else 'success'}_{'with' if restart_count else 'no'}_retries"


def exit_reason(event: Event) -> str | None:
    """The ``reason`` label of a worker exit event, or None if the event is not one."""
    kind = known_kind(event.kind)
    if kind in EXIT_REASON_BY_KIND:
        return EXIT_REASON_BY_KIND[kind]
    if kind is not EventKind.WORKER_EXITED:
        return None
    if event.state == WorkerState.STOPPED.value:
        return "stopped"  # the agent stopped it; not a failure of its own
    if event.signal is not None:
        return "signal"
    if event.exit_code:
        return "exit_code"
    return "success"


def recovery_phase(kind: str) -> str | None:
    """The ``phase`` label an event kind's ``duration_s`` feeds, or None."""
    known = known_kind(kind)
    return PHASE_BY_KIND.get(known) if known is not None else None


@dataclass(frozen=True)
class NodeSeries:
    """What the per-node series show of one node."""

    node: str
    quarantined: bool
    """Out of the fleet now: quarantined by its policy or drained by an admin."""
    attributed: Mapping[EntryKind, int]
    """The failures attributed to it that count now, by kind (every kind, zeros too)."""


def node_series(
    records: Mapping[str, NodeHealth],
    live: Iterable[str],
    window: float,
    now: float,
    limit: int = MAX_NODE_SERIES,
) -> tuple[list[NodeSeries], int]:
    """The nodes that get per-node series, by name, and how many were left out (pure).

    Every live node and every node with a health record (a quarantine outlives its
    node's lease), names that are not node names dropped; past ``limit``, the
    quarantined nodes are kept first, then the live ones, then by name."""
    up = {n for n in live if valid_node_name(n)}
    rows = []
    for name in up | {n for n in records if valid_node_name(n)}:
        health = records.get(name) or NodeHealth(node=name)
        quarantined = in_force(health.quarantine, now)
        rows.append(NodeSeries(name, quarantined, by_kind(health, window, now)))
    rows.sort(key=lambda r: (not r.quarantined, r.node not in up, r.node))
    kept = rows[: max(0, limit)]
    return sorted(kept, key=lambda r: r.node), len(rows) - len(kept)


class _StoreSeries(Collector):
    """Shows the process-wide store series on every daemon's registry."""

    def collect(self) -> Iterator[Metric]:
        yield from _STORE_REGISTRY.collect()


class _JobSeries(Collector):
    """The per-job and per-state series, built from the latest job documents at scrape time."""

    def __init__(self, metrics: Metrics) -> None:
        self._m = metrics

    def collect(self) -> Iterator[Metric]:
        m = self._m
        counts = GaugeMetricFamily(
            "elasticd_jobs", "Jobs in the cluster, by state.", labels=["state"]
        )
        by_state = dict.fromkeys((s.value for s in JobState), 0)
        for job in m.jobs.values():
            by_state[job.state.value] += 1
        for state, count in by_state.items():
            counts.add_metric([state], count)
        yield counts

        shown = m.shown_jobs()
        restarts = GaugeMetricFamily(
            "elasticd_job_restarts", "Restarts a job has spent.", labels=["job_id"]
        )
        remaining = GaugeMetricFamily(
            "elasticd_job_remaining_restarts",
            "Restarts a job has left (max_restarts - restarts).",
            labels=["job_id"],
        )
        rounds = GaugeMetricFamily(
            "elasticd_job_rendezvous_round", "The rendezvous round a job is in.", labels=["job_id"]
        )
        for job in shown:
            restarts.add_metric([job.id], job.restart_count)
            remaining.add_metric([job.id], max(0, job.max_restarts - job.restart_count))
            rounds.add_metric([job.id], job.round)
        yield from (restarts, remaining, rounds)

        ids = {job.id for job in shown}
        groups = GaugeMetricFamily(
            "elasticd_worker_group_state",
            "This node's worker group of a job: 1 for its current state, 0 for the others.",
            labels=["job_id", "node", "state"],
        )
        for (job_id, node), current in sorted(m.group_states.items()):
            if job_id in ids:
                for state in WorkerState:
                    groups.add_metric([job_id, node, state.value], int(state.value == current))
        yield groups

        flaky = GaugeMetricFamily(
            "elasticd_flakiness_ratio",
            "Per finished job this node ran, torch's flakiness as a 0-1 ratio: 1 when it "
            "failed, else 1 - (remaining_restarts + 1) / (max_restarts + 1).",
            labels=["job_id", "role"],
        )
        for job_id, (role, value) in sorted(m.flakiness.items()):
            if job_id in ids:
                flaky.add_metric([job_id, role], value)
        yield flaky

        ratio = GaugeMetricFamily(
            "elasticd_job_goodput_ratio",
            "Share of a job's wall time that became kept progress (docs/goodput.md), as of "
            "the scrape, for the jobs this node runs or ran.",
            labels=["job_id"],
        )
        badput = CounterMetricFamily(
            "elasticd_job_badput_seconds",
            "Seconds of a job's wall time that were not kept progress, by kind (startup, "
            "queue, recovery, lost_work, hang, preempted, other; docs/goodput.md).",
            labels=["job_id", "kind"],
        )
        for job_id, g in sorted(m.goodput.items()):
            if job_id in ids:
                ratio.add_metric([job_id], g.goodput)
                for kind, seconds in g.badput_s.items():
                    badput.add_metric([job_id, kind], seconds)
        yield from (ratio, badput)

        queued = GaugeMetricFamily(
            "elasticd_queued_jobs",
            "Jobs waiting in the fleet's queue, by reason (capacity, unplaceable).",
            labels=["reason"],
        )
        waiting = dict.fromkeys(("capacity", "unplaceable"), 0)
        for entry in m.plan.queue:
            waiting[entry.reason] = waiting.get(entry.reason, 0) + 1
        for reason, count in waiting.items():
            queued.add_metric([reason], count)
        yield queued
        placed = GaugeMetricFamily(
            "elasticd_placed_slots",
            "Slots the fleet's plan gives to jobs on each node (hot spares included).",
            labels=["node"],
        )
        slots: dict[str, int] = {}
        for job_id, placement in m.plan.placements.items():
            placed_job = m.jobs.get(job_id)
            if placed_job is not None:
                for node in [*placement.nodes, *placement.spares]:
                    slots[node] = slots.get(node, 0) + placed_job.spec.nproc_per_node
        for node, count in sorted(slots.items()):
            placed.add_metric([node], count)
        yield placed

        yield from _standby_series(m)
        yield from _node_series(m)

        build = GaugeMetricFamily(
            "elasticd_build_info", "Always 1; the daemon's version.", labels=["version"]
        )
        build.add_metric([__version__], 1)
        yield build


def _standby_series(m: Metrics) -> Iterator[Metric]:
    """The standby interpreters of ``prewarm`` jobs on this node: how many, and their memory."""
    count = GaugeMetricFamily(
        "elasticd_standby_processes",
        "Standby interpreters this node keeps for a prewarm job's next attempt.",
        labels=["job_id"],
    )
    memory = GaugeMetricFamily(
        "elasticd_standby_resident_bytes",
        "Resident memory of a prewarm job's standby interpreters on this node (prewarm's cost).",
        labels=["job_id"],
    )
    for job_id, (n, rss) in sorted((m.standbys() if m.standbys else {}).items()):
        count.add_metric([job_id], n)
        memory.add_metric([job_id], rss)
    yield from (count, memory)


def _node_series(m: Metrics) -> Iterator[Metric]:
    """Each node's quarantine and the failures attributed to it (:func:`node_series`)."""
    quarantined = GaugeMetricFamily(
        "elasticd_node_quarantined",
        "1 while the node is out of the fleet (quarantined by its policy or drained by an "
        "admin), else 0.",
        labels=["node"],
    )
    failures = GaugeMetricFamily(
        "elasticd_node_attributed_failures",
        "Failures attributed to the node that count now (within quarantine_window), by "
        "kind: first_failure, hardware, health_check.",
        labels=["node", "kind"],
    )
    for row in m.nodes:
        quarantined.add_metric([row.node], int(row.quarantined))
        for kind, count in row.attributed.items():
            failures.add_metric([row.node, kind], count)
    omitted = GaugeMetricFamily(
        "elasticd_node_series_omitted",
        f"Nodes left without per-node series (past {MAX_NODE_SERIES}: the quarantined "
        "nodes are kept first, then the live ones).",
    )
    omitted.add_metric([], m.nodes_omitted)
    yield from (quarantined, failures, omitted)


def replaced(before: Mapping[str, Job], now: Mapping[str, Job], ran: Iterable[str]) -> list[str]:
    """The ids of ``ran`` whose job of ``before`` is gone from ``now``, or whose id names
    another job there (:func:`~elasticd.models.incarnation`; pure)."""
    out = []
    for job_id in ran:
        old, new = before.get(job_id), now.get(job_id)
        if old is None:
            continue  # not seen yet (events come before the first look): still the one
        if new is None or incarnation(new) != incarnation(old):
            out.append(job_id)
    return out


#: Seconds a rendered ``/metrics`` page answers further scrapes while no input changed
#: (issue 40: under a crash loop a scrape costs the loop milliseconds; Prometheus scrapes
#: every 15 s or so, a dashboard or a load test many times a second).
PAGE_MAX_AGE = 0.5


class Metrics:
    """One daemon's metrics: feed it with :meth:`on_event` and :meth:`on_jobs`, scrape
    :meth:`render`."""

    def __init__(self, *, keep_finished: int = KEEP_FINISHED_JOBS) -> None:
        self.keep_finished = keep_finished
        #: This node's standbys by job: (count, resident bytes); the daemon sets it.
        self.standbys: Callable[[], Mapping[str, tuple[int, int]]] | None = None
        #: The latest job documents, by id.
        self.jobs: dict[str, Job] = {}
        #: The fleet's latest plan (the scheduler's plan watch hands it over).
        self.plan = FleetPlan()
        #: (job, node) -> the current state of a worker group this node runs or ran.
        self.group_states: dict[tuple[str, str], str] = {}
        #: job -> (role, flakiness) of the finished jobs this node ran.
        self.flakiness: dict[str, tuple[str, float]] = {}
        #: job -> its goodput as last computed (:meth:`on_goodput`), for the jobs run here.
        self.goodput: dict[str, Goodput] = {}
        #: The per-node series as last computed (:meth:`on_nodes`), and how many left out.
        self.nodes: list[NodeSeries] = []
        self.nodes_omitted = 0
        self._ran_here: set[str] = set()  # jobs this node has had a worker group for
        self._recorded: set[str] = set()  # jobs whose run metrics are recorded
        self._failure_at: dict[str, float] = {}  # job -> first failed exit of its attempt
        self._recovering: set[str] = set()  # jobs between a failure and running again
        #: Bumped by every input (an event, the job documents, the plan): a page rendered
        #: at the same count shows them all (``Daemon.metrics_text`` keeps it a moment).
        self.changes = 0

        self.registry = r = CollectorRegistry(auto_describe=True)
        r.register(_JobSeries(self))
        r.register(_StoreSeries())
        self.restarts = Counter(
            "elasticd_restarts",
            "Worker group restarts on this node (group.restarting events).",
            registry=r,
        )
        self.worker_exits = Counter(
            "elasticd_worker_exits",
            "Worker exits on this node by reason: success, exit_code, signal, hang, "
            "health_check, stopped (by the agent).",
            ["reason"],
            registry=r,
        )
        for reason in EXIT_REASONS:
            self.worker_exits.labels(reason)
        self.preemptions = Counter(
            "elasticd_preemptions",
            "Jobs this node's scheduler preempted (job.preempted events it wrote).",
            registry=r,
        )
        self.rendezvous_rounds = Counter(
            "elasticd_rendezvous_rounds", "Rendezvous rounds this node completed.", registry=r
        )
        self.rendezvous_duration = Histogram(
            "elasticd_rendezvous_duration_seconds",
            "Time from asking for a rendezvous round to having one.",
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self.phase_duration = Histogram(
            "elasticd_recovery_phase_duration_seconds",
            "Duration of each phase of a recovery (stop_workers, rendezvous, ...; "
            "total: from the first failure, or the membership change, to workers running again).",
            ["phase"],
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self.runs = Counter(
            "elasticd_run",
            "Runs of jobs that ended (succeeded or failed) with a group on this node, by "
            "outcome: success or failed, with or without a restart (torch's run_* counters).",
            ["role", "outcome"],
            registry=r,
        )

        #: Fed by uvicorn's tick (:mod:`elasticd.node.looplag`).
        self.loop_lag = LoopLag(
            Histogram(
                "elasticd_event_loop_lag_seconds",
                "How much later than due the daemon's event loop ran a periodic tick: a "
                "loop blocked by anything delays every job's supervision and every API answer.",
                buckets=LAG_BUCKETS,
                registry=r,
            )
        )

    def render(self) -> bytes:
        """The Prometheus text exposition of every series."""
        return generate_latest(self.registry)

    def shown_jobs(self) -> list[Job]:
        """The jobs with per-job series: every active one and the latest finished ones."""
        active = [j for j in self.jobs.values() if not j.state.is_terminal]
        finished = sorted(
            (j for j in self.jobs.values() if j.state.is_terminal),
            key=lambda j: (j.finished_at or j.created_at, j.id),
        )
        return active + finished[len(finished) - self.keep_finished :] if finished else active

    # inputs

    def on_goodput(self, figures: Iterable[Goodput]) -> None:
        """Take jobs' goodput, computed before a scrape (``Daemon.metrics_text``)."""
        for g in figures:
            self.goodput[g.job_id] = g

    def on_nodes(self, rows: list[NodeSeries], omitted: int) -> None:
        """Take the per-node series, computed before a scrape (``Daemon.metrics_text``)."""
        self.nodes, self.nodes_omitted = rows, omitted

    def goodput_to_refresh(self, running_here: Iterable[str]) -> list[str]:
        """The jobs whose goodput a scrape computes: those this node runs, and those it ran
        whose final figures it has not taken yet (once more, after they ended)."""
        final = {job_id for job_id, g in self.goodput.items() if g.finished}
        return sorted({*running_here, *(self._ran_here - final)})

    def on_plan(self, plan: FleetPlan) -> None:
        """Take the fleet's current plan (queue and placements)."""
        self.changes += 1
        self.plan = plan

    def on_jobs(self, jobs: Iterable[Job]) -> None:
        """Take the cluster's current job documents (all of them). What is kept of a job
        this node ran is dropped when its id is gone or names another job (deleted, and
        maybe taken again between two looks): the new job's run is its own."""
        self.changes += 1
        before, self.jobs = self.jobs, {job.id: job for job in jobs}
        for job_id in replaced(before, self.jobs, self._ran_here):
            self._forget(job_id)
        for job in self.jobs.values():
            if job.id in self._ran_here and job.id not in self._recorded:
                if job.state in (JobState.SUCCEEDED, JobState.FAILED):
                    self._record_run(job)  # a cancelled run is no result (torch records none)
                elif job.state is JobState.CANCELLED:
                    self._recorded.add(job.id)
        self._forget_old()

    def on_event(self, event: Event) -> None:
        """Update the series an event of this node feeds (called after each emit)."""
        self.changes += 1
        kind, job_id = event.kind, event.job_id
        reason = exit_reason(event)
        if reason is not None:
            self.worker_exits.labels(reason).inc()
            if reason in ("exit_code", "signal", "hang", "health_check"):
                self._failure_at.setdefault(job_id, event.time)
        if event.duration_s is not None:
            if kind == EventKind.RENDEZVOUS_COMPLETE:
                self.rendezvous_duration.observe(event.duration_s)
            phase = recovery_phase(kind)
            if phase is not None:
                self.phase_duration.labels(phase).observe(event.duration_s)
        if kind == EventKind.RENDEZVOUS_COMPLETE:
            self.rendezvous_rounds.inc()
        if kind == EventKind.JOB_PREEMPTED:
            self.preemptions.inc()
        elif kind == EventKind.GROUP_RESTARTING:
            self.restarts.inc()
            self._recovering.add(job_id)
        elif kind == EventKind.RENDEZVOUS_CHANGE:
            self._recovering.add(job_id)
            self._failure_at.setdefault(job_id, event.time)
        elif kind == EventKind.WORKERS_STARTED:
            self._failure_at.pop(job_id, None)
            self._recovering.discard(job_id)
        elif kind == EventKind.GROUP_STATE and event.state is not None:
            self._ran_here.add(job_id)
            self.group_states[(job_id, event.node)] = event.state

    # the seed's run metrics

    def _record_run(self, job: Job) -> None:
        """``SimpleElasticAgent._record_metrics``, once per finished job this node ran."""
        self._recorded.add(job.id)
        role = job.spec.role
        failed = job.state is JobState.FAILED
        for outcome in RUN_OUTCOMES:  # every series exists from the first run, as torch's
            self.runs.labels(role, outcome)
        self.runs.labels(role, run_outcome(failed=failed, restart_count=job.restart_count)).inc()
        self.flakiness[job.id] = (
            role,
            flakiness(
                failed=failed, restart_count=job.restart_count, max_restarts=job.max_restarts
            ),
        )

    def _forget_old(self) -> None:
        """Drop what is kept about jobs that no longer get per-job series."""
        if len(self._ran_here) <= 2 * self.keep_finished:
            return
        keep = {job.id for job in self.shown_jobs()}
        for job_id in list(self._ran_here):
            if job_id not in keep:
                self._forget(job_id)
        for key in [k for k in self.group_states if k[0] not in keep]:
            del self.group_states[key]

    def _forget(self, job_id: str) -> None:
        """Drop what is kept about the job of ``job_id`` this node ran."""
        self._ran_here.discard(job_id)
        self._recorded.discard(job_id)
        self.flakiness.pop(job_id, None)
        self.goodput.pop(job_id, None)
        self._failure_at.pop(job_id, None)
        self._recovering.discard(job_id)
        for key in [k for k in self.group_states if k[0] == job_id]:
            del self.group_states[key]
