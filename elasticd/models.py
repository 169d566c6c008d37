"""The data elasticd keeps and serves: job specs, jobs, events, worker views.

These pydantic models are both the daemon's records and the API's wire
format (``api.schemas`` re-exports them), so what is stored is exactly what
is served. Everything is parsed from JSON into these; nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from enum import StrEnum
from typing import Annotated, Any, Literal, TypedDict

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictStr,
    field_validator,
    model_validator,
)

from elasticd.identity import ADMIN
from elasticd.replicas import (
    MAX_REPLICA_GROUPS,
    QuorumView,
    ReplicaGroupView,
    child_problem,
    majority,
    spec_problem,
)
from elasticd.sched.plan import (
    MAX_NODES,
    MAX_SELECTOR_ITEMS,
    MAX_SELECTOR_KEY,
    MAX_SELECTOR_VALUE,
    Placement,
    QueueEntry,
)
from elasticd.states import JobState, WorkerState

MAX_ARGS = 4096
MAX_ENV = 1024
MAX_STRING = 65536
JOB_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
#: An :func:`incarnation_tag`: which job of its id a record is about.
JOB_TAG_PATTERN = r"^[0-9a-f]{32}$"
#: Node names: a host name's characters; they name store keys and are shown in paths.
NODE_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$"
#: Most restarts a job may ask for: a crash-looping job restarts at most this often.
MAX_RESTARTS = 1000
#: The most failures of one round a job document keeps (the earliest: the root cause and
#: what it took down first).
MAX_ROUND_FAILURES = 64
#: A hang's root cause keeps at most this many of its node's ranks' stacks
#: (:attr:`RootCause.stacks`), each at most :data:`MAX_STACK_CHARS` long.
MAX_RANK_STACKS = 16
MAX_STACK_CHARS = 240
#: Each worker's stdout.log and stderr.log take at most this per attempt unless the job says
#: otherwise; the daemon writes them as root, so they need a ceiling of their own.
DEFAULT_LOG_LIMIT_BYTES = 1 << 30
#: The budget's bounds: enough for a traceback at least, and no more than 1 TiB a stream.
MIN_LOG_LIMIT_BYTES = 64 << 10
MAX_LOG_LIMIT_BYTES = 1 << 40
#: ``prewarm``: at most this many modules, each a dotted name of identifiers.
MAX_PREWARM = 64
MAX_MODULE_NAME = 256
MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")

Std = Literal["none", "out", "err", "all"]
_STD_BY_NUMBER: dict[str, Std] = {"0": "none", "1": "out", "2": "err", "3": "all"}

EventSource = Literal["daemon", "agent", "worker", "rendezvous"]


def parse_std_map(value: Any, field: str) -> str:
    """Normalise torchrun's ``--redirects`` / ``--tee`` syntax.

    Accepts ``3``, ``"3"``, ``"all"`` (every rank), ``"0:3,1:2"`` (per local
    rank) or ``{"0": "all"}``; returns a canonical string such as ``"all"`` or
    ``"0:all,1:err"``.
    """
    if isinstance(value, bool):
        raise ValueError(f"{field} must be 0-3, none/out/err/all, or 'rank:value,...'")
    if isinstance(value, int):
        value = str(value)
    if isinstance(value, dict):
        value = ",".join(f"{k}:{v}" for k, v in value.items())
    if not isinstance(value, str):
        raise ValueError(f"{field} must be 0-3, none/out/err/all, or 'rank:value,...'")

    def one(token: str) -> Std:
        token = token.strip().lower()
        if token in _STD_BY_NUMBER:
            return _STD_BY_NUMBER[token]
        if token in ("none", "out", "err", "all"):
            return token  # type: ignore[return-value]
        raise ValueError(f"{field}: {token!r} is not one of 0,1,2,3,none,out,err,all")

    value = value.strip()
    if ":" not in value:
        return one(value or "none")
    parts = []
    for item in value.split(","):
        rank, sep, std = item.partition(":")
        if not sep or not rank.strip().isdigit():
            raise ValueError(f"{field}: {item!r} is not 'local_rank:value'")
        parts.append(f"{int(rank)}:{one(std)}")
    return ",".join(parts)


def std_for_rank(canonical: str, local_rank: int) -> Std:
    """The stream setting a canonical redirects/tee string gives one local rank."""
    if ":" not in canonical:
        return canonical  # type: ignore[return-value]
    for item in canonical.split(","):
        rank, _, std = item.partition(":")
        if int(rank) == local_rank:
            return std  # type: ignore[return-value]
    return "none"


def console_streams(spec: JobSpec, local_rank: int) -> tuple[bool, bool]:
    """Whether a worker's (stdout, stderr) reach the console, by torchrun's rules.

    Only ranks in ``local_ranks_filter`` (all when unset) are shown; a stream
    that is redirected is hidden from the console unless it is also teed. Log
    files are written either way.
    """
    if spec.local_ranks_filter is not None and local_rank not in spec.local_ranks_filter:
        return False, False
    redirect = std_for_rank(spec.redirects, local_rank)
    tee = std_for_rank(spec.tee, local_rank)

    def shown(stream: Std) -> bool:
        return tee in (stream, "all") or redirect not in (stream, "all")

    return shown("out"), shown("err")


#: A job's umask when its spec sets none: its files are never world-readable, and its
#: group reads them only where a folder above lets it (root's 022 would let everyone).
DEFAULT_JOB_UMASK = 0o027


def parse_umask(value: Any) -> int:
    """A umask from a spec: an octal string (``"077"``, ``"0o077"``) or an int 0..0o777."""
    if isinstance(value, bool):
        raise ValueError("umask must be an octal string like '077' or an int, not a boolean")
    if isinstance(value, int):
        bits = value
    elif isinstance(value, str):
        text = value.strip().lower().removeprefix("0o")
        if not 1 <= len(text) <= 4 or not all(c in "01234567" for c in text):
            raise ValueError(f"umask {value!r} must be octal digits, like '077' or '0027'")
        bits = int(text, 8)
    else:
        raise ValueError(f"umask must be an octal string like '077' or an int, not {value!r}")
    if not 0 <= bits <= 0o777:
        raise ValueError(f"umask {value!r} is out of range (0 to 0o777)")
    return bits


def format_umask(bits: int) -> str:
    """``bits`` as a spec keeps it: four octal digits (``0o27`` -> ``"0027"``)."""
    return f"{bits:04o}"


class JobSpec(BaseModel):
    """What a user submits: a torchrun-style job.

    Field names follow torchrun's flags. Unknown fields are refused so that a
    typo is an error, not a silently ignored setting.
    """

    model_config = ConfigDict(extra="forbid")

    id: Annotated[str | None, Field(pattern=JOB_ID_PATTERN)] = Field(
        default=None,
        description="Client-chosen id; makes the submission idempotent.",
    )
    entrypoint: str = Field(
        min_length=1,
        max_length=4096,
        description="Program to run, e.g. 'python' or '/opt/venv/bin/python'.",
    )
    args: list[Annotated[str, Field(max_length=MAX_STRING)]] = Field(
        default_factory=list, max_length=MAX_ARGS
    )
    env: dict[
        Annotated[str, Field(min_length=1, max_length=256)],
        Annotated[StrictStr, Field(max_length=MAX_STRING)],
    ] = Field(default_factory=dict, max_length=MAX_ENV)
    cwd: str | None = Field(default=None, max_length=4096)
    nproc_per_node: int = Field(default=1, ge=1, le=1024)
    min_nodes: int = Field(default=1, ge=1, le=100_000)
    max_nodes: int | None = Field(default=None, ge=1, le=100_000)
    max_restarts: int = Field(
        default=3,
        ge=0,
        le=MAX_RESTARTS,
        description="Restarts of the worker group (job-wide) before the job fails. 3 by "
        "default: a service keeps a job alive across a few crashes; `elasticd run` defaults "
        "to 0, as torchrun does",
    )
    role: str = Field(default="default", min_length=1, max_length=128)
    redirects: str = Field(
        default="none", description="torchrun --redirects: 0-3/none/out/err/all or 'rank:v,...'"
    )
    tee: str = Field(
        default="none", description="torchrun --tee: 0-3/none/out/err/all or 'rank:v,...'"
    )
    local_ranks_filter: list[Annotated[int, Field(ge=0)]] | None = Field(
        default=None, description="Only these local ranks' output reaches the console."
    )
    log_limit_bytes: int = Field(
        default=DEFAULT_LOG_LIMIT_BYTES,
        ge=MIN_LOG_LIMIT_BYTES,
        le=MAX_LOG_LIMIT_BYTES,
        description="The most bytes each worker's stdout.log and stderr.log take per attempt; "
        "later output is counted and dropped (a logs.truncated event), never blocking the worker.",
    )
    termination_grace: float = Field(
        default=30.0, ge=0, le=3600, description="Seconds between SIGTERM and SIGKILL."
    )
    exit_barrier_timeout: float = Field(default=300.0, ge=0, le=86_400)
    node_selector: dict[
        Annotated[str, Field(min_length=1, max_length=MAX_SELECTOR_KEY)],
        Annotated[StrictStr, Field(max_length=MAX_SELECTOR_VALUE)],
    ] = Field(
        default_factory=dict,
        max_length=MAX_SELECTOR_ITEMS,
        description=f"Node labels the job needs (at most {MAX_SELECTOR_ITEMS}; keys of 1 to "
        f"{MAX_SELECTOR_KEY} characters, values of at most {MAX_SELECTOR_VALUE}).",
    )
    nodes: list[Annotated[str, Field(pattern=NODE_NAME_PATTERN)]] | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_NODES,
        description="The only nodes the job may run on, by name (unset: any). "
        "`elasticd submit --slurm` sets the Slurm allocation's nodes.",
    )
    slurm_job_id: str | None = Field(
        default=None,
        pattern=r"^[0-9]+(_[0-9]+)?$",
        max_length=64,
        description="The Slurm job this job belongs to (`elasticd submit --slurm`): it ends "
        "with it, and `elasticd slurm epilog` cancels it.",
    )
    master_addr: str | None = Field(default=None, min_length=1, max_length=255)
    master_port: int | None = Field(default=None, ge=1, le=65535)
    join_timeout: float = Field(
        default=600.0, gt=0, le=86_400, description="Seconds to gather min_nodes."
    )
    last_call_timeout: float = Field(
        default=1.0,
        ge=0,
        le=3600,
        description="Seconds a round stays open for stragglers once min_nodes have joined.",
    )
    progress_timeout: float | Literal["auto"] | None = Field(
        default=None,
        description="A worker that has pinged (elasticd.worker.ping) must ping again within "
        "this many seconds (0 < s <= 86400), or the group is UNHEALTHY and restarted. "
        '"auto": sized from the observed intervals between pings (see docs/goodput.md). '
        "Off by default.",
    )
    checkpoint_timeout: float | None = Field(
        default=None,
        gt=0,
        le=86_400,
        description="While a checkpoint is in progress (elasticd.worker.checkpointing() until "
        "checkpointed()), the worker is judged by this many seconds from the checkpoint's "
        "start instead of progress_timeout. Unset: a checkpoint in progress has no deadline.",
    )
    max_no_progress_restarts: int | None = Field(
        default=None,
        ge=1,
        le=MAX_RESTARTS,
        description="The job fails once this many restarts in a row made no progress: no "
        "checkpoint past the one the attempt started from (for a job that never reports a "
        "checkpoint: no step past every earlier attempt's). Off by default.",
    )
    startup_timeout: float | None = Field(
        default=None,
        gt=0,
        le=86_400,
        description="Seconds a worker has for its first ping. Off by default.",
    )
    health_check: list[Annotated[str, Field(max_length=4096)]] | None = Field(
        default=None,
        max_length=256,
        description="A command (argv) run before every (re)start of the group; "
        "a non-zero exit means unhealthy.",
    )
    health_check_timeout: float = Field(default=60.0, gt=0, le=3600)
    gpu_health_check: bool = Field(
        default=True, description="Run the built-in nvidia-smi check (skipped without it)."
    )
    user: str | None = Field(
        default=None,
        min_length=1,
        max_length=32,
        pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$",
        description="Run the workers as this user; the node must list it in allowed_users.",
    )
    priority: int = Field(
        default=0,
        ge=-1000,
        le=1000,
        description="Queue order: a higher priority is placed first (FIFO within one) and may "
        "preempt running jobs of a lower priority, which go back to the queue.",
    )
    umask: str | None = Field(
        default=None,
        max_length=8,
        description='The umask of the job\'s processes: octal digits ("077") or an int '
        '0..0o777, kept as four digits ("0077"). Default 0027: a job\'s files are never '
        "world-readable. The CLI sends the caller's own umask.",
    )
    inprocess_restart: bool = Field(
        default=False,
        description="The script uses elasticd.inprocess.Wrapper: a dead rank is reported to "
        "the others, which restart in-process; the group fails only if every worker fails.",
    )
    prewarm: list[Annotated[str, Field(max_length=MAX_MODULE_NAME)]] = Field(
        default_factory=list,
        max_length=MAX_PREWARM,
        description="Modules (dotted names, e.g. 'torch') a standby interpreter per local rank "
        "imports while an attempt runs; a restart hands the round to it instead of starting "
        "a new interpreter (a Python entrypoint only; else the workers start cold).",
    )

    replica_groups: int | None = Field(
        default=None,
        ge=1,
        le=MAX_REPLICA_GROUPS,
        description="torchft replica groups: the job runs N independent gangs (child jobs "
        "`<id>.g0` .. `<id>.g<N-1>`), each of nproc_per_node workers on min_nodes..max_nodes "
        "nodes of its own, with its own rendezvous, ranks and restart budget; its workers get "
        "REPLICA_GROUP_ID, NUM_REPLICA_GROUPS and TORCHFT_LIGHTHOUSE. Unset: one gang.",
    )
    min_replicas: int | None = Field(
        default=None,
        ge=1,
        le=MAX_REPLICA_GROUPS,
        description="With replica_groups: the job is RUNNING while at least this many groups "
        "run, and fails only once fewer can still run (default: a majority, N//2+1).",
    )

    @field_validator("progress_timeout", mode="before")
    @classmethod
    def _progress_timeout(cls, value: Any) -> Any:
        if value is None or value == "auto":
            return value
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(
                f'progress_timeout must be a number of seconds or "auto", not {value!r}'
            )
        if not 0 < value <= 86_400:
            raise ValueError(f"progress_timeout must be in (0, 86400] seconds, not {value!r}")
        return float(value)

    @field_validator("entrypoint")
    @classmethod
    def _entrypoint_not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("entrypoint must name a program, not be blank")
        if "\x00" in value:
            raise ValueError("entrypoint must not contain NUL")
        return value

    @field_validator("prewarm")
    @classmethod
    def _prewarm_modules(cls, value: list[str]) -> list[str]:
        for name in value:
            if not MODULE_NAME.fullmatch(name):
                raise ValueError(
                    f"prewarm names modules to import: {name!r} is not a dotted name "
                    "of identifiers (e.g. 'torch' or 'torch.distributed')"
                )
        return value

    @field_validator("umask", mode="before")
    @classmethod
    def _umask(cls, value: Any) -> str | None:
        return None if value is None else format_umask(parse_umask(value))

    @property
    def umask_bits(self) -> int:
        """The umask the job's processes get: the spec's, else :data:`DEFAULT_JOB_UMASK`."""
        return DEFAULT_JOB_UMASK if self.umask is None else int(self.umask, 8)

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        for name, val in value.items():
            if not name or "=" in name or "\x00" in name or "\x00" in val:
                raise ValueError(f"env name {name!r} must be non-empty, without '=' or NUL")
        return value

    @field_validator("redirects", "tee", mode="before")
    @classmethod
    def _std(cls, value: Any, info: Any) -> str:
        return parse_std_map(value, info.field_name)

    @field_validator("local_ranks_filter", mode="before")
    @classmethod
    def _ranks_filter(cls, value: Any) -> Any:
        if isinstance(value, str):  # torchrun's "0,1" form
            try:
                return [int(v) for v in value.split(",") if v.strip()]
            except ValueError as exc:
                raise ValueError("local_ranks_filter must be a list of ranks or '0,1,...'") from exc
        return value

    @model_validator(mode="after")
    def _nodes(self) -> JobSpec:
        if self.max_nodes is None:
            self.max_nodes = self.min_nodes
        if self.min_nodes > self.max_nodes:
            raise ValueError(
                f"min_nodes ({self.min_nodes}) must not exceed max_nodes ({self.max_nodes})"
            )
        return self

    @model_validator(mode="after")
    def _replicas(self) -> JobSpec:
        if (problem := spec_problem(self.id, self.replica_groups, self.min_replicas)) is not None:
            raise ValueError(problem)
        if self.replica_groups is not None and self.min_replicas is None:
            self.min_replicas = majority(self.replica_groups)
        return self

    def without_id(self) -> dict[str, Any]:
        """The spec as compared for idempotent submission (the id itself excluded)."""
        return self.model_dump(exclude={"id"})


def known(*parts: tuple[str, object]) -> list[str]:
    """``label value`` for each part whose value is known (pure): what a line shows of a
    record whose fields may be unset, so that no text says "None"."""
    return [f"{label} {value}" for label, value in parts if value is not None]


class RankStack(BaseModel):
    """Where one rank's main thread was when its node saw the hang (its stack dump, read)."""

    rank: int = Field(ge=0, description="The worker's global rank.")
    local_rank: int = Field(ge=0)
    stack: str = Field(
        min_length=1,
        max_length=MAX_STACK_CHARS,
        description="The innermost frames of its main thread, innermost first: "
        "`slow_step (train.py:12) < train (train.py:20) < <module> (train.py:30)`.",
    )
    collectives: int | None = Field(
        default=None,
        ge=0,
        description="The highest collective sequence number its flight recorder shows it "
        "issued (the default process group's; None: the recorder is off). A rank behind the "
        "others is the one they wait for.",
    )


