"""What a task of a Slurm step is, and what its ``elasticd run`` does, from Slurm's environment.

Pure: no IO, no clock; the caller hands in the environment. See
:mod:`elasticd.slurm` for the whole picture.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass

from elasticd.errors import ConfigError

#: The store host's port is derived from the job and step ids into this range (above
#: torchrun's 29500 and most services', below Linux's ephemeral ports, 32768 up).
PORT_BASE = 20000
PORT_SPAN = 9000
#: What a bracket of a hostlist may expand to: a typo such as ``n[1-1000000]`` is refused.
MAX_HOSTS = 100_000

#: The only ``ELASTICD_*`` variables a step's daemons read: the store's credentials and TLS
#: files (an etcd's user, say). The rest of a user's ``ELASTICD_*`` is for their own daemon.
STORE_ENV = frozenset(
    {
        "ELASTICD_STORE_USERNAME",
        "ELASTICD_STORE_PASSWORD_FILE",
        "ELASTICD_STORE_CA_FILE",
        "ELASTICD_STORE_CERT_FILE",
        "ELASTICD_STORE_KEY_FILE",
        "ELASTICD_STORE_PREFIX",
        "ELASTICD_ALLOW_INSECURE_STORE",
    }
)

#: What a step's token is derived for (HMAC-SHA256 of the home secret), and what the store
#: host's proof is of (HMAC-SHA256 of the step's token): two purposes, never one another's.
STEP_TOKEN_CONTEXT = "elasticd-slurm-step:"
PROOF_CONTEXT = "elasticd-slurm-proof:"
#: A challenge's nonce: what a task sends and a store host answers for (URL-safe base64).
NONCE_PATTERN = r"^[A-Za-z0-9_-]{16,128}$"

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_hostlist(text: str) -> list[str]:
    """Slurm's hostlist syntax expanded, in order: ``n[1-3,5],gpu01`` -> ``n1 n2 n3 n5 gpu01``.

    A bracket holds numbers and ranges, zero-padded as written (``n[08-10]``
    gives ``n08 n09 n10``); one name may have several brackets (``r[1-2]n[1-2]``,
    their product, the last varying fastest). Raises ``ValueError`` on what
    Slurm would refuse too (an unclosed bracket, a backwards range).
    """
    names: list[str] = []
    for item in _split_top(text.strip()):
        names.extend(_expand_one(item))
        if len(names) > MAX_HOSTS:
            raise ValueError(f"hostlist {text!r} names more than {MAX_HOSTS} hosts")
    return names


def _split_top(text: str) -> list[str]:
    """Split on the commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            if depth:
                raise ValueError(f"hostlist {text!r}: nested '['")
            depth = 1
        elif ch == "]":
            if not depth:
                raise ValueError(f"hostlist {text!r}: ']' without '['")
            depth = 0
        elif ch == "," and not depth:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"hostlist {text!r}: unclosed '['")
    items.append(text[start:])
    if any(not item for item in items):
        raise ValueError(f"hostlist {text!r}: an empty name")
    return items


def _expand_one(item: str) -> list[str]:
    open_at = item.find("[")
    if open_at < 0:
        return [item]
    close_at = item.index("]", open_at)
    prefix, body, rest = item[:open_at], item[open_at + 1 : close_at], item[close_at + 1 :]
    numbers: list[str] = []
    for part in body.split(","):
        match = _RANGE.match(part.strip())
        if match is None:
            raise ValueError(f"hostlist {item!r}: {part!r} is not a number or a range")
        low, high = match.group(1), match.group(2) or match.group(1)
        if int(high) < int(low):
            raise ValueError(f"hostlist {item!r}: the range {part!r} runs backwards")
        if int(high) - int(low) >= MAX_HOSTS:
            raise ValueError(f"hostlist {item!r} names more than {MAX_HOSTS} hosts")
        width = len(low) if low.startswith("0") else 0
        numbers.extend(str(n).zfill(width) for n in range(int(low), int(high) + 1))
    tails = _expand_one(rest)
    return [prefix + number + tail for number in numbers for tail in tails]


