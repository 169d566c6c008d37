"""Every kind of job event, one enum (issue 13 point 3).

``EventLog.emit`` takes an :class:`EventKind`, so a misspelled or renamed kind
is a type error, and the readers (metrics, the CLI, the event streams)
match members, never prefixes. An :class:`~elasticd.models.Event` read back
(from the store, written by any node) keeps ``kind`` a string: a kind this
version does not know is shown as it is, not refused.

Which side of the boundary: shared (pure names).
"""

from __future__ import annotations

import enum

__all__ = ["MEANING", "EventKind", "known_kind", "recovery_phase_kind", "reference"]


class EventKind(enum.StrEnum):
    """The ``kind`` of an event: ``<subject>.<what happened>`` (meanings: :data:`MEANING`)."""

    JOB_SUBMITTED = "job.submitted"
    JOB_STATE = "job.state"
    JOB_RESUMED = "job.resumed"
    JOB_REFUSED = "job.refused"
    JOB_CANCEL_REQUESTED = "job.cancel_requested"
    JOB_CHECKPOINT_REQUESTED = "job.checkpoint_requested"
    JOB_UNSCHEDULABLE = "job.unschedulable"
    JOB_QUEUED = "job.queued"
    JOB_PLACED = "job.placed"
    JOB_PREEMPTED = "job.preempted"
    JOB_SHRUNK = "job.shrunk"
    SCHED_CRASHED = "sched.crashed"
    DAEMON_STOPPED = "daemon.stopped"
    DAEMON_REEXEC = "daemon.reexec"
    DAEMON_REEXEC_REFUSED = "daemon.reexec_refused"
    JOB_READOPTED = "job.readopted"
    AGENT_ERROR = "agent.error"
    AGENT_CRASHED = "agent.crashed"
    AGENT_FENCED = "agent.fenced"
    AGENT_GAVE_BACK = "agent.gave_back"
    AGENT_FINISHED = "agent.finished"
    STORE_LOST = "store.lost"
    STORE_BACK = "store.back"
    STORAGE_BACK = "storage.back"
    EVENTS_DROPPED = "events.dropped"
    EVENTS_TRIMMED = "events.trimmed"
    LOGS_LOST = "logs.lost"
    LOGS_TRUNCATED = "logs.truncated"
    RENDEZVOUS_COMPLETE = "rendezvous.complete"
    RENDEZVOUS_CHANGE = "rendezvous.change"
    RENDEZVOUS_FAILED = "rendezvous.failed"
    GROUP_STATE = "group.state"
    GROUP_RESTARTING = "group.restarting"
    WORKERS_STARTED = "workers.started"
    WORKERS_STOPPED = "workers.stopped"
    WORKERS_SPAWN_FAILED = "workers.spawn_failed"
    WORKERS_SPAWN_RETRY = "workers.spawn_retry"
    WORKERS_STRAYS = "workers.strays"
    WORKER_EXITED = "worker.exited"
    WORKER_HANG = "worker.hang"
    WORKER_STACKS = "worker.stacks"
    WORKER_HEARTBEAT_REPLACED = "worker.heartbeat_replaced"
    WORKER_HEALTH_CHECK_FAILED = "worker.health_check_failed"
    WORKER_ORPHAN_KILLED = "worker.orphan_killed"
    WORKERS_WARM_START = "workers.warm_start"
    WORKER_COLD_START = "worker.cold_start"
    STANDBY_LOST = "standby.lost"
    CONTAINMENT_PARTIAL = "containment.partial"
    EXIT_BARRIER_DONE = "exit_barrier.done"
    EXIT_BARRIER_TIMEOUT = "exit_barrier.timeout"
    HEALTH_PASSED = "health.passed"
    HEALTH_FAILED = "health.failed"
    HEALTH_SKIPPED = "health.skipped"
    RECOVERY_DETECTED = "recovery.detected"
    RECOVERY_STOP_WORKERS = "recovery.stop_workers"
    RECOVERY_RENDEZVOUS = "recovery.rendezvous"
    RECOVERY_SPAWN = "recovery.spawn"
    RECOVERY_TOTAL = "recovery.total"
    RECOVERY_FIRST_PROGRESS = "recovery.first_progress"
    NODE_QUARANTINED = "node.quarantined"
    NODE_RELEASED = "node.released"
    REPLICAS_CREATED = "replicas.created"
    LIGHTHOUSE_MISSING = "lighthouse.missing"
    LIGHTHOUSE_QUORUM = "lighthouse.quorum"