class RootCause(BaseModel):
    """The first failure of a job attempt: which worker, and what it said."""

    message: str
    node: str | None = None
    local_rank: int | None = None
    rank: int | None = None
    exit_code: int | None = None
    signal: int | None = None
    signal_name: str | None = None
    traceback: str | None = None
    timestamp: float | None = None
    attempt: int | None = None
    round: int | None = None
    exited_at: float | None = None
    log_dir: str | None = None
    source: Literal["error_file", "log"] | None = None
    """Where ``message`` and ``traceback`` come from: the worker's error file (torch's
    ``@record``), the last traceback in its ``stderr.log``, or None (only the exit is known)."""
    since_round_s: float | None = Field(
        default=None,
        description="Seconds from the node seeing its round form to its detecting this failure, "
        "on that node's monotonic clock: comparable across nodes whatever their wall clocks say "
        "(the order of a round's failures, not a time to show).",
    )
    collateral: bool = Field(
        default=False,
        description="A failure of the round after its root cause (`Job.error`): a survivor's "
        "consequence, such as a peer's 'connection reset', not a cause.",
    )
    stacks: list[RankStack] | None = Field(
        default=None,
        max_length=MAX_RANK_STACKS,
        description="A hang: where each rank of the node that saw it was (its stack dump, "
        "read). Across the round's nodes, the ranks whose stacks differ from the others' "
        "are the hang's cause (`Job.error` names one of them).",
    )

    def who(self, *, attempt: bool = True) -> str:
        """The failed worker in words, naming only what is known (pure): ``rank 1 (node a,
        local rank 1, attempt 0)``; ``node a (attempt 0)`` for a failure of no one worker (a
        health check); ``a worker`` when nothing is."""
        details = known(
            ("node", self.node),
            ("local rank", self.local_rank),
            ("attempt", self.attempt if attempt else None),
        )
        if self.rank is not None:
            head = f"rank {self.rank}"
        elif details:
            head, details = details[0], details[1:]
        else:
            return "a worker"
        return head + (f" ({', '.join(details)})" if details else "")

    def sort_key(self) -> tuple[float, float]:
        """Earliest failure first: the error file's time, then the exit time (one node's clock)."""
        return (self.timestamp or float("inf"), self.exited_at or float("inf"))


