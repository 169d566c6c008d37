"""The epilog's choice of jobs and processes (pure tables) and its run over a paging client:
only the Slurm job's user's jobs are cancelled, every page is read, the wait is the grace's."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest

from elasticd.models import Job, JobList, JobOwner, JobSpec
from elasticd.slurm.node import (
    CANCEL_MARGIN,
    EPILOG_MAX,
    UNFINISHED,
    ProcessFacts,
    epilog,
    epilog_wait,
    is_own_submission,
    job_processes,
    owned_by,
    process_job,
    slurm_jobs,
)
from elasticd.states import JobState

ALICE = JobOwner(name="alice", local=True, unix_user="alice")
MALLORY = JobOwner(name="mallory", local=True, unix_user="mallory")
ADMIN = JobOwner(name="admin", admin=True)


def job(
    job_id: str,
    owner: JobOwner | None = ALICE,
    slurm: str | None = "42",
    grace: float = 30.0,
    state: JobState = JobState.RUNNING,
    args: list[str] | None = None,
) -> Job:
    spec = JobSpec(
        id=job_id, entrypoint="python", args=args or [], slurm_job_id=slurm,
        termination_grace=grace,
    )  # fmt: skip
    return Job(id=job_id, spec=spec, state=state, max_restarts=3, created_at=0.0, owner=owner)


@pytest.mark.parametrize(
    ("owner", "user", "want"),
    [
        (ALICE, "alice", True),  # the Slurm job's user's own job
        (MALLORY, "alice", False),  # another user naming alice's Slurm job
        (JobOwner(name="alice", local=True), "alice", False),  # runs as someone else
        (ALICE, None, False),  # slurmd gave no user: only an admin's job is trusted
        (ADMIN, "alice", True),  # the operator's token
        (None, "alice", True),  # from before identities: the admin's
    ],
)
def test_only_the_slurm_users_jobs_are_the_slurm_jobs(owner, user, want):
    """A slurm_job_id is the submitter's word: the owner decides whose Slurm job it is."""
    assert owned_by(job("j", owner), user) is want


def test_the_wait_is_the_longest_grace_and_a_margin_bounded():
    """The epilog waits as long as the jobs' own grace allows, never past EPILOG_MAX."""
    assert epilog_wait([]) == CANCEL_MARGIN
    assert epilog_wait([job("a", grace=5), job("b", grace=120)]) == 120 + CANCEL_MARGIN
    assert epilog_wait([job("a", grace=3600)]) == EPILOG_MAX


CG = "/system.slice/elasticd.service/elasticd.n1.0123456789ab/a0.deadbeef.j1"
USER_CG = "/user.slice/user-1001.slice/user@1001.service/elasticd.x.y/a0.deadbeef.j1"


@pytest.mark.parametrize(
    ("facts", "want"),
    [
        (ProcessFacts(1000, CG, 0, None), "j1"),  # in j1's root-made cgroup: j1's
        (ProcessFacts(61200, CG, 0, None), "j1"),  # a dynamic uid, in the cgroup
        (ProcessFacts(1000, "/user.slice", None, "j1"), "j1"),  # alice's, env names j1
        (ProcessFacts(1001, "/user.slice", None, "j1"), None),  # another's env names j1
        (ProcessFacts(1001, USER_CG, 1001, None), None),  # a look-alike cgroup of another
        (ProcessFacts(1000, USER_CG, 1000, None), "j1"),  # alice's own, named by cgroup
        (ProcessFacts(1000, CG.replace("j1", "j9"), 0, "j9"), None),  # not one of the jobs
        (ProcessFacts(1000, "/a0.deadbeef.j1", 0, None), None),  # not under an elasticd subtree
        (ProcessFacts(None, None, None, None), None),  # gone meanwhile
    ],
)
def test_a_process_counts_only_by_cgroup_or_as_the_slurm_user(facts, want):
    """Only the daemon's cgroup or the Slurm user's own process names a job's leftover."""
    assert process_job(facts, {"j1", "j2"}, slurm_uid=1000) == want