#: What each kind means (``docs/events.md`` is made from it).
MEANING: dict[EventKind, str] = {
    EventKind.NODE_QUARANTINED: (
        "A node the job runs on (or whose failure tripped the policy) was quarantined: its "
        "health check failed, failures attributed to it reached the threshold, or an admin "
        "drained it (the message names who and why); the fleet places nothing on it, the "
        "job re-forms without it, uncharged."
    ),
    EventKind.NODE_RELEASED: (
        "A node the job was placed on left quarantine: an admin undrained it, or its TTL ran out."
    ),
    EventKind.JOB_SUBMITTED: "Accepted (POST /jobs) by this node, or a torchrun run registered.",
    EventKind.JOB_STATE: "The job document changed state.",
    EventKind.JOB_RESUMED: "A job left active by a daemon that stopped goes on as a new attempt.",
    EventKind.JOB_REFUSED: "A job document in the store failed the daemon's checks.",
    EventKind.JOB_CANCEL_REQUESTED: "A user asked to cancel.",
    EventKind.JOB_CHECKPOINT_REQUESTED: (
        "The scheduler warned that the job's end is near (Slurm's --signal, ahead of the time "
        "limit): the workers are asked to checkpoint; `signal` is the signal they got."
    ),
    EventKind.JOB_UNSCHEDULABLE: (
        "No set of live nodes could ever hold it (too few match with enough slots); it waits, "
        "flagged, until such nodes join."
    ),
    EventKind.JOB_QUEUED: "It waits in the fleet queue for capacity (the message says what).",
    EventKind.JOB_PLACED: "The fleet scheduler chose the nodes that run it (and its hot spare).",
    EventKind.JOB_PREEMPTED: (
        "A higher-priority job (named) took its nodes: its workers are stopped with their grace "
        "and it goes back to the queue, no restart charged."
    ),
    EventKind.JOB_SHRUNK: (
        "A lent node (above min_nodes) or its hot spare was given back for another job (named)."
    ),
    EventKind.SCHED_CRASHED: (
        "A fleet scheduler's pass failed while the job waited: that daemon gave up deciding "
        "for a while and another one takes over."
    ),
    EventKind.DAEMON_STOPPED: "The daemon running the job stopped.",
    EventKind.DAEMON_REEXEC: (
        "The daemon running the job re-executed itself in place (SIGHUP, elasticd reload): "
        "same pid, old and new version in the message; the workers ran on, or, on a job not "
        "carried over, why (it resumes as a new attempt)."
    ),
    EventKind.DAEMON_REEXEC_REFUSED: (
        "A re-exec was asked for but the new program failed its pre-flight check "
        "(`elasticd serve --check`: its imports, the configuration and its secrets, each "
        "database opened read-write, room on the state disk for the new image's first "
        "writes): the daemon runs on unchanged, the reason in the message."
    ),
    EventKind.JOB_READOPTED: (
        "After a re-exec the daemon took up the job's running workers again (same pids, "
        "pipes, heartbeats, attempt and restart count)."
    ),
    EventKind.AGENT_ERROR: "The agent hit an internal error.",
    EventKind.AGENT_CRASHED: "The agent task died; its workers were stopped.",
    EventKind.AGENT_GAVE_BACK: "This node could not start the workers for node_failure_grace "
    "seconds (``cause``) and gave the job back to the scheduler: it leaves the round and "
    "declines the job for a while; no restart spent.",
    EventKind.AGENT_FENCED: "The node lost the store for its lease: its workers stop.",
    EventKind.AGENT_FINISHED: "The agent on this node is done with the job.",
    EventKind.STORE_LOST: "The node cannot reach the store.",
    EventKind.STORE_BACK: "The node reaches the store again.",
    EventKind.STORAGE_BACK: "The local disk takes writes again.",
    EventKind.EVENTS_DROPPED: "Events lost past the write backlog's bound.",
    EventKind.EVENTS_TRIMMED: (
        "Stands in place of events of this job and node that the event retention policy "
        "dropped: how many (count), and from its time to time + duration_s. Dropped: routine "
        "events, and a crash loop's repeats (a worker exit, restart or hang the same as the "
        "one of its kind before it). The first and last events and every other failure are "
        "kept."
    ),
    EventKind.LOGS_LOST: (
        "Worker output that could not be written: the disk refused it, or only root's reserve "
        "or none of the job user's quota was left."
    ),
    EventKind.LOGS_TRUNCATED: (
        "Worker output past the attempt's log_limit_bytes (per stream), counted and dropped."
    ),
    EventKind.RENDEZVOUS_COMPLETE: "A round formed.",
    EventKind.RENDEZVOUS_CHANGE: "The group re-forms (no restart spent).",
    EventKind.RENDEZVOUS_FAILED: "The join timed out.",
    EventKind.GROUP_STATE: "The node's worker group changed state.",
    EventKind.GROUP_RESTARTING: "A failure: the group re-forms (a restart is charged).",
    EventKind.WORKERS_STARTED: "The attempt's workers run.",
    EventKind.WORKERS_STOPPED: "The attempt's workers were stopped.",
    EventKind.WORKERS_SPAWN_FAILED: "The workers could not be started, for the job's own "
    "reason (its program, its working folder, its user); the job fails.",
    EventKind.WORKERS_SPAWN_RETRY: "The node could not start the workers for its own reason "
    "(``cause``: EMFILE, ENOMEM, EAGAIN, a missing cgroup, ...; ``count``: the tries so far); "
    "tried again after a backoff, no restart spent.",
    EventKind.WORKERS_STRAYS: "Processes of the attempt outlived its workers and were killed.",
    EventKind.WORKER_EXITED: "A worker exited.",
    EventKind.WORKER_HANG: "A worker missed its progress deadline.",
    EventKind.WORKER_STACKS: "The stacks of a worker of a node that saw a hang (every running "
    "rank of the node; with in-process restart the stuck one only), and where its main thread "
    "is (`its main thread is in f (file.py:12) < ...`) when its dump could be read.",
    EventKind.WORKER_HEARTBEAT_REPLACED: "A worker's heartbeat file was replaced.",
    EventKind.WORKER_HEALTH_CHECK_FAILED: "A health check failed before the attempt.",
    EventKind.WORKER_ORPHAN_KILLED: "A worker of an earlier daemon run was killed at start-up.",
    EventKind.WORKERS_WARM_START: "Workers of a prewarm job took over their standby "
    "interpreters instead of starting cold.",
    EventKind.WORKER_COLD_START: "A worker of a prewarm job started cold, and why (no Python "
    "entrypoint, a changed spec or user, its standby lost, a node that joined late).",
    EventKind.STANDBY_LOST: "A standby interpreter died or failed its imports (one that died "
    "is replaced).",
    EventKind.CONTAINMENT_PARTIAL: "The attempt's processes could not all be put in a cgroup.",
    EventKind.EXIT_BARRIER_DONE: "Every node of the round finished.",
    EventKind.EXIT_BARRIER_TIMEOUT: "Not every node finished within exit_barrier_timeout.",
    EventKind.HEALTH_PASSED: "A health check passed.",
    EventKind.HEALTH_FAILED: "A health check failed.",
    EventKind.HEALTH_SKIPPED: "A health check was skipped.",
    EventKind.RECOVERY_DETECTED: "A recovery began (its cause).",
    EventKind.RECOVERY_STOP_WORKERS: "Recovery phase: the workers were stopped.",
    EventKind.RECOVERY_RENDEZVOUS: "Recovery phase: the round formed.",
    EventKind.RECOVERY_SPAWN: "Recovery phase: the new workers were spawned.",
    EventKind.RECOVERY_TOTAL: "Recovery: from detection to the new workers.",
    EventKind.RECOVERY_FIRST_PROGRESS: "Recovery: to the first heartbeat of the new workers.",
    EventKind.REPLICAS_CREATED: "A job of replica_groups had groups (child jobs) without a "
    "document (the daemon that took the POST stopped between its writes): a daemon wrote them.",
    EventKind.LIGHTHOUSE_MISSING: "A replica group started without TORCHFT_LIGHTHOUSE: this "
    "node's Lighthouse for the job could not be found (the message says why).",
    EventKind.LIGHTHOUSE_QUORUM: "The job's torchft Lighthouse formed a quorum of a new id: "
    "its members, and the replicas that joined (a restarted group rejoining) or left it (a "
    "group lost), as torchft's replica ids. Said by the node whose leader formed it.",
}


def recovery_phase_kind(phase: str) -> EventKind:
    """The kind that times one recovery phase (``recovery.<phase>``); ValueError if none."""
    return EventKind(f"recovery.{phase}")


def known_kind(kind: str) -> EventKind | None:
    """The member for an event's ``kind`` as read back, or None for a kind this version lacks."""
    try:
        return EventKind(kind)
    except ValueError:
        return None


def reference() -> str:
    """``docs/events.md``: every kind and what it means (``python -m elasticd.eventkinds``)."""
    rows = "\n".join(f"| `{k.value}` | {MEANING[k]} |" for k in EventKind)
    return (
        "# Event kinds\n\n"
        "Generated from `elasticd/eventkinds.py` by `python -m elasticd.eventkinds > "
        "docs/events.md` (a test fails when it drifts). Every event of a job "
        "(`GET /jobs/{id}/events`, the SSE stream, `elasticd events`) has one of these kinds.\n\n"
        "| kind | meaning |\n|---|---|\n" + rows + "\n"
    )


if __name__ == "__main__":
    print(reference(), end="")