class Recovery(BaseModel):
    """Where the time of one recovery went (wall-clock seconds).

    Phases: failure detected → workers stopped → rendezvous complete →
    workers spawned (→ first progress ping, when the job pings). Across
    nodes, the summary spans from the earliest detection to the last node's
    spawn, and each phase is the slowest node's.
    """

    round: int = Field(description="The rendezvous round the recovery produced.")
    cause: str
    detected_at: float
    stop_s: float | None = Field(default=None, description="Detected → workers stopped.")
    rendezvous_s: float | None = Field(default=None, description="Stopped → round complete.")
    spawn_s: float | None = Field(default=None, description="Round complete → workers spawned.")
    first_progress_s: float | None = Field(
        default=None, description="Workers spawned → first progress ping."
    )
    spawned_at: float | None = None
    total_s: float | None = Field(default=None, description="Detected → workers spawned.")

    def phases_text(self) -> str:
        """``stop 0.100s, rendezvous 0.250s, spawn 0.020s`` (the phases known, pure), and a
        word when they add up to more than the total: phases overlap (workers started
        early, during the rendezvous; a round that formed while the old workers stopped;
        across nodes each phase is the slowest node's, not one node's timeline)."""
        phases = [
            (name, s)
            for name, s in (
                ("stop", self.stop_s),
                ("rendezvous", self.rendezvous_s),
                ("spawn", self.spawn_s),
            )
            if s is not None
        ]
        text = ", ".join(f"{name} {s:.3f}s" for name, s in phases)
        summed = sum(s for _, s in phases)
        if self.total_s is not None and summed > self.total_s + 0.0005:
            text += (
                f" (the phases overlap: they add up to {summed:.3f}s, more than the "
                f"{self.total_s:.3f}s total)"
            )
        return text


