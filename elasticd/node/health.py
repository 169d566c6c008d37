"""Health checks run before every (re)start of a worker group.

Two kinds, run concurrently by :func:`run_health_checks`:

* :class:`CommandCheck` — a job's or a node's own command (``argv``, no
  shell). Exit 0 passes; anything else, or passing its timeout, fails. The
  command runs in its own session and, on timeout, its whole process group
  is killed. The last few KiB of its output become the result's message.
* :class:`GpuCheck` — built in: ``nvidia-smi --query-gpu=...`` over the GPUs
  of the job (``-i $CUDA_VISIBLE_DEVICES`` when that lists them), and the
  critical Xid errors the driver wrote to the kernel log since the last look
  (:mod:`elasticd.node.xid`). It fails on such an Xid,
  on a non-zero exit, on a GPU reported lost, in error or needing a reset
  (``[GPU is lost]``, ``[Unknown Error]``, ``ERR!``, ``[GPU requires
  reset]``), on uncorrected volatile ECC errors, on retired pages pending a
  reset, and when no GPU is listed. ``[N/A]`` and ``[Not Supported]`` (no
  ECC on this board) are fine. Without ``nvidia-smi`` (an absolute path
  from the config, else looked up on the operator's ``PATH``), or with
  ``CUDA_VISIBLE_DEVICES`` set empty (a node without GPUs), it is
  *skipped*: ``ok`` and ``skipped`` are both true, and the message says why.

Who runs what, with which environment
    Every check is started like a worker, by
    :func:`elasticd.supervise.spawn.start_process` (parent-death wrapper, the
    program looked up by the process itself, ``ELASTICD_TOKEN``,
    ``NOTIFY_SOCKET`` and the other withheld variables never passed). A
    *job's* check (``health_check`` in its spec) carries the job's user,
    environment and working folder: it runs as the job, exactly as its
    workers do. The *operator's* checks (the node's ``health_check`` and
    the GPU check) run as the daemon with the environment given to
    :func:`run_health_checks`, which is the daemon's own and never holds
    anything of the job's: a job's ``PATH`` or ``LD_PRELOAD`` must not
    choose what a more privileged process runs.

What a job's check leaves behind
    A job's check is the job's code: a ``setsid`` child of it would outlive
    the check's process group, the job and the daemon. So with containment
    (:mod:`elasticd.supervise.cgroup`) it runs in a cgroup of its own, made
    for the check and killed and removed as soon as the check ends (pass or
    fail); in subreaper mode the processes it orphaned, adopted by the
    daemon, are killed then, as an attempt's strays are. The result's
    message says how many were killed.

Every result carries its duration. Nothing here raises for a failing or
missing check: a check that cannot run is a failed (or skipped) result.
This module does not import torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from elasticd.errors import WorkerSpawnError
from elasticd.models import JobSpec
from elasticd.node.xid import KernelLog, critical
from elasticd.security import Identity
from elasticd.supervise.cgroup import AttemptContainment
from elasticd.supervise.env import job_check_env, operator_env
from elasticd.supervise.spawn import DEFAULT_POLICY, SpawnPolicy, start_process

log = logging.getLogger(__name__)

__all__ = [
    "GPU_QUERY_FIELDS",
    "CommandCheck",
    "GpuCheck",
    "HealthCheck",
    "HealthResult",
    "checks_for_job",
    "parse_gpu_query",
    "run_health_checks",
]

#: What the GPU check asks nvidia-smi for, in this order.
GPU_QUERY_FIELDS = (
    "index",
    "pci.bus_id",
    "name",
    "ecc.errors.uncorrected.volatile.total",
    "retired_pages.pending",
)

#: Cells (or output) that mean a GPU is unusable.
_BAD_MARKERS = ("[GPU is lost]", "[Unknown Error]", "ERR!", "[GPU requires reset]", "GPU is lost")

#: Kept from a check's output for its message.
_OUTPUT_TAIL = 4096


@dataclass(frozen=True)
class HealthResult:
    """The outcome of one check."""

    name: str
    ok: bool
    skipped: bool
    message: str
    duration_s: float


@dataclass(frozen=True)
class CommandCheck:
    """Run ``argv``; exit 0 within ``timeout`` seconds is healthy."""

    argv: Sequence[str]
    name: str = "health_check"
    timeout: float | None = None
    """Seconds; None uses the timeout given to :func:`run_health_checks`."""
    env: Mapping[str, str] | None = None
    """Its own complete environment (a job's check: as the job's workers get it); None: the
    operator's environment given to :func:`run_health_checks`."""
    identity: Identity | None = None
    """The user it runs as (a job's check: the job's); None: the daemon's own user."""
    cwd: str | None = None
    """Its working folder, entered as ``identity`` (a job's check: the job's ``cwd``)."""
    job_id: str | None = None
    """Set for a job's check: it runs contained (a cgroup of its own, see the module), and
    whatever it leaves is killed when it ends."""
    umask: int | None = None
    """Its umask (a job's check: the job's, as its workers get it); None: the daemon's."""