@dataclass(frozen=True)
class SlurmTask:
    """One task of a Slurm job step, as its environment describes it."""

    job_id: str
    step_id: str
    nodes: tuple[str, ...]
    node_id: int

    @property
    def node_name(self) -> str:
        return self.nodes[self.node_id]

    @property
    def first_node(self) -> str:
        return self.nodes[0]


def task_from_env(environ: Mapping[str, str]) -> SlurmTask | None:
    """The Slurm task this process is (``None``: not inside an ``srun`` step).

    Reads ``SLURM_JOB_ID``, ``SLURM_STEP_ID``, ``SLURM_JOB_NODELIST`` (the
    step's ``SLURM_STEP_NODELIST`` when set: a step may use part of the
    allocation), ``SLURM_NODEID`` and ``SLURM_NNODES``; an inconsistent set is a
    ``ConfigError`` naming the variable.
    """
    job_id = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    step_id = environ.get("SLURM_STEP_ID") or environ.get("SLURM_STEPID")
    if not job_id or step_id is None:
        return None
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise ConfigError("inside a Slurm step but SLURM_JOB_NODELIST is not set")
    try:
        nodes = tuple(expand_hostlist(nodelist))
    except ValueError as exc:
        raise ConfigError(f"SLURM_JOB_NODELIST: {exc}") from None
    node_id = _int(environ, "SLURM_NODEID")
    count = environ.get("SLURM_STEP_NUM_NODES") or environ.get("SLURM_NNODES")
    if count is not None and count.strip().isdigit() and int(count) != len(nodes):
        raise ConfigError(
            f"SLURM_NNODES={count} but the node list {nodelist!r} names {len(nodes)} nodes"
        )
    if not 0 <= node_id < len(nodes):
        raise ConfigError(f"SLURM_NODEID={node_id} is not one of the {len(nodes)} nodes")
    return SlurmTask(job_id=job_id, step_id=step_id, nodes=nodes, node_id=node_id)


def _int(environ: Mapping[str, str], name: str) -> int:
    value = environ.get(name, "").strip()
    if not value.isdigit():
        raise ConfigError(f"inside a Slurm step but {name} is {value or 'not set'!r}")
    return int(value)


def store_environ(environ: Mapping[str, str]) -> dict[str, str]:
    """What of ``environ`` a step's daemons configure their store from (:data:`STORE_ENV`)."""
    return {k: v for k, v in environ.items() if k in STORE_ENV}


def parse_nnodes(text: str) -> tuple[int, int]:
    """torchrun's ``--nnodes``: ``N`` or ``MIN:MAX`` (pure)."""
    low, _, high = str(text).strip().partition(":")
    high = high or low
    if not (low.isdigit() and high.isdigit()) or int(low) < 1 or int(high) < int(low):
        raise ConfigError(f"--nnodes {text!r}: give N or MIN:MAX with 1 <= MIN <= MAX")
    return int(low), int(high)


@dataclass(frozen=True)
class AllocationRun:
    """What one task's ``elasticd run`` does in the step: its part in the job."""

    node_name: str
    #: The elasticd job's id, the same on every task: ``slurm-<job>.<step>``.
    job_id: str
    #: The Slurm step, ``<job>.<step>``: what the step's token is derived for.
    step: str
    min_nodes: int
    max_nodes: int
    #: This task's daemon hosts the store (none given, and it is the first node's).
    hosts_store: bool
    #: The store's host name (the first node's) and port, when no store URL is given.
    store_host: str
    store_port: int
    #: The ``--store-url`` given (etcd://...), else None.
    store_url: str | None
    #: This task submits the job (the first node's; every other task waits on it).
    submits: bool


