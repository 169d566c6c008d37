"""Form 2's client side: ``elasticd submit --slurm`` and ``elasticd slurm epilog``.

``submit --slurm`` in a batch script submits to the node's daemon a job
restricted to the allocation's nodes (:func:`elasticd.slurm.allocation.submission_from_env`
decides, purely), recording the Slurm job's id on it. With ``--wait``, the
job ends with the Slurm job: Slurm's SIGTERM (``scancel``, the time limit)
cancels the elasticd job and waits for it, within the job's grace and a
margin (keep ``termination_grace`` under the cluster's ``KillWait``), then
exits 143.

The epilog, which slurmd runs on every node of the job as it ends, asks the
node's daemon (every page of its unfinished jobs) to cancel each job whose
``slurm_job_id`` is ``SLURM_JOB_ID`` *and* whose owner is the Slurm job's
user (``SLURM_JOB_USER``): a job's ``slurm_job_id`` is whatever its
submitter wrote, so another user's job naming this Slurm job is not this
job's, and is neither cancelled nor waited for. An admin's job (the daemon's
token) is trusted to name its Slurm job. It waits for each within its
``termination_grace`` and :data:`CANCEL_MARGIN` (at most :data:`EPILOG_MAX`),
then verifies that no process of theirs is left on this node: a process
counts when it is in the job's attempt cgroup (``.../a<n>.<tag>.<job id>``)
made by root, or when it runs as the Slurm job's user (``SLURM_JOB_UID``) and
its cgroup or its environment (``ELASTICD_JOB_ID``) names the job; another
user's process naming the job proves nothing. It exits 1, naming them, when
some remain (Slurm then drains the node).

What the daemon cannot check: that a submitted ``slurm_job_id`` is the
submitter's Slurm job (that needs ``scontrol`` on every submit); the
epilog's owner filter is what makes a false one harmless.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from elasticd.models import Job
from elasticd.states import JobState
from elasticd.supervise.cgroup import cgroup2_mount, own_cgroup, parse_attempt_name

#: What the wait after a cancel allows beyond the job's grace (the daemons' own steps).
CANCEL_MARGIN = 10.0
#: The epilog's bound on the wait for the cancelled jobs and their processes, whatever
#: their grace (keep ``termination_grace`` and this under Slurm's ``PrologEpilogTimeout``).
EPILOG_MAX = 600.0
#: One page of the daemon's job list (the API's most).
PAGE = 1000
#: The states a job can still be cancelled in.
UNFINISHED = tuple(s for s in JobState if not s.is_terminal)


class SlurmStop(Exception):
    """Slurm's SIGTERM reached ``submit --slurm --wait``."""


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """SIGTERM raises :class:`SlurmStop` in the main thread (a command, not the daemon:
    the raise interrupts the blocking follow of the job), while inside."""

    def stop(signum: int, frame: FrameType | None) -> None:
        raise SlurmStop

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def cancel_and_wait(client: Any, job: Job) -> int:
    """Cancel ``job`` and wait for its end within its grace and a margin: 143, as a
    process that SIGTERM ended; 1 if it has not ended by then."""
    print(
        f"elasticd: the Slurm job {job.spec.slurm_job_id} is stopping: cancelling job {job.id}",
        file=sys.stderr,
        flush=True,
    )
    # A second SIGTERM (Slurm's is sent to every process, maybe twice) changes nothing now.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    client.cancel(job.id)
    try:
        final = client.wait(job.id, timeout=job.spec.termination_grace + CANCEL_MARGIN)
    except TimeoutError:
        print(f"elasticd: job {job.id} did not end within its grace", file=sys.stderr)
        return 1
    print(f"elasticd: job {job.id} ended {final.state.value}", file=sys.stderr, flush=True)
    return 143


def unfinished_jobs(client: Any) -> Iterator[Job]:
    """Every job of the daemon not yet ended, page after page (``next_offset``)."""
    offset: int | None = 0
    seen: set[str] = set()
    while offset is not None:
        page = client.list_jobs(state=UNFINISHED, limit=PAGE, offset=offset)
        for job in page.jobs:
            if job.id not in seen:  # a job submitted meanwhile shifts the pages by one
                seen.add(job.id)
                yield job
        offset = page.next_offset


def slurm_jobs(client: Any, slurm_job_id: str) -> list[Job]:
    """The daemon's unfinished jobs that say they are the Slurm job's (anyone may say so);
    a replica group is its parent's to cancel, and a cancel of it is refused, so it is
    left out (its parent, with the same Slurm job, is in)."""
    return [
        j
        for j in unfinished_jobs(client)
        if j.spec.slurm_job_id == slurm_job_id and j.group_of is None
    ]


def is_own_submission(job: Job, spec: Mapping[str, Any]) -> bool:
    """Whether ``job`` is the one ``spec`` (with its client-chosen id) submitted (pure): the
    same id, Slurm job, program and arguments. Another owner's job shows its arguments as
    ``<hidden>``; and the daemon refuses to cancel another's job for anyone but an admin."""
    return (
        job.id == spec.get("id")
        and job.spec.slurm_job_id == spec.get("slurm_job_id")
        and job.spec.entrypoint == spec.get("entrypoint")
        and job.spec.args == list(spec.get("args", []))
    )


def own_submission(client: Any, spec: Mapping[str, Any]) -> Job | None:
    """The job that ``spec`` submitted, if its POST went through before a stop, and unfinished."""
    from elasticd.client import ClientError

    try:
        job = client.get(spec["id"])
    except ClientError as exc:
        if exc.status == 404:
            return None
        raise
    return job if is_own_submission(job, spec) and not job.state.is_terminal else None