@dataclass(frozen=True)
class GpuCheck:
    """The built-in ``nvidia-smi`` check."""

    name: str = "gpu"
    nvidia_smi: str = "nvidia-smi"
    """An absolute path, or a name looked up on the operator environment's ``PATH``."""
    timeout: float | None = None
    kernel_log: KernelLog | None = None
    """Where the driver's Xid errors are read (:mod:`elasticd.node.xid`); None: not read."""


HealthCheck = CommandCheck | GpuCheck


def checks_for_job(
    command: Sequence[str] | None,
    *,
    gpu: bool = True,
    node_command: Sequence[str] | None = None,
    job_env: Mapping[str, str] | None = None,
    identity: Identity | None = None,
    cwd: str | None = None,
    nvidia_smi: str | None = None,
    job_id: str | None = None,
    umask: int | None = None,
    kernel_log: KernelLog | None = None,
    operator_timeout: float | None = None,
) -> list[HealthCheck]:
    """The checks a job runs: the node's command, the job's command, then the GPU check.

    The job's command runs as ``identity`` with ``job_env`` in ``cwd``; the
    node's command and the GPU check run as the operator's (see the module), within
    ``operator_timeout`` (None: the run's timeout, the job's).
    """
    checks: list[HealthCheck] = []
    if node_command:
        checks.append(
            CommandCheck(list(node_command), name="node_health_check", timeout=operator_timeout)
        )
    if command:
        checks.append(
            CommandCheck(
                list(command),
                name="health_check",
                env=dict(job_env) if job_env is not None else None,
                identity=identity,
                cwd=cwd,
                job_id=job_id,
                umask=umask,
            )
        )
    if gpu:
        checks.append(
            GpuCheck(
                nvidia_smi=nvidia_smi or "nvidia-smi",
                kernel_log=kernel_log,
                timeout=operator_timeout,
            )
        )
    return checks


async def run_health_checks(
    checks: Sequence[HealthCheck],
    env: Mapping[str, str],
    timeout: float = 60.0,
    *,
    policy: SpawnPolicy = DEFAULT_POLICY,
) -> list[HealthResult]:
    """Run every check concurrently; results in the order of ``checks``.

    ``env`` is the operator's environment: the complete environment of the
    checks that carry none of their own (its ``PATH`` finds them and
    ``nvidia-smi``); never put anything of a job's in it. ``timeout``
    applies to each check that has none of its own. ``policy`` is the
    daemon's spawn policy (how a check is started, like a worker).
    """
    return list(await asyncio.gather(*(_run_one(check, env, timeout, policy) for check in checks)))