class RecoveryTotals(BaseModel):
    """All recoveries of a job so far."""

    count: int = 0
    total_s: float = 0.0


class AttemptProgress(BaseModel):
    """What the workers of one attempt (one round) reported: steps and checkpoints.

    Each node's agent keeps one from its workers' heartbeat files
    (:mod:`elasticd.agent.checkpoints`) and merges it into the job's
    (:attr:`JobProgress.attempt`) when a checkpoint lands and when its
    workers stop; across nodes the highest step and checkpoint win. Rebuilt
    from the heartbeat files and the job document alone (nothing else is
    kept), so a daemon that restarts loses no more than its samples.
    """

    round: int = Field(description="The rendezvous round of the attempt.")
    started_from: int | None = Field(
        default=None,
        description="The job's checkpoint step when the attempt started "
        "(ELASTICD_CHECKPOINT_STEP); None: none yet.",
    )
    max_step: int | None = Field(default=None, description="The highest step any worker reported.")
    checkpoint_step: int | None = Field(
        default=None, description="The highest checkpoint step any worker reported."
    )
    checkpoint_path: str | None = Field(default=None, max_length=4096)
    first_step_at: float | None = Field(
        default=None, description="Wall time of the first ping of the attempt."
    )
    last_step_at: float | None = Field(
        default=None, description="Wall time of the last ping seen (at the last report)."
    )
    checkpointing_since: float | None = Field(
        default=None, description="Wall time a checkpoint in progress began (at the last report)."
    )