def plan_allocation_run(
    task: SlurmTask, nnodes: str, *, store_url: str | None = None, port: int = 0
) -> AllocationRun:
    """The run of ``task`` for ``--nnodes nnodes`` (``port``: ``--port``, 0 if not given).

    The job needs at least ``MIN`` nodes of the step; the step's nodes beyond
    ``MAX`` are spares (the scheduler lends them; the rendezvous runs at most
    ``MAX``). ``port`` chooses the store host's port; by default it is derived
    from the job and step ids, so that every task computes the same one and
    two steps on one node do not collide.
    """
    low, high = parse_nnodes(nnodes)
    if low > len(task.nodes):
        raise ConfigError(
            f"--nnodes {nnodes}: the job needs {low} nodes but the step has {len(task.nodes)} "
            f"({','.join(task.nodes)}); srun -N{low} or more"
        )
    step = f"{task.job_id}.{task.step_id}"
    derived = PORT_BASE + zlib.crc32(step.encode()) % PORT_SPAN
    first = task.node_id == 0
    return AllocationRun(
        node_name=task.node_name,
        job_id=f"slurm-{step}",
        step=step,
        min_nodes=low,
        max_nodes=high,
        hosts_store=first and store_url is None,
        store_host=task.first_node,
        store_port=port or derived,
        store_url=store_url,
        submits=first,
    )


def step_token(secret: str, step: str) -> str:
    """The bearer token of the daemons of ``step`` (``<job>.<step>``): an HMAC-SHA256 of the
    home's secret, so that one leaked (to a store host's impostor, a worker's environment)
    is worth that step only, and the secret itself never leaves the home."""
    message = (STEP_TOKEN_CONTEXT + step).encode()
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def store_proof(token: str, nonce: str) -> str:
    """What a store host holding ``token`` answers to the challenge ``nonce``."""
    message = (PROOF_CONTEXT + nonce).encode()
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


def proof_holds(token: str, nonce: str, proof: object) -> bool:
    """``proof`` is the answer of a holder of ``token`` to ``nonce`` (compared in constant
    time); anything else (another step's proof, not a string) is not."""
    if not isinstance(proof, str) or not proof.isascii():
        return False
    return hmac.compare_digest(store_proof(token, nonce).encode(), proof.encode())


@dataclass(frozen=True)
class SlurmSubmission:
    """What ``elasticd submit --slurm`` adds to a job, in a batch script (form 2)."""

    slurm_job_id: str
    #: The allocation's nodes: the only ones the job may run on.
    nodes: tuple[str, ...]
    min_nodes: int
    max_nodes: int

    def spec_fields(self) -> dict[str, object]:
        return {
            "slurm_job_id": self.slurm_job_id,
            "nodes": list(self.nodes),
            "min_nodes": self.min_nodes,
            "max_nodes": self.max_nodes,
        }


def submission_from_env(environ: Mapping[str, str], nnodes: str | None) -> SlurmSubmission:
    """The job's part of the allocation this batch script runs in (``nnodes``: ``--nnodes``,
    None for every node of the allocation); a ``ConfigError`` outside one."""
    job_id = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not job_id or not nodelist:
        raise ConfigError(
            "elasticd submit --slurm runs inside a Slurm allocation (a batch script, salloc): "
            "SLURM_JOB_ID and SLURM_JOB_NODELIST are not set"
        )
    try:
        nodes = tuple(dict.fromkeys(expand_hostlist(nodelist)))
    except ValueError as exc:
        raise ConfigError(f"SLURM_JOB_NODELIST: {exc}") from None
    low, high = parse_nnodes(nnodes) if nnodes else (len(nodes), len(nodes))
    if high > len(nodes):
        raise ConfigError(
            f"--nnodes {nnodes}: the allocation has {len(nodes)} nodes ({','.join(nodes)}); "
            f"sbatch -N{high} or more"
        )
    return SlurmSubmission(job_id.strip(), nodes, low, high)
