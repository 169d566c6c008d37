"""The IO of ``elasticd run`` inside a Slurm step (form 1; see :mod:`elasticd.slurm`).

The decisions are :mod:`elasticd.slurm.allocation`'s; this module resolves
the nodes' addresses, provides the home's secret and the step's token derived
from it, waits for the store host and checks its proof (no token goes to a
store host that cannot prove it holds the step's), for the job task 0
submits, and, on the store host, for the others to leave.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import socket
import time
from pathlib import Path
from typing import Any

import httpx

from elasticd.config import read_secret
from elasticd.errors import ConfigError, JobNotFound, SlurmStepError, StoreError
from elasticd.eventkinds import EventKind
from elasticd.launcher import write_run_token
from elasticd.models import Job
from elasticd.slurm.allocation import AllocationRun, proof_holds, step_token

#: How long a task waits for the store host to answer, and for task 0's job to appear.
JOIN_WAIT = 120.0
#: How long the store host waits, after the job's end, for the other daemons to leave
#: (each must read the end from its store before the host stops serving it).
LEAVE_WAIT = 30.0
#: The home's secret, the step tokens' key, when no ``--token-file`` is given (the home
#: is shared across the nodes).
DEFAULT_TOKEN = Path("~/.config/elasticd/slurm-token")


def resolve(host: str) -> str:
    """The IPv4 address of a node's name, as its resolver (``/etc/hosts``, DNS) gives it."""
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except OSError as exc:
        raise ConfigError(f"cannot resolve the Slurm node {host!r}: {exc}") from None
    return str(infos[0][4][0])


def shared_token(path: Path | None) -> Path:
    """The secret file every task of the step derives its token from (:func:`step_token_file`):
    ``path``, else :data:`DEFAULT_TOKEN`, made (0600, a random secret) by the first task
    that finds none; the others read it.

    Made under a private name and linked into place, so that of tasks racing on a
    shared home exactly one token wins and no task reads a half-written file.
    """
    if path is not None:
        if not path.is_file():
            raise ConfigError(f"--token-file {path}: no such file")
        return path
    target = DEFAULT_TOKEN.expanduser()
    if target.is_file():
        return target
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fresh = target.parent / f".{target.name}.{secrets.token_hex(8)}"
    fd = os.open(fresh, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, (secrets.token_urlsafe(32) + "\n").encode())
    finally:
        os.close(fd)
    try:
        os.link(fresh, target)
    except FileExistsError:
        pass  # another task made it first: theirs is the token
    finally:
        fresh.unlink()
    return target


def step_token_file(plan: AllocationRun, secret_file: Path, state_dir: Path) -> Path:
    """The step's token (:func:`~elasticd.slurm.allocation.step_token` of the secret in
    ``secret_file``, a private file), in a new 0600 file in this task's ``state_dir``: what
    its daemon authenticates with and accepts."""
    secret = read_secret(secret_file, "Slurm token file")
    return write_run_token(state_dir, step_token(secret, plan.step))


def daemon_flags(plan: AllocationRun, token_file: Path) -> dict[str, Any]:
    """The embedded daemon's configuration flags for this task (IO: name resolution)."""
    own = resolve(plan.node_name)
    flags: dict[str, Any] = {
        "host": own,
        "advertise_addr": own,
        "port": plan.store_port if plan.hosts_store else 0,
        "node_name": plan.node_name,
        "token_file": str(token_file),
    }
    if plan.store_url is not None:
        flags["store_url"] = plan.store_url
    elif not plan.hosts_store:
        flags["store_url"] = f"http://{resolve(plan.store_host)}:{plan.store_port}"
    return flags


async def verify_store_host(url: str, token: str, timeout: float = JOIN_WAIT) -> None:
    """Until the store host's daemon answers, and then that it holds the step's ``token``.

    The store host's port is predictable, so another user of its node may hold it first;
    this task sends it nothing but a random nonce (no token) and checks the answer
    (``/slurm/proof``). A :class:`ConfigError` saying so when the answer is not the proof,
    a 404 or anything else: this task must not send that host the token.
    """
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=2.0) as client:
        while True:
            nonce = secrets.token_urlsafe(32)
            try:
                answer = await client.get(url.rstrip("/") + "/slurm/proof", params={"nonce": nonce})
            except httpx.HTTPError:
                answer = None
            if answer is not None:
                if answer.status_code == 200 and proof_holds(token, nonce, _proof_in(answer)):
                    return
                raise ConfigError(
                    f"the store host at {url} did not prove it holds this step's token "
                    f"(HTTP {answer.status_code}): it is not task 0's daemon (another user's "
                    "process may hold the port; srun --port chooses another); no token was "
                    "sent to it"
                )
            if time.monotonic() > deadline:
                raise ConfigError(
                    f"the store host at {url} (task 0 of the step) did not answer within "
                    f"{timeout:.0f} s"
                )
            await asyncio.sleep(0.1)