def owned_by(job: Job, user: str | None) -> bool:
    """Whether ``job`` is the Slurm job's user's (pure): its owner proved to be that Unix
    user (``JobOwner.unix_user``), or it is an admin's (trusted to name its Slurm job)."""
    if job.owner is None or job.owner.admin:
        return True
    return user is not None and job.owner.unix_user == user


def epilog_wait(jobs: Iterable[Job]) -> float:
    """How long the epilog waits for ``jobs`` and their processes: the longest grace and
    the margin, at most :data:`EPILOG_MAX` (pure)."""
    graces = [j.spec.termination_grace for j in jobs]
    return min(EPILOG_MAX, max(graces, default=0.0) + CANCEL_MARGIN)


@dataclass(frozen=True)
class ProcessFacts:
    """What the epilog reads of one process (``/proc/PID``)."""

    uid: int | None
    #: Its cgroup v2 path (``0::`` line), and the uid owning that cgroup's folder.
    cgroup: str | None
    cgroup_owner: int | None
    #: The ``ELASTICD_JOB_ID`` of its environment (None: none, or unreadable).
    env_job: str | None


def process_job(facts: ProcessFacts, job_ids: set[str], slurm_uid: int | None) -> str | None:
    """Which of ``job_ids`` a process is left of, if any (pure).

    In a job's attempt cgroup made by root (only the daemon makes them there):
    that job's, whatever its uid. Otherwise only a process of the Slurm job's
    user counts, named by its cgroup or its environment: anyone can set an
    environment variable, and make a cgroup of that name where it is
    delegated one.
    """
    attempt = None
    if facts.cgroup is not None:
        parts = facts.cgroup.rstrip("/").split("/")
        name = parse_attempt_name(parts[-1])
        if name is not None and len(parts) > 1 and parts[-2].startswith("elasticd."):
            attempt = name.job_id if name.job_id in job_ids else None
    if attempt is not None and facts.cgroup_owner == 0:
        return attempt
    if slurm_uid is None or facts.uid != slurm_uid:
        return None
    if attempt is not None:
        return attempt
    return facts.env_job if facts.env_job in job_ids else None


def read_process(entry: Path, mount: Path | None) -> ProcessFacts:
    """A process's :class:`ProcessFacts` (what cannot be read is None: gone, or not ours)."""
    uid = cgroup = cgroup_owner = env_job = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in (entry / "status").read_text().splitlines():
            if line.startswith("Uid:"):
                uid = int(line.split()[1])  # the real uid
    with contextlib.suppress(OSError):
        cgroup = own_cgroup((entry / "cgroup").read_text())
    if cgroup is not None and mount is not None:
        with contextlib.suppress(OSError):
            cgroup_owner = (mount / cgroup.lstrip("/")).stat().st_uid
    with contextlib.suppress(OSError):
        for item in (entry / "environ").read_bytes().split(b"\0"):
            if item.startswith(b"ELASTICD_JOB_ID="):
                env_job = item.partition(b"=")[2].decode(errors="replace")
                break
    return ProcessFacts(uid, cgroup, cgroup_owner, env_job)


def job_processes(
    job_ids: set[str], slurm_uid: int | None, proc: Path = Path("/proc")
) -> dict[int, str]:
    """This node's processes left of one of ``job_ids`` (pid -> job id), :func:`process_job`."""
    if not job_ids:
        return {}
    mount = None
    with contextlib.suppress(OSError):
        found_mount = cgroup2_mount((proc / "self" / "mountinfo").read_text())
        mount = Path(found_mount) if found_mount is not None else None
    found: dict[int, str] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        job = process_job(read_process(entry, mount), job_ids, slurm_uid)
        if job is not None:
            found[int(entry.name)] = job
    return found


def _slurm_uid(environ: Mapping[str, str]) -> int | None:
    value = environ.get("SLURM_JOB_UID", "").strip()
    return int(value) if value.isdigit() else None


def epilog(client: Any, environ: Mapping[str, str], *, proc: Path = Path("/proc")) -> int:
    """Cancel the Slurm job's user's elasticd jobs of the Slurm job, wait within their
    grace, verify none of their processes is left."""
    slurm_job_id = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    if not slurm_job_id:
        print("elasticd slurm epilog: SLURM_JOB_ID is not set", file=sys.stderr)
        return 2
    user = environ.get("SLURM_JOB_USER") or None
    claimed = slurm_jobs(client, slurm_job_id)
    jobs = [j for j in claimed if owned_by(j, user)]
    for job in claimed:
        if job not in jobs:
            owner = job.owner.name if job.owner is not None else "?"
            print(
                f"elasticd slurm epilog: job {job.id} names the Slurm job {slurm_job_id} but "
                f"is {owner}'s, not {user or 'its user'}'s: left alone",
                file=sys.stderr,
                flush=True,
            )
    for job in jobs:
        client.cancel(job.id)
    deadline = time.monotonic() + epilog_wait(jobs)
    for job in jobs:
        with contextlib.suppress(TimeoutError):
            client.wait(job.id, timeout=max(0.1, deadline - time.monotonic()))
    ids = {j.id for j in jobs}
    uid = _slurm_uid(environ)
    left = job_processes(ids, uid, proc)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = job_processes(ids, uid, proc)
    if left:
        listed = ", ".join(f"{pid} ({job})" for pid, job in sorted(left.items()))
        print(
            f"elasticd slurm epilog: processes of the Slurm job {slurm_job_id}'s elasticd "
            f"jobs are left on this node: {listed}",
            file=sys.stderr,
            flush=True,
        )
        return 1
    return 0
