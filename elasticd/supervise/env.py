"""The environment a worker starts with: torchrun's contract, so scripts run unchanged.

Precedence, lowest first: the base (below), then the job's ``env``, then the
contract variables, which always win. ``OMP_NUM_THREADS`` and
``TORCH_NCCL_ASYNC_ERROR_HANDLING`` are defaults only: an inherited value is
kept, as torchrun keeps it.

The base is decided once per daemon by :func:`job_base_env`. A served
daemon (``elasticd serve``) runs other users' jobs, and its environment is
the operator's (a cloud key, a proxy password, a ``CUDA``/``LD_*`` setting of
the machine's): a job gets only the names of :data:`ALLOWED_ENV` from it,
the neutral ones a login would have (``PATH``, the locale, the time zone),
and brings the rest in its own ``env``. An embedded daemon (``elasticd
run``, ``elasticd.launch``) runs its caller's own job as the caller: there
the whole environment passes on (less :data:`WITHHELD`), exactly as
torchrun's workers inherit its environment.

A job's health check gets the same, less the per-rank contract
(:func:`job_check_env`). The operator's checks (the node's command, the GPU
check) run as the daemon and get the daemon's environment only, never the
job's (:func:`operator_env`): a job's ``PATH``, ``LD_PRELOAD`` and the like
must never reach a process with more privilege than the job.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from elasticd.rendezvous.ranks import WorkerRanks

#: Never passed on to workers: systemd's socket would let a worker speak for
#: the daemon; the token must only reach workers as a file path.
WITHHELD = frozenset({"NOTIFY_SOCKET", "WATCHDOG_PID", "WATCHDOG_USEC", "ELASTICD_TOKEN"})


#: What changes from one round (or attempt) to the next for the same worker: the ranks,
#: sizes, master, restart count and the attempt's files. A standby interpreter starts
#: without them and gets them at the hand-off (:mod:`elasticd.supervise.standby`);
#: everything else of a worker's environment must be the same to hand off.
ROUND_VARIABLES = frozenset(
    {
        "LOCAL_RANK",
        "RANK",
        "GROUP_RANK",
        "ROLE_RANK",
        "ROLE_NAME",
        "LOCAL_WORLD_SIZE",
        "WORLD_SIZE",
        "GROUP_WORLD_SIZE",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_ERROR_FILE",
        "ELASTICD_HEARTBEAT_FILE",
        "ELASTICD_ATTEMPT",
        "ELASTICD_CHECKPOINT_STEP",  # the job's last checkpoint moves on between attempts
        "ELASTICD_CHECKPOINT_PATH",
        "ELASTICD_FLIGHT_RECORDER_FILE",  # in the attempt's log folder
        "TORCHFT_LIGHTHOUSE",  # this node's Lighthouse may move (a daemon's restart)
    }
)


#: The names a served daemon passes from its own environment to a job: what a login
#: shell of the job's user would have and that says nothing about the daemon's secrets.
#: ``HOME``, ``USER`` and ``LOGNAME`` are the job user's when it runs as another user.
ALLOWED_ENV = frozenset({"PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ"})
#: Prefixes of allowed names: the locale categories (``LC_ALL``, ``LC_CTYPE``, ...).
ALLOWED_ENV_PREFIXES = ("LC_",)


def job_base_env(
    environ: Mapping[str, str], *, inherit: bool, passthrough: Sequence[str] = ()
) -> dict[str, str]:
    """What a job's processes start from, of the daemon's ``environ`` (pure).

    ``inherit`` (an embedded daemon): all of it less :data:`WITHHELD`; else
    only :data:`ALLOWED_ENV`, the ``LC_*`` names and the names that match a
    ``passthrough`` pattern (``fnmatch``: the operator's ``job_env_passthrough``).
    """
    if inherit:
        return _daemon_base(environ)
    return {
        k: v
        for k, v in environ.items()
        if (
            k in ALLOWED_ENV
            or k.startswith(ALLOWED_ENV_PREFIXES)
            or any(fnmatch.fnmatchcase(k, pattern) for pattern in passthrough)
        )
        and k not in WITHHELD
    }


def _daemon_base(base: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in base.items() if k not in WITHHELD}


def job_check_env(
    base: Mapping[str, str],
    job_env: Mapping[str, str],
    *,
    job_id: str,
    cuda_visible_devices: str | None = None,
) -> dict[str, str]:
    """The environment of a job's own health check: the workers' rules, no ranks."""
    env = _daemon_base(base)
    env.update(job_env)
    for name in WITHHELD:
        env.pop(name, None)
    env["ELASTICD_JOB_ID"] = job_id
    if cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
    return env


def operator_env(
    base: Mapping[str, str], *, job_id: str, cuda_visible_devices: str | None = None
) -> dict[str, str]:
    """The environment of the operator's checks for a job: the daemon's, nothing of the job's."""
    env = _daemon_base(base)
    env["ELASTICD_JOB_ID"] = job_id
    if cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
    return env


@dataclass(frozen=True)
class ReplicaGroup:
    """A worker's replica group, for torchft (a job of ``replica_groups``)."""

    group: int
    """``REPLICA_GROUP_ID``: which group (child job) of its parent."""
    groups: int
    """``NUM_REPLICA_GROUPS``: how many its parent has."""
    lighthouse: str | None = None
    """``TORCHFT_LIGHTHOUSE``: this node's Lighthouse for the job; None: the variable is
    left as the job's env has it (unset by default: the group runs without one)."""


@dataclass(frozen=True)
class AttemptInfo:
    """What every worker of one attempt on one node shares."""

    job_id: str
    run_id: str
    master_addr: str
    master_port: int
    restart_count: int
    max_restarts: int
    daemon_url: str
    token_file: str | None = None
    cuda_visible_devices: str | None = None
    checkpoint_step: int | None = None
    """The job's last durable checkpoint (``ELASTICD_CHECKPOINT_STEP``), None: none yet."""
    checkpoint_path: str | None = None
    """Where it lies (``ELASTICD_CHECKPOINT_PATH``), when the worker said."""
    replica: ReplicaGroup | None = None
    """The attempt's replica group (a job of ``replica_groups``); None: an ordinary job."""


#: What a restarted attempt is told of the job's last checkpoint (the daemon's value wins
#: over the job's ``env``, which may set them for a first attempt that resumes).
CHECKPOINT_VARS = ("ELASTICD_CHECKPOINT_STEP", "ELASTICD_CHECKPOINT_PATH")


#: torchrun's macro in worker arguments: replaced by the worker's local rank.
LOCAL_RANK_MACRO = "${local_rank}"


def worker_args(args: Sequence[str], local_rank: int) -> list[str]:
    """The job's arguments for one worker, with torchrun's ``${local_rank}`` substituted."""
    return [arg.replace(LOCAL_RANK_MACRO, str(local_rank)) for arg in args]


def worker_env(
    base: Mapping[str, str],
    job_env: Mapping[str, str],
    ranks: WorkerRanks,
    attempt: AttemptInfo,
    *,
    error_file: str,
    heartbeat_file: str | None = None,
) -> dict[str, str]:
    """The complete environment of one worker."""
    env = _daemon_base(base)
    for name in CHECKPOINT_VARS:  # never the daemon's own; the job's may seed a first attempt
        env.pop(name, None)
    env.update(job_env)
    for name in WITHHELD:
        env.pop(name, None)
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    # torchrun runs ``python -u``: what a worker printed before it was stopped is
    # not lost in a buffer. The variable does the same for any Python entrypoint
    # (``python``, ``python3``, a shell that runs Python); a job that sets it keeps its value.
    env.setdefault("PYTHONUNBUFFERED", "1")
    # torchrun's launcher exports the signals its agent handles; workers inherit it.
    env.setdefault("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT")
    if ranks.local_world_size > 1:
        env.setdefault("OMP_NUM_THREADS", "1")
    env.update(
        {
            "LOCAL_RANK": str(ranks.local_rank),
            "RANK": str(ranks.rank),
            "GROUP_RANK": str(ranks.group_rank),
            "ROLE_RANK": str(ranks.role_rank),
            "ROLE_NAME": ranks.role_name,
            "LOCAL_WORLD_SIZE": str(ranks.local_world_size),
            "WORLD_SIZE": str(ranks.world_size),
            "GROUP_WORLD_SIZE": str(ranks.group_world_size),
            "ROLE_WORLD_SIZE": str(ranks.role_world_size),
            "MASTER_ADDR": attempt.master_addr,
            "MASTER_PORT": str(attempt.master_port),
            "TORCHELASTIC_RESTART_COUNT": str(attempt.restart_count),
            "TORCHELASTIC_MAX_RESTARTS": str(attempt.max_restarts),
            "TORCHELASTIC_RUN_ID": attempt.run_id,
            "TORCHELASTIC_USE_AGENT_STORE": "False",
            "TORCHELASTIC_ERROR_FILE": error_file,
            "ELASTICD_JOB_ID": attempt.job_id,
            "ELASTICD_URL": attempt.daemon_url,
        }
    )
    if attempt.token_file:
        env["ELASTICD_TOKEN_FILE"] = attempt.token_file
    else:
        env.pop("ELASTICD_TOKEN_FILE", None)
    if heartbeat_file:
        env["ELASTICD_HEARTBEAT_FILE"] = heartbeat_file
    if attempt.checkpoint_step is not None:
        env["ELASTICD_CHECKPOINT_STEP"] = str(attempt.checkpoint_step)
        if attempt.checkpoint_path:
            env["ELASTICD_CHECKPOINT_PATH"] = attempt.checkpoint_path
    if attempt.cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = attempt.cuda_visible_devices
    if (replica := attempt.replica) is not None:
        # torchft's contract: the Manager reads the group and the Lighthouse from these. Its
        # own ports (TORCHFT_MANAGER_PORT, the store's) are left to the job.
        env["REPLICA_GROUP_ID"] = str(replica.group)
        env["NUM_REPLICA_GROUPS"] = str(replica.groups)
        if replica.lighthouse is not None:
            env["TORCHFT_LIGHTHOUSE"] = replica.lighthouse
    return env