@dataclass(frozen=True)
class NodeHealthChecks:
    """This node's health checks for its jobs: what the agent runs before each (re)start
    (:class:`elasticd.agent.ports.HealthChecks`).

    The job's own check runs as the job (its user, env and folder, like a worker);
    the node's check and the GPU check are the operator's: the daemon's environment,
    never the job's.
    """

    base_env: Mapping[str, str]
    """The daemon's environment: the operator's checks start from it."""
    job_base_env: Mapping[str, str] | None = None
    """What the job's own check starts from, before the job's ``env`` (None: ``base_env``)."""
    node_command: Sequence[str] | None = None
    """The node config's health check command."""
    nvidia_smi: str | None = None
    """The node config's ``nvidia-smi`` (None: looked up on ``base_env``'s PATH)."""
    policy: SpawnPolicy = DEFAULT_POLICY
    kernel_log: KernelLog | None = None
    """The daemon's reader of the kernel log, for the GPU check's Xid errors."""
    operator_timeout: float = 60.0
    """How long the node's check and the GPU check may take (config ``health_check_timeout``;
    the job's ``health_check_timeout`` is its own check's only)."""

    async def run(
        self,
        job_id: str,
        spec: JobSpec,
        *,
        identity: Identity | None,
        cuda_visible_devices: str | None,
    ) -> list[HealthResult]:
        cuda = cuda_visible_devices
        checks = checks_for_job(
            spec.health_check,
            gpu=spec.gpu_health_check,
            node_command=self.node_command,
            job_env=job_check_env(
                self.base_env if self.job_base_env is None else self.job_base_env,
                spec.env,
                job_id=job_id,
                cuda_visible_devices=cuda,
            ),
            identity=identity,
            cwd=spec.cwd,
            nvidia_smi=self.nvidia_smi,
            job_id=job_id,  # contained: nothing it starts outlives it
            umask=spec.umask_bits,
            kernel_log=self.kernel_log,
            operator_timeout=self.operator_timeout,
        )
        if not checks:
            return []
        env = operator_env(self.base_env, job_id=job_id, cuda_visible_devices=cuda)
        return await run_health_checks(checks, env, spec.health_check_timeout, policy=self.policy)


async def _run_one(
    check: HealthCheck, env: Mapping[str, str], timeout: float, policy: SpawnPolicy
) -> HealthResult:
    started = time.monotonic()
    limit = check.timeout if check.timeout is not None else timeout
    if isinstance(check, GpuCheck):
        ok, skipped, message = await _gpu(check, env, limit, policy)
    else:
        ok, skipped, message = await _command(check, env, limit, policy)
    return HealthResult(check.name, ok, skipped, message, time.monotonic() - started)


async def _command(
    check: CommandCheck, env: Mapping[str, str], timeout: float, policy: SpawnPolicy
) -> tuple[bool, bool, str]:
    argv = list(check.argv)
    if not argv:
        return False, False, "the health check command is empty"
    code, output, timed_out, leftovers = await _execute(
        argv,
        check.env if check.env is not None else env,
        timeout,
        identity=check.identity,
        cwd=check.cwd,
        policy=policy,
        job_id=check.job_id,
        umask=check.umask,
    )
    shown = " ".join(argv)
    if leftovers:
        output += f"\n(killed {leftovers} process(es) the check left behind)"
    if timed_out:
        return False, False, f"{shown!r} did not finish within {timeout:g} s{_tail(output)}"
    if code is None:
        return False, False, f"{shown!r} could not be started: {output}"
    if code != 0:
        return False, False, f"{shown!r} exited with {_status(code)}{_tail(output)}"
    return True, False, f"{shown!r} passed{_tail(output)}"


async def _gpu(
    check: GpuCheck, env: Mapping[str, str], timeout: float, policy: SpawnPolicy
) -> tuple[bool, bool, str]:
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1", "none", "NoDevFiles"):
        return True, True, f"skipped: the job has no GPUs (CUDA_VISIBLE_DEVICES={visible!r})"
    # The operator's nvidia-smi: a configured path, else the daemon's PATH (never a job's).
    exe = shutil.which(check.nvidia_smi, path=env.get("PATH", os.defpath))
    if exe is None:
        where = "there" if os.sep in check.nvidia_smi else "on PATH"
        return True, True, f"skipped: {check.nvidia_smi} is not {where} (no NVIDIA driver here)"
    argv = [exe, f"--query-gpu={','.join(GPU_QUERY_FIELDS)}", "--format=csv,noheader,nounits"]
    if visible and not visible.startswith("MIG-"):
        argv += ["-i", visible.strip()]
    code, output, timed_out, _ = await _execute(argv, env, timeout, policy=policy)
    xids = critical(check.kernel_log.new_xids()) if check.kernel_log is not None else []
    if xids:  # the driver's own word, whatever nvidia-smi says (it may hang on a lost GPU)
        return False, False, "; ".join(x.describe() for x in xids[:8])
    if timed_out:
        return False, False, f"nvidia-smi did not answer within {timeout:g} s{_tail(output)}"
    if code is None:
        return False, False, f"nvidia-smi could not be started: {output}"
    if code != 0:
        return False, False, f"nvidia-smi exited with {_status(code)}{_tail(output)}"
    problems, gpus = parse_gpu_query(output)
    if problems:
        return False, False, "; ".join(problems)
    return True, False, f"{len(gpus)} GPU(s) healthy: " + ", ".join(gpus)