class JobProgress(BaseModel):
    """A job's training progress across attempts and nodes: the last checkpoint, the policy."""

    checkpoint_step: int | None = Field(
        default=None,
        description="The job's last durable checkpoint (elasticd.worker.checkpointed), from "
        "any attempt on any node; a restarted attempt gets it as ELASTICD_CHECKPOINT_STEP.",
    )
    checkpoint_path: str | None = Field(default=None, max_length=4096)
    checkpoint_at: float | None = Field(
        default=None, description="When the daemon learnt of that checkpoint (wall time)."
    )
    max_step: int | None = Field(
        default=None, description="The highest step of every attempt that ended."
    )
    attempt: AttemptProgress | None = Field(
        default=None, description="The current (or last) attempt's progress."
    )
    no_progress_restarts: int = Field(
        default=0, ge=0, description="Failed restarts in a row that made no progress."
    )


class PendingFailure(BaseModel):
    """A failure in a round, charged to the budget once the next round shows who came back."""

    round: int
    participants: list[str]
    error: RootCause
    failures: list[RootCause] = Field(
        default_factory=list,
        max_length=MAX_ROUND_FAILURES,
        description="Each node's failure of the round, in the order the store recorded them.",
    )


class JobOwner(BaseModel):
    """Who submitted a job, and the rights of that identity the fleet applies to it.

    Stamped by the daemon that took the ``POST`` (:mod:`elasticd.identity`), never
    taken from the request: the scheduler reads ``may_preempt`` and
    ``slot_quota`` from here, because the daemon that plans may not know the
    submitter's identity.
    """

    name: str = Field(pattern=r"^[A-Za-z0-9._@:-]{1,128}$", description="The identity's name.")
    local: bool = Field(
        default=False,
        description="The name is a local Unix user's (a unix-socket caller no identity names), "
        "not an identity's: a local user and an identity of the same name are different owners.",
    )
    admin: bool = False
    unix_user: str | None = Field(
        default=None,
        max_length=256,
        description="The Unix user the job runs as by its owner's own right (a unix-socket "
        "caller's self, or one of a token identity's users): every node runs it as that user "
        "where it exists, without allowed_users (root: only with allow_root).",
    )
    may_preempt: bool = Field(
        default=True, description="Whether the job may stop lower-priority jobs to start."
    )
    slot_quota: int | None = Field(
        default=None,
        ge=0,
        le=10_000_000,
        description="The most slots this identity's running jobs may hold together (None: any).",
    )


