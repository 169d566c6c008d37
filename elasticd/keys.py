"""The store's key layout: every top-level prefix, and every key of a job, in one place.

Standard library only and free of elasticd imports: workers import it too
(through :mod:`elasticd.worker.names`), on the job's side of the privilege
boundary. It builds names; it reads and writes nothing.

The cluster store holds, with one owner for each subtree::

    nodes/<node>                      node record, lease-bound           (cluster)
    job/<id>                          the job document, written by CAS  (jobs; torchrun_backend)
    refused/<node>/<digest>           an unreadable job document         (jobs)
    ev/<id>/<node>/<seq>              a node's events, in its order      (events)
    group/<id>/<node>                 a node's published worker group    (agent)
    gp/<id>/<node>                    a node's goodput facts of the job  (agent.goodput)
    gp/<id>/<node>/<page>             its older attempts, sealed          (agent.goodput)
    barrier/<id>/<round>/<node>       a round's exit barrier             (agent)
    rdzv/<id>/...                     the job's rendezvous               (rendezvous.layout)
    jobs/<id>/torch/<attempt>/...     the workers' torch store           (worker.names)
    jobs/<id>/inprocess/<attempt>/... in-process restart's coordination  (inprocess.keys)
    jobs/<id>/torchrun/<round>/...    torch's agent store, one per round  (torchrun_backend)
    jobs/<id>/lighthouse/...          torchft's quorum: leader, quorum, nodes/<node> (lighthouse)
    elasticd/probe                    read to see the store answer       (daemon)
    sched/plan                        the fleet's placement and queue    (node.scheduler)
    sched/leader                      the daemon that decides, lease-bound (node.scheduler)

``job/`` and ``jobs/`` differ on purpose: every daemon lists and watches
``job/`` for job documents, and nothing that workers write may land there.
A subtree's owner may lay out what is inside it; what lies outside the
prefixes of :func:`keys_of_job` must never carry a job's data, because
deleting the job deletes exactly those prefixes (and the job document).
"""

from __future__ import annotations

__all__ = [
    "BARRIERS",
    "EVENTS",
    "GOODPUT",
    "GROUPS",
    "JOBS",
    "NODES",
    "HEALTH",
    "PROBE",
    "REFUSED",
    "RENDEZVOUS",
    "SCHED_LEADER",
    "SCHED_PLAN",
    "WORKER_SPACE",
    "barrier_prefix",
    "event_key",
    "event_prefix",
    "goodput_key",
    "goodput_page_key",
    "goodput_prefix",
    "group_key",
    "group_prefix",
    "job_key",
    "keys_of_job",
    "lighthouse_leader_key",
    "lighthouse_node_key",
    "lighthouse_nodes_prefix",
    "lighthouse_prefix",
    "lighthouse_quorum_key",
    "node_key",
    "health_key",
    "refusal_key",
    "rendezvous_prefix",
    "torchrun_store_prefix",
    "worker_prefix",
]

NODES = "nodes/"
#: Each node's health record, across jobs: the failures attributed to it, its quarantine.
HEALTH = "health/"
JOBS = "job/"
REFUSED = "refused/"
EVENTS = "ev/"
GROUPS = "group/"
GOODPUT = "gp/"
BARRIERS = "barrier/"
RENDEZVOUS = "rdzv/"
WORKER_SPACE = "jobs/"
PROBE = "elasticd/probe"
#: One document, written by compare-and-set only: which nodes run each job, and the queue.
SCHED_PLAN = "sched/plan"
#: The node whose scheduler decides (bound to its lease; the others only apply the plan).
SCHED_LEADER = "sched/leader"


def node_key(node: str) -> str:
    return NODES + node


def health_key(node: str) -> str:
    """The node's health record (``elasticd.node.quarantine``): not bound to its lease, so
    a quarantine outlives the daemon that was quarantined."""
    return HEALTH + node


