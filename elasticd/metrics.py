"""Prometheus metrics, derived from the event log so that they never disagree with it.

A :class:`Metrics` sink is subscribed to the daemon's :class:`~elasticd.events.EventLog`
(``events.add_listener(metrics.on_event)``) and turns each event into counter,
gauge and histogram updates; the only other input is the job table, read at
scrape time for the job counts and on a job's state change for its restart
budget. The names are listed in ``docs/observability.md``.

Per-job series (worker group state, remaining restarts, ...) are kept while
the job is active and for the last :data:`KEEP_FINISHED_JOBS` finished jobs,
so that a scrape after a job ended still shows how it ended, while a daemon
that runs thousands of jobs does not grow its ``/metrics`` page forever.

Two tables say which events feed what, so new event kinds from the agent need
one line here, not a new code path:

* :data:`PHASE_BY_KIND`: events carrying ``duration_s`` whose duration is a
  recovery phase (``recovery.<phase>`` kinds are taken as they come);
* :data:`EXIT_REASON_BY_KIND`: events that count as a worker exit of a given
  reason besides ``worker.exited`` (hangs, failed health checks).

Store clients report their requests with :func:`observe_store_request`; those
series are process-wide (one daemon is one process in production) and every
daemon's ``/metrics`` includes them.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
from collections import OrderedDict
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from elasticd.models import Event, Job
from elasticd.states import JobState, WorkerState

if TYPE_CHECKING:
    from elasticd.db import Database

__all__ = [
    "CONTENT_TYPE",
    "EXIT_REASONS",
    "EXIT_REASON_BY_KIND",
    "KEEP_FINISHED_JOBS",
    "PHASE_BY_KIND",
    "Metrics",
    "exit_reason",
    "flakiness",
    "observe_store_request",
    "recovery_phase",
]

log = logging.getLogger("elasticd.metrics")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: Finished jobs whose per-job series stay on the page.
KEEP_FINISHED_JOBS = 100

#: Event kinds (with ``duration_s``) that time one phase of a recovery, and the
#: phase label they feed. ``recovery.<phase>`` kinds need no entry.
PHASE_BY_KIND: dict[str, str] = {
    "workers.stopped": "stop_workers",
    "rendezvous.complete": "rendezvous",
}

#: Event kinds that count as a worker exit of this reason (the agent's hang and
#: health-check detection); ``worker.exited`` is classified by :func:`exit_reason`.
EXIT_REASON_BY_KIND: dict[str, str] = {
    "worker.hang": "hang",
    "worker.hung": "hang",
    "worker.unhealthy": "health_check",
    "worker.health_check_failed": "health_check",
}

#: Every label value of ``elasticd_worker_exits_total{reason}``, shown from zero.
EXIT_REASONS = ("success", "exit_code", "signal", "hang", "health_check", "stopped")

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
    """torch's run flakiness, in percent: 100 for a failed run, else the share of the
    restart budget (plus one, for the first attempt) that the run needed.

    ``SimpleElasticAgent._record_flakiness_metric``:
    ``100 - 100 * (remaining_restarts + 1) / (max_restarts + 1)``.
    """
    if failed:
        return 100.0
    remaining = max(0, max_restarts - restart_count)
    return 100.0 - 100.0 * (remaining + 1) / (max_restarts + 1)


def exit_reason(event: Event) -> str | None:
    """The ``reason`` label of a worker exit event, or None if the event is not one."""
    if event.kind in EXIT_REASON_BY_KIND:
        return EXIT_REASON_BY_KIND[event.kind]
    if event.kind != "worker.exited":
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
    if kind in PHASE_BY_KIND:
        return PHASE_BY_KIND[kind]
    if kind.startswith("recovery.") and len(kind) > len("recovery."):
        return kind.removeprefix("recovery.")
    return None


class _JobCounts(Collector):
    """``elasticd_jobs{state}``, counted in the job table at scrape time."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "elasticd_jobs", "Jobs this daemon knows, by state.", labels=["state"]
        )
        counts = dict.fromkeys((s.value for s in JobState), 0)
        with contextlib.suppress(RuntimeError, sqlite3.Error):  # closed at shutdown
            for state, count in self._db.conn.execute(
                "SELECT state, count(*) FROM jobs GROUP BY state"
            ):
                counts[str(state)] = int(count)
        for state, count in counts.items():
            family.add_metric([state], count)
        yield family