class Launcher(StrEnum):
    """Who runs a job's workers (``Job.launcher``; the stored and served values are these)."""

    ELASTICD = "elasticd"  # the daemons' agents: scheduled, run, cancelled and resumed by them
    TORCHRUN = "torchrun"  # torch's agents (``torchrun --rdzv-backend=elasticd``): shown only
    GROUPS = "groups"  # a job of replica_groups: its groups (child jobs) run it; derived


class Job(BaseModel):
    """A submitted job and where it stands.

    Job documents are read back from the cluster store, which anyone holding
    the store's credentials can write: the id obeys the API's rule
    (:data:`JOB_ID_PATTERN`, so it can never name a path outside the log
    folder), agrees with the spec's id, and the bounds of the spec hold.
    """

    id: Annotated[str, Field(pattern=JOB_ID_PATTERN)]
    spec: JobSpec
    state: JobState
    restart_count: int = Field(default=0, ge=0)
    max_restarts: int = Field(ge=0, le=MAX_RESTARTS)
    round: int = 0
    created_at: float
    started_at: float | None = None
    finished_at: float | None = None
    error: RootCause | None = None
    collateral: list[RootCause] = Field(
        default_factory=list,
        max_length=MAX_ROUND_FAILURES,
        description="The other failures of `error`'s round, after it in time, each marked "
        "`collateral`: what the root cause took down with it.",
    )
    reason: str | None = Field(
        default=None,
        description="Why the job ended, restarts or waits, in words; none while it runs "
        "(a move to RUNNING clears it).",
    )
    submitted_to: str | None = Field(default=None, description="The node that took the POST.")
    owner: JobOwner | None = Field(
        default=None,
        description="Who submitted it (None: a job from before identities, the admin's).",
    )
    pending_failure: PendingFailure | None = None
    charged_round: int = -1
    last_recovery: Recovery | None = Field(
        default=None, description="Phase durations of the latest recovery."
    )
    recovery_totals: RecoveryTotals = Field(default_factory=RecoveryTotals)
    progress: JobProgress = Field(
        default_factory=JobProgress,
        description="Steps and checkpoints the workers reported, and the no-progress count.",
    )
    queue: QueueEntry | None = Field(
        default=None,
        description="While the job waits for nodes: its place in the fleet's queue and why "
        "(filled in when served, never stored).",
    )
    nodes: list[str] | None = Field(
        default=None,
        description="The nodes the fleet scheduler placed it on, hot spares last (when served).",
    )
    launcher: Launcher = Field(
        default=Launcher.ELASTICD,
        description=(
            "Who runs the workers. `torchrun`: torch's own agents, under "
            "`torchrun --rdzv-backend=elasticd`, write this document; the daemons show it "
            "and never run, cancel or resume it. `groups`: a job of `replica_groups`, whose "
            "groups (child jobs) run the workers."
        ),
    )
    replica_group: int | None = Field(
        default=None, ge=0, description="A replica group of `group_of`: its REPLICA_GROUP_ID."
    )
    group_of: str | None = Field(
        default=None, pattern=JOB_ID_PATTERN, description="The job of replica_groups it is of."
    )
    num_replica_groups: int | None = Field(
        default=None, ge=1, le=MAX_REPLICA_GROUPS, description="Its NUM_REPLICA_GROUPS."
    )
    groups: list[ReplicaGroupView] | None = Field(
        default=None,
        description="A job of `replica_groups`: each group's child job and where it stands "
        "(filled in when served, never stored).",
    )
    quorum: QuorumView | None = Field(
        default=None,
        description="A job of `replica_groups`: the last quorum its torchft Lighthouse "
        "formed (filled in when served, never stored).",
    )

    @model_validator(mode="after")
    def _ids_agree(self) -> Job:
        if self.spec.id is not None and self.spec.id != self.id:
            raise ValueError(f"the job's id {self.id!r} differs from its spec's {self.spec.id!r}")
        nested = self.spec.replica_groups is not None
        group, of, count = self.replica_group, self.group_of, self.num_replica_groups
        if (problem := child_problem(self.id, group, of, count, nested)) is not None:
            raise ValueError(problem)
        return self

    @property
    def is_parent(self) -> bool:
        """A job of ``replica_groups``: its groups (child jobs) run its workers."""
        return self.launcher is Launcher.GROUPS