def test_a_real_process_of_this_user_naming_the_job_is_found():
    """A child whose environment names the job counts as this uid's; not for another uid."""
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        env={**os.environ, "ELASTICD_JOB_ID": "slurmjob-found"},
    )
    try:
        assert job_processes({"slurmjob-found"}, os.getuid()).get(child.pid) == "slurmjob-found"
        assert child.pid not in job_processes({"slurmjob-other"}, os.getuid())
        assert child.pid not in job_processes({"slurmjob-found"}, os.getuid() + 1)
    finally:
        child.kill()
        child.wait(10)


class PagingClient:
    """The daemon's job list as the API pages it (newest first, ``next_offset``), and the
    cancels and waits asked for."""

    def __init__(self, jobs: list[Job], page: int) -> None:
        self.jobs, self.page = jobs, page
        self.cancelled: list[str] = []
        self.waits: list[tuple[str, float]] = []
        self.states: list[Any] = []

    def list_jobs(self, state: Any = None, limit: int = 100, offset: int = 0) -> JobList:
        self.states.append(state)
        wanted = [j for j in self.jobs if state is None or j.state in state]
        limit = min(limit, self.page)
        more = offset + limit < len(wanted)
        return JobList(
            jobs=wanted[offset : offset + limit],
            total=len(wanted),
            next_offset=offset + limit if more else None,
        )

    def cancel(self, job_id: str) -> Job:
        self.cancelled.append(job_id)
        return next(j for j in self.jobs if j.id == job_id)

    def wait(self, job_id: str, timeout: float) -> Job:
        self.waits.append((job_id, timeout))
        return next(j for j in self.jobs if j.id == job_id)


def test_every_page_of_unfinished_jobs_is_read():
    """A Slurm job's elasticd job past the first page is found; ended jobs are not asked for."""
    jobs = [job(f"other-{i}", slurm="7") for i in range(25)] + [job("mine")]
    client = PagingClient(jobs, page=10)
    assert [j.id for j in slurm_jobs(client, "42")] == ["mine"]
    assert all(set(s) == set(UNFINISHED) for s in client.states)
    assert len(client.states) == 3


def test_the_epilog_cancels_the_slurm_users_jobs_only(tmp_path):
    """alice's job past a page is cancelled and waited for with its grace; mallory's job
    naming alice's Slurm job, and an ended one, are left alone."""
    jobs = [
        job("planted", MALLORY, grace=3600),
        *(job(f"filler-{i}", slurm="7") for i in range(5)),
        job("done", state=JobState.SUCCEEDED),
        job("mine", grace=45),
    ]
    client = PagingClient(jobs, page=2)
    environ = {"SLURM_JOB_ID": "42", "SLURM_JOB_USER": "alice", "SLURM_JOB_UID": "1000"}
    (tmp_path / "self").mkdir()  # an empty /proc: nothing is left
    assert epilog(client, environ, proc=tmp_path) == 0
    assert client.cancelled == ["mine"]
    assert [w[0] for w in client.waits] == ["mine"]
    assert 45 < client.waits[0][1] <= 45 + CANCEL_MARGIN


@pytest.mark.parametrize(
    ("seen", "want"),
    [
        (job("s-1", args=["train.py"]), True),
        (job("s-2", args=["train.py"]), False),  # another id
        (job("s-1", slurm="43", args=["train.py"]), False),
        (job("s-1", MALLORY, args=["<hidden>"]), False),  # another's, as it is shown to us
    ],
)
def test_submit_knows_its_own_job_by_its_id_and_spec(seen, want):
    """A stop during the POST cancels only the job of the id it chose and its own spec."""
    spec = {"id": "s-1", "slurm_job_id": "42", "entrypoint": "python", "args": ["train.py"]}
    assert is_own_submission(seen, spec) is want
