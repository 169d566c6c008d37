"""Form 2's client side: ``elasticd submit --slurm`` and ``elasticd slurm epilog``.

``submit --slurm`` in a batch script submits to the node's daemon a job
restricted to the allocation's nodes (:func:`elasticd.slurm.allocation.submission_from_env`
decides, purely), recording the Slurm job's id on it. With ``--wait``, the
job ends with the Slurm job: Slurm's SIGTERM (``scancel``, the time limit)
cancels the elasticd job and waits for it, within the job's grace and a
margin (keep ``termination_grace`` under the cluster's ``KillWait``), then
exits 143.

The epilog, which slurmd runs on every node of the job as it ends, asks the
node's daemon to cancel every job whose ``slurm_job_id`` is ``SLURM_JOB_ID``,
waits for each to end, then verifies that no process of theirs is left on
this node (by the ``ELASTICD_JOB_ID`` every worker's environment carries);
it exits 1, naming them, when some remain.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import FrameType
from typing import Any

from elasticd.models import Job

#: What the wait after a cancel allows beyond the job's grace (the daemons' own steps).
CANCEL_MARGIN = 10.0
#: The epilog's bound on the wait for the cancelled jobs, and on that for their processes.
EPILOG_WAIT = 60.0
#: The most of a Slurm job's elasticd jobs the epilog looks through.
EPILOG_JOBS = 1000


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


def slurm_jobs(client: Any, slurm_job_id: str) -> list[Job]:
    """The daemon's jobs recorded as the Slurm job's."""
    page = client.list_jobs(limit=EPILOG_JOBS)
    return [j for j in page.jobs if j.spec.slurm_job_id == slurm_job_id]


def job_processes(job_ids: set[str], proc: Path = Path("/proc")) -> dict[int, str]:
    """This node's processes whose environment names one of ``job_ids`` (pid -> job id)."""
    found: dict[int, str] = {}
    wanted = {f"ELASTICD_JOB_ID={j}".encode(): j for j in job_ids}
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:  # gone, or not ours to read
            continue
        for item in environ:
            if item in wanted:
                found[int(entry.name)] = wanted[item]
                break
    return found


def epilog(client: Any, environ: Mapping[str, str], *, wait: float = EPILOG_WAIT) -> int:
    """Cancel the Slurm job's elasticd jobs, wait, verify none of their processes is left."""
    slurm_job_id = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    if not slurm_job_id:
        print("elasticd slurm epilog: SLURM_JOB_ID is not set", file=sys.stderr)
        return 2
    jobs = slurm_jobs(client, slurm_job_id)
    for job in jobs:
        if not job.state.is_terminal:
            client.cancel(job.id)
    deadline = time.monotonic() + wait
    for job in jobs:
        with contextlib.suppress(TimeoutError):
            client.wait(job.id, timeout=max(0.1, deadline - time.monotonic()))
    ids = {j.id for j in jobs}
    left = job_processes(ids)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = job_processes(ids)
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