def incarnation(job: Job) -> str:
    """Which job of its id ``job`` is: its log folders on each node say so (:mod:`elasticd.logs`).

    A deleted job's id may be taken again, by another owner; its files stay on disk.
    """
    owner = job.owner or JobOwner(name=ADMIN.name)
    return json.dumps([job.id, job.submitted_to, job.created_at, owner.name, owner.local])


def incarnation_tag(job: Job) -> str:
    """A short, header-safe name of :func:`incarnation`: what a daemon that forwards a
    request about ``job`` tells the other daemon, which then answers about no other job;
    and what each of the job's events carries (:attr:`Event.job_tag`)."""
    return hashlib.sha256(incarnation(job).encode()).hexdigest()[:32]


def tagged_for(recorded: str | None, tag: str | None) -> bool:
    """Whether a record (an event, a group view, a goodput record) tagged ``recorded`` is
    about the job ``tag`` names (pure). A job id can be deleted and taken again while a
    record of the old job is still on its way to the store; such a record is another
    job's. An untagged record (an older daemon's, in a mixed-version cluster) is kept:
    nothing says whose it is; ``tag`` None asks for every record of the id."""
    return tag is None or recorded is None or recorded == tag


class QueueView(BaseModel):
    """``GET /queue``: the jobs that wait, in the order they will be placed, and the placements."""

    queue: list[QueueEntry]
    placements: dict[str, Placement] = Field(
        description="Job id -> the nodes that run it (hard share first) and its hot spares."
    )


class JobEdit(TypedDict, total=False):
    """The fields of a job document that may change after submission, typed.

    ``JobService.update_job(job_id, state=..., reason=...)`` takes these as
    keywords and an edit function (:data:`JobMutation`) returns one, so a
    misspelled field or a wrong type is a mypy error, not a silent no-op.
    """

    state: JobState
    reason: str | None
    error: RootCause | None
    collateral: list[RootCause]
    round: int
    restart_count: int
    pending_failure: PendingFailure | None
    charged_round: int
    last_recovery: Recovery | None
    recovery_totals: RecoveryTotals
    progress: JobProgress


#: A job-document edit decided from the current document (applied by compare-and-set,
#: so it may run more than once: it must be a pure function of the job).
JobMutation = Callable[[Job], JobEdit]


class JobList(BaseModel):
    """One page of jobs, newest first."""

    jobs: list[Job]
    total: int
    next_offset: int | None = None


