"""A batch script's allocation to ``elasticd submit --slurm``'s job fields (pure tables)."""

from __future__ import annotations

import pytest

from elasticd.errors import ConfigError
from elasticd.slurm.allocation import submission_from_env

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