def job_key(job_id: str) -> str:
    return JOBS + job_id


def refusal_key(node: str, digest: str) -> str:
    return f"{REFUSED}{node}/{digest}"


def event_prefix(job_id: str) -> str:
    return f"{EVENTS}{job_id}/"


def event_key(job_id: str, node: str, seq: int) -> str:
    """Zero-padded, so that a node's events list in their own order."""
    return f"{event_prefix(job_id)}{node}/{seq:012d}"


def group_prefix(job_id: str) -> str:
    return f"{GROUPS}{job_id}/"


def group_key(job_id: str, node: str) -> str:
    return group_prefix(job_id) + node


def goodput_prefix(job_id: str) -> str:
    return f"{GOODPUT}{job_id}/"


def goodput_key(job_id: str, node: str) -> str:
    """One node's record of what it saw of the job's attempts (``elasticd.goodput``)."""
    return goodput_prefix(job_id) + node


def goodput_page_key(job_id: str, node: str, page: int | None = None) -> str:
    """A sealed page of that record's older attempts, or (``page`` None) every page's prefix
    (a node name has no ``/``, so no node's pages are another's record)."""
    base = goodput_key(job_id, node) + "/"
    return base if page is None else f"{base}{page}"


def barrier_prefix(job_id: str, round_: int | None = None) -> str:
    """One round's exit barrier, or (``round_`` None) every round's."""
    base = f"{BARRIERS}{job_id}/"
    return base if round_ is None else f"{base}{round_}/"


def rendezvous_prefix(job_id: str) -> str:
    return f"{RENDEZVOUS}{job_id}/"


def worker_prefix(job_id: str) -> str:
    """What the job's workers write (torch store, in-process restart); ``job_id`` escaped."""
    return f"{WORKER_SPACE}{job_id}/"


def torchrun_store_prefix(job_id: str, round_: int) -> str:
    """The store torch's agent gets for one round under ``torchrun --rdzv-backend=elasticd``.

    Fresh for every round, so that a re-formed group never reads a key the
    last one left (torch's own handler reuses one store: pytorch#135712).
    Under :func:`worker_prefix`: the agent runs on the job's side, and
    deleting the job deletes it.
    """
    return f"{worker_prefix(job_id)}torchrun/{round_}/"


def lighthouse_prefix(job_id: str) -> str:
    """The job's torchft Lighthouse (:mod:`elasticd.lighthouse.state` lays it out).

    Under :func:`worker_prefix`, so that deleting the job deletes it; the daemons write
    it, and a job's workers may too (their store scope): it is validated on every read.
    """
    return f"{worker_prefix(job_id)}lighthouse/"


def lighthouse_leader_key(job_id: str) -> str:
    """The node that decides the job's quorums, bound to its lease."""
    return lighthouse_prefix(job_id) + "leader"


def lighthouse_quorum_key(job_id: str) -> str:
    """The job's last quorum, written by compare-and-set only; never lease-bound (its id
    must survive every daemon)."""
    return lighthouse_prefix(job_id) + "quorum"


def lighthouse_nodes_prefix(job_id: str) -> str:
    return lighthouse_prefix(job_id) + "nodes/"


def lighthouse_node_key(job_id: str, node: str) -> str:
    """One node's record of its local Managers' requests and heartbeats, bound to its lease."""
    return lighthouse_nodes_prefix(job_id) + node


def keys_of_job(job_id: str) -> tuple[str, ...]:
    """Every prefix under which a job's keys live, its document (:func:`job_key`) aside.

    Deleting a job deletes these. A job id is checked before it names
    anything (``models.valid_job_id``: no ``/``), so no job's prefixes
    contain another's.
    """
    return (
        event_prefix(job_id),
        group_prefix(job_id),
        goodput_prefix(job_id),
        barrier_prefix(job_id),
        rendezvous_prefix(job_id),
        worker_prefix(job_id),
    )