class Event(BaseModel):
    """One persisted, ordered thing that happened to a job."""

    seq: int
    time: float
    job_id: str
    node: str
    source: EventSource
    kind: str
    state: str | None = None
    attempt: int | None = None
    rank: int | None = None
    local_rank: int | None = None
    pid: int | None = None
    exit_code: int | None = None
    signal: int | None = None
    error: RootCause | None = None
    message: str = ""
    duration_s: float | None = None
    #: ``logs.lost``: bytes of worker output the log files refused (or the daemon held back:
    #: only root's reserve or none of the user's quota was left), in all and per local rank;
    #: ``logs.truncated``: bytes dropped past the attempt's ``log_limit_bytes``.
    bytes_lost: int | None = None
    lost_by_rank: dict[str, int] | None = None
    count: int | None = None
    """How many things the event is about (``workers.strays``: processes killed)."""
    pids: list[int] | None = None
    """The processes it is about (``workers.strays``: the ones killed)."""
    by: str | None = Field(default=None, pattern=JOB_ID_PATTERN)
    """The job that caused it (``job.preempted``, ``job.shrunk``)."""
    early: bool | None = None
    """``workers.started``: started before the store had formed their round (the
    restart of a job no other node can join); the store then confirmed it."""
    cause: str | None = Field(default=None, max_length=64)
    """``workers.spawn_retry``, ``agent.gave_back``: the node's trouble that kept it from
    starting the workers (an errno name such as ``EMFILE``, or a stage such as ``cgroup``)."""
    replica_group: int | None = None
    """The replica group (child job) the event is about, in the events of a job of
    ``replica_groups`` and of its groups (stamped when read: ``job_id`` names the child)."""
    job_tag: str | None = Field(default=None, pattern=JOB_TAG_PATTERN)
    """Which job of its id the event is about (:func:`incarnation_tag` of its document):
    a job id can be deleted and taken again, maybe by another owner, while an event of
    the old job is still on its way to the store. Reads by id show only the events of
    the job asked about, and the ones with no tag (written by an older daemon)."""

    def record(self) -> str:
        """The stored and published form (the node's database, the store's ``ev/`` copy):
        the fields that are None are left out, and read back as None. About half the bytes
        of the full form, for a copy every node holds in memory for as long as it keeps
        the job."""
        return self.model_dump_json(exclude_none=True)


class WorkerView(BaseModel):
    """One worker process of a group."""

    local_rank: int
    rank: int
    role_rank: int
    world_size: int
    role_world_size: int
    local_world_size: int
    pid: int | None = None
    state: WorkerState
    exit_code: int | None = None
    signal: int | None = None
    started_at: float | None = None
    exited_at: float | None = None
    last_progress_at: float | None = None
    step: int | None = Field(default=None, description="The last step it reported.")
    checkpoint_step: int | None = Field(
        default=None, description="The last checkpoint it reported."
    )
    replica_group: int | None = Field(
        default=None,
        description="Its replica group (a job of `replica_groups`; None: an ordinary job).",
    )


class StandbyView(BaseModel):
    """A standby interpreter of a ``prewarm`` job: the next attempt's worker, past its imports."""

    local_rank: int
    pid: int
    state: Literal["starting", "ready"]
    """``starting``: importing the job's ``prewarm`` modules; ``ready``: waiting for a restart."""
    rss_bytes: int | None = None
    """Its resident memory: what prewarm costs this node while the attempt runs."""


class GroupView(BaseModel):
    """The worker group of one job on one node."""

    node: str
    state: WorkerState
    role: str
    group_rank: int
    group_world_size: int
    attempt: int
    round: int
    restart_count: int
    master_addr: str | None = None
    master_port: int | None = None
    log_dir: str | None = None
    updated_at: float
    workers: list[WorkerView] = Field(default_factory=list)
    standbys: list[StandbyView] = Field(default_factory=list)
    """The node's standby interpreters for the next attempt (a ``prewarm`` job)."""
    replica_group: int | None = None
    """The replica group it runs (a job of ``replica_groups``; None: an ordinary job)."""
    job: str | None = None
    """The child job that runs it (a job of ``replica_groups``; None: the job asked about)."""
    job_tag: str | None = Field(default=None, pattern=JOB_TAG_PATTERN)
    """Which job of its id the group ran (:func:`incarnation_tag`): the agent of a deleted
    job may still publish its group after the id was taken again; a read by id shows only
    the groups of the job it reads (None: an older daemon's, shown)."""


class WorkersView(BaseModel):
    """The cluster view of a job's workers (``GET /jobs/{id}/workers``)."""

    job_id: str
    state: JobState
    restart_count: int
    max_restarts: int
    remaining_restarts: int
    round: int
    groups: list[GroupView]


def valid_job_id(value: str) -> bool:
    """Whether ``value`` is a job id the API would accept (and so a safe folder name)."""
    return re.fullmatch(JOB_ID_PATTERN, value) is not None


def valid_node_name(value: str) -> bool:
    """Whether ``value`` is a node name the daemon would accept (a store key's part may not be)."""
    return re.fullmatch(NODE_NAME_PATTERN, value) is not None
