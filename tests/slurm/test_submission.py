"""A batch script's allocation to ``elasticd submit --slurm``'s job fields (pure tables), and
the epilog's look for a job's processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from elasticd.errors import ConfigError
from elasticd.slurm.allocation import submission_from_env
from elasticd.slurm.node import job_processes

BATCH = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "gpu[01-03]", "SLURM_NNODES": "3"}


@pytest.mark.parametrize(
    ("nnodes", "low", "high"),
    [(None, 3, 3), ("2", 2, 2), ("1:3", 1, 3), ("2:3", 2, 3)],
)
def test_the_job_runs_on_the_allocation_with_its_size_unless_given(nnodes, low, high):
    """The allocation's nodes bound the job; --nnodes narrows MIN:MAX within them."""
    got = submission_from_env(BATCH, nnodes)
    assert got.spec_fields() == {
        "slurm_job_id": "42",
        "nodes": ["gpu01", "gpu02", "gpu03"],
        "min_nodes": low,
        "max_nodes": high,
    }


@pytest.mark.parametrize(
    ("environ", "nnodes", "why"),
    [
        ({}, None, "runs inside a Slurm allocation"),
        ({"SLURM_JOB_ID": "42"}, None, "SLURM_JOB_NODELIST are not set"),
        ({**BATCH, "SLURM_JOB_NODELIST": "gpu[3-1]"}, None, "runs backwards"),
        (BATCH, "2:4", "the allocation has 3 nodes"),
        (BATCH, "0", "1 <= MIN <= MAX"),
    ],
)
def test_outside_an_allocation_or_beyond_it_is_refused(environ, nnodes, why):
    """No allocation, a bad node list, or more nodes than it has: a ConfigError saying so."""
    with pytest.raises(ConfigError, match=why):
        submission_from_env(environ, nnodes)


def test_the_processes_of_a_job_are_found_by_its_environment(tmp_path: Path):
    """A child whose environment names the job is found; the job's other ids are not."""
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        env={**os.environ, "ELASTICD_JOB_ID": "slurmjob-found"},
    )
    try:
        assert job_processes({"slurmjob-found"}).get(child.pid) == "slurmjob-found"
        assert child.pid not in job_processes({"slurmjob-other"})
    finally:
        child.kill()
        child.wait(10)