def _proof_in(answer: httpx.Response) -> object:
    try:
        body = answer.json()
    except ValueError:
        return None
    return body.get("proof") if isinstance(body, dict) else None


async def wait_for_store(url: str, timeout: float = JOIN_WAIT) -> None:
    """Until the store given by ``--store-url`` answers ``/healthz``."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=2.0) as client:
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(url.rstrip("/") + "/healthz")).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise ConfigError(
                    f"the store host at {url} (task 0 of the step) did not answer within "
                    f"{timeout:.0f} s"
                )
            await asyncio.sleep(0.1)


async def wait_submitted(
    daemon: Any, plan: AllocationRun, timeout: float = JOIN_WAIT, lost_after: float | None = None
) -> Job:
    """The job once it has ended, on a task that did not submit it (it may not exist yet).

    :class:`SlurmStepError` when task 0 has not submitted it within ``timeout``, or when the
    store has not answered for ``lost_after`` seconds (default: 3 lease TTLs; by then this
    node's lease has lapsed and its workers are stopped): the store host is lost, and with
    it the job's state.
    """
    lost_after = 3 * daemon.config.lease_ttl if lost_after is None else lost_after
    deadline = time.monotonic() + timeout
    unreachable_since: float | None = None
    while True:
        try:
            job: Job = await daemon.jobs.wait(plan.job_id)
            return job
        except JobNotFound:
            unreachable_since = None
            if time.monotonic() > deadline:
                raise SlurmStepError(
                    f"job {plan.job_id}: task 0 (on {plan.store_host}) did not submit it "
                    f"within {timeout:.0f} s"
                ) from None
        except StoreError as exc:
            now = time.monotonic()
            unreachable_since = unreachable_since or now
            if now - unreachable_since > lost_after:
                where = (
                    f"the store host {plan.store_host}" if plan.store_url is None else "the store"
                )
                raise SlurmStepError(
                    f"job {plan.job_id}: {where} has not answered for {lost_after:.0f} s "
                    f"({exc}); the job cannot go on without its store and this node's workers "
                    "were stopped"
                    + (
                        " (with --store-url etcd://... the job outlives its first node)"
                        if plan.store_url is None
                        else ""
                    )
                ) from None
        await asyncio.sleep(0.2)


async def wait_others_left(daemon: Any, timeout: float = LEAVE_WAIT) -> None:
    """On the store host, after the job's end: until every other daemon has left the store
    (a clean stop revokes its lease; a dead one's lapses), so each could read the end."""
    deadline = time.monotonic() + timeout
    mine = daemon.config.node_name
    while time.monotonic() < deadline:
        with contextlib.suppress(StoreError):
            if all(record.name == mine for record in await daemon.cluster.nodes()):
                return
        await asyncio.sleep(0.1)


#: The signals Slurm's ``--signal`` sends ahead of the time limit (the usual ones; its
#: default is SIGUSR1). Their default action would end the embedded daemon.
WARNING_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)


def handle_warnings(daemon: Any, job_id: str) -> None:
    """Take Slurm's warning signals on this task's daemon as a checkpoint request.

    Slurm sends ``--signal``'s signal to every process of the step, the
    workers included (they are the step's, under ``proctrack/linuxproc`` and
    ``proctrack/cgroup`` alike): they get it from Slurm, once, and checkpoint
    on it. The daemon records ``job.checkpoint_requested`` (with the signal),
    which the console shows, instead of dying of the signal's default action.
    """
    loop = asyncio.get_running_loop()
    for sig in WARNING_SIGNALS:
        loop.add_signal_handler(sig, _warned, daemon, job_id, sig)


def _warned(daemon: Any, job_id: str, sig: signal.Signals) -> None:
    message = (
        f"Slurm's warning {sig.name}: the job's end is near; its workers got {sig.name} "
        "from Slurm, a request to checkpoint"
    )
    # Shown on the console by `elasticd run`'s event follower, as a restart is.
    daemon.events.emit(
        job_id, "daemon", EventKind.JOB_CHECKPOINT_REQUESTED, message, signal=int(sig)
    )