class _StoreSeries(Collector):
    """Shows the process-wide store series on every daemon's registry."""

    def collect(self) -> Iterator[Metric]:
        yield from _STORE_REGISTRY.collect()


class Metrics:
    """One daemon's metrics: feed it events with :meth:`on_event`, scrape :meth:`render`."""

    def __init__(self, db: Database, *, keep_finished: int = KEEP_FINISHED_JOBS) -> None:
        self._db = db
        self._keep_finished = keep_finished
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        r.register(_JobCounts(db))
        r.register(_StoreSeries())
        self.group_state = Gauge(
            "elasticd_worker_group_state",
            "The worker group of a job on a node: 1 for its current state, 0 for the others.",
            ["job_id", "node", "state"],
            registry=r,
        )
        self.restarts = Counter(
            "elasticd_restarts", "Worker group restarts (spent restart budget).", registry=r
        )
        self.job_restarts = Gauge(
            "elasticd_job_restarts", "Restarts a job has spent.", ["job_id"], registry=r
        )
        self.remaining_restarts = Gauge(
            "elasticd_job_remaining_restarts",
            "Restarts a job has left (max_restarts - restarts).",
            ["job_id"],
            registry=r,
        )
        self.worker_exits = Counter(
            "elasticd_worker_exits",
            "Worker exits by reason: success, exit_code, signal, hang, health_check, "
            "stopped (by the agent).",
            ["reason"],
            registry=r,
        )
        for reason in EXIT_REASONS:
            self.worker_exits.labels(reason)
        self.rendezvous_rounds = Counter(
            "elasticd_rendezvous_rounds", "Completed rendezvous rounds.", registry=r
        )
        self.job_round = Gauge(
            "elasticd_job_rendezvous_round",
            "The rendezvous round a job is in.",
            ["job_id"],
            registry=r,
        )
        self.rendezvous_duration = Histogram(
            "elasticd_rendezvous_duration_seconds",
            "Time from asking for a rendezvous round to having one.",
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self.phase_duration = Histogram(
            "elasticd_recovery_phase_duration_seconds",
            "Duration of each phase of stopping and restarting a worker group "
            "(stop_workers, rendezvous, ...; total: first failure seen to workers running).",
            ["phase"],
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self.runs: dict[str, Counter] = {}
        for name, text in (
            ("run_total", "Runs of jobs that ended (succeeded or failed) on this node."),
            ("run_success_with_retries", "Runs that succeeded after at least one restart."),
            ("run_success_no_retries", "Runs that succeeded without a restart."),
            ("run_failed_with_retries", "Runs that failed after at least one restart."),
            ("run_failed_no_retries", "Runs that failed without a restart."),
        ):
            self.runs[name] = Counter(f"elasticd_{name}", text, ["role"], registry=r)
        self.flakiness = Gauge(
            "elasticd_flakiness",
            "Per finished job, torch's flakiness: 100 when it failed, else "
            "100 - 100 * (remaining_restarts + 1) / (max_restarts + 1).",
            ["job_id", "role"],
            registry=r,
        )
        self._groups: dict[str, set[str]] = {}  # job -> nodes with a group_state series
        self._roles: dict[str, str] = {}  # job -> role of its flakiness series
        self._failure_at: dict[str, float] = {}  # job -> first failed exit of its attempt
        self._restarting: set[str] = set()  # jobs between a failure and running again
        self._finished: OrderedDict[str, None] = OrderedDict()

    def render(self) -> bytes:
        """The Prometheus text exposition of every series."""
        return generate_latest(self.registry)

    # the sink

    def on_event(self, event: Event) -> None:
        """Update the series an event feeds (called by the event log after each emit)."""
        kind, job_id = event.kind, event.job_id
        reason = exit_reason(event)
        if reason is not None:
            self.worker_exits.labels(reason).inc()
            if reason in ("exit_code", "signal", "hang", "health_check"):
                self._failure_at.setdefault(job_id, event.time)
        if event.duration_s is not None:
            if kind == "rendezvous.complete":
                self.rendezvous_duration.observe(event.duration_s)
            phase = recovery_phase(kind)
            # The first rendezvous of a job is not a recovery; a later one is.
            if phase is not None and (phase != "rendezvous" or job_id in self._restarting):
                self.phase_duration.labels(phase).observe(event.duration_s)
        if kind == "rendezvous.complete":
            self.rendezvous_rounds.inc()
        elif kind == "group.restarting":
            self.restarts.inc()
            self._restarting.add(job_id)
        elif kind == "workers.started":
            failed_at = self._failure_at.pop(job_id, None)
            if job_id in self._restarting and failed_at is not None:
                self.phase_duration.labels("total").observe(max(0.0, event.time - failed_at))
            self._restarting.discard(job_id)
        elif kind == "group.state" and event.state is not None:
            self._set_group_state(job_id, event.node, event.state)
        elif kind in ("job.state", "job.submitted"):
            self._job_changed(job_id)

    def _set_group_state(self, job_id: str, node: str, current: str) -> None:
        self._groups.setdefault(job_id, set()).add(node)
        for state in WorkerState:
            self.group_state.labels(job_id, node, state.value).set(
                1 if state.value == current else 0
            )

    def _job_changed(self, job_id: str) -> None:
        job = self._db.get_job(job_id)
        if job is None:  # pragma: no cover - events follow the job's row
            return
        self.job_restarts.labels(job_id).set(job.restart_count)
        self.remaining_restarts.labels(job_id).set(max(0, job.max_restarts - job.restart_count))
        self.job_round.labels(job_id).set(job.round)
        if job.state in (JobState.SUCCEEDED, JobState.FAILED):
            self._record_run(job)  # a cancelled run is not a result (torch records none either)
        if job.state.is_terminal:
            self._finish(job_id)

    def _record_run(self, job: Job) -> None:
        """The seed's ``SimpleElasticAgent._record_metrics``, once per finished run."""
        role = job.spec.role
        failed = job.state is JobState.FAILED
        retried = job.restart_count > 0
        self.runs["run_total"].labels(role).inc()
        outcome = "failed" if failed else "success"
        self.runs[f"run_{outcome}_{'with' if retried else 'no'}_retries"].labels(role).inc()
        for name in self.runs:  # all four appear from the first run on, as torch's zeros do
            self.runs[name].labels(role)
        self._roles[job.id] = role
        self.flakiness.labels(job.id, role).set(
            flakiness(failed=failed, restart_count=job.restart_count, max_restarts=job.max_restarts)
        )

    def _finish(self, job_id: str) -> None:
        self._failure_at.pop(job_id, None)
        self._restarting.discard(job_id)
        self._finished[job_id] = None
        self._finished.move_to_end(job_id)
        while len(self._finished) > self._keep_finished:
            old, _ = self._finished.popitem(last=False)
            self._forget(old)

    def _forget(self, job_id: str) -> None:
        """Drop a long-finished job's series."""
        for node in self._groups.pop(job_id, set()):
            for state in WorkerState:
                with contextlib.suppress(KeyError):
                    self.group_state.remove(job_id, node, state.value)
        for gauge in (self.job_restarts, self.remaining_restarts, self.job_round):
            with contextlib.suppress(KeyError):
                gauge.remove(job_id)
        role = self._roles.pop(job_id, None)
        if role is not None:
            with contextlib.suppress(KeyError):
                self.flakiness.remove(job_id, role)