def parse_gpu_query(output: str) -> tuple[list[str], list[str]]:
    """``(problems, gpus)`` from the CSV of :data:`GPU_QUERY_FIELDS`; no problems = healthy."""
    problems: list[str] = []
    gpus: list[str] = []
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    if not lines:
        return ["nvidia-smi listed no GPU"], gpus
    for line in lines:
        cells = [cell.strip() for cell in line.split(",")]
        if len(cells) != len(GPU_QUERY_FIELDS):
            if any(marker in line for marker in _BAD_MARKERS):
                problems.append(f"nvidia-smi: {line}")
            else:
                problems.append(f"nvidia-smi printed an unexpected line: {line!r}")
            continue
        index, bus, name, ecc, pending = cells
        label = f"GPU {index} ({name}, {bus})"
        bad = [cell for cell in cells if any(marker in cell for marker in _BAD_MARKERS)]
        if bad:
            problems.append(f"{label} is unusable: {', '.join(bad)}")
            continue
        gpus.append(f"GPU {index} {name}")
        if ecc.isdigit() and int(ecc) > 0:
            problems.append(f"{label} has {ecc} uncorrected ECC error(s) since the driver loaded")
        if pending.lower() == "yes":
            problems.append(f"{label} has retired memory pages pending: it needs a reset")
    return problems, gpus


async def _execute(
    argv: Sequence[str],
    env: Mapping[str, str],
    timeout: float,
    *,
    identity: Identity | None = None,
    cwd: str | None = None,
    policy: SpawnPolicy = DEFAULT_POLICY,
    job_id: str | None = None,
    umask: int | None = None,
) -> tuple[int | None, str, bool, int]:
    """Run ``argv``; ``(returncode, output tail, timed_out, leftovers killed)``; returncode None
    if not started. With ``job_id`` and the policy's containment it runs contained."""
    contained: AttemptContainment | None = None
    if job_id is not None and policy.containment is not None:
        try:
            contained = policy.containment.open_attempt(job_id, None, None)
        except OSError as exc:
            return None, f"cannot make its cgroup: {exc}", False, 0
    try:
        proc = await start_process(
            argv,
            env,
            identity=identity,
            cwd=cwd,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            policy=policy,
            cgroup_procs=contained.procs_fd if contained is not None else None,
            umask=umask,
        )
    except BaseException as exc:
        if contained is not None:
            await _end(contained, ())
        if isinstance(exc, WorkerSpawnError):
            return None, str(exc), False, 0
        raise
    assert proc.stdout is not None
    tail = bytearray()
    timed_out = False
    try:
        async with asyncio.timeout(timeout):
            while chunk := await proc.stdout.read(65536):
                tail += chunk
                del tail[:-_OUTPUT_TAIL]
            await proc.wait()
    except TimeoutError:
        # Past the timeout: a failure, unless the command itself had exited and
        # only a process it left behind still held the output open.
        timed_out = proc.returncode is None
    finally:
        # The check runs in its own session: end it whole, leftovers included.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        if proc.returncode is None:
            await asyncio.shield(proc.wait())
        leftovers = 0 if contained is None else len(await _end(contained, (proc.pid,)))
    return proc.returncode, tail.decode("utf-8", "replace"), timed_out, leftovers


async def _end(contained: AttemptContainment, groups: Collection[int]) -> list[int]:
    """Kill whatever a job's check left (its cgroup, or its orphans); the killed pids."""
    try:
        return await asyncio.shield(contained.stop(groups))
    except OSError as exc:
        log.warning("cannot stop the health check's cgroup: %s", exc)
        return []


def _status(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


def _tail(output: str) -> str:
    text = output.strip()
    return f": {text}" if text else ""
