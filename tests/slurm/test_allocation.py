"""Slurm's environment to a task's part in ``elasticd run --nnodes`` (pure tables)."""

from __future__ import annotations

import pytest

from elasticd.errors import ConfigError
from elasticd.slurm.allocation import (
    PORT_BASE,
    PORT_SPAN,
    SlurmTask,
    expand_hostlist,
    parse_nnodes,
    plan_allocation_run,
    store_environ,
    task_from_env,
)


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("n1", ["n1"]),
        ("n1,n2", ["n1", "n2"]),
        ("n[1-3]", ["n1", "n2", "n3"]),
        ("n[1-3,5]", ["n1", "n2", "n3", "n5"]),
        ("n[1-2],gpu01", ["n1", "n2", "gpu01"]),
        ("gpu[08-10]", ["gpu08", "gpu09", "gpu10"]),
        ("gpu[8-10]", ["gpu8", "gpu9", "gpu10"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("a[1]-ib", ["a1-ib"]),
        ("x[3],y[1-2]z", ["x3", "y1z", "y2z"]),
        (" n[1-2] ", ["n1", "n2"]),
    ],
)
def test_expand_hostlist(text, names):
    """Slurm's hostlist syntax expands in order, keeping a written zero padding."""
    assert expand_hostlist(text) == names


@pytest.mark.parametrize(
    "text", ["n[1-3", "n1-3]", "n[3-1]", "n[a-b]", "n[[1]]", "n1,,n2", "", "n[1-1000000]"]
)
def test_expand_hostlist_refuses_what_slurm_refuses(text):
    """An unclosed or stray bracket, a backwards range, a non-number, an empty name, or a
    list past the bound is a ValueError."""
    with pytest.raises(ValueError, match="hostlist"):
        expand_hostlist(text)


STEP = {
    "SLURM_JOB_ID": "42",
    "SLURM_STEP_ID": "0",
    "SLURM_JOB_NODELIST": "n[1-3]",
    "SLURM_NODEID": "1",
    "SLURM_NNODES": "3",
}


@pytest.mark.parametrize(
    ("environ", "task"),
    [
        ({}, None),
        ({"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "n1"}, None),  # a batch script, no step
        (STEP, SlurmTask("42", "0", ("n1", "n2", "n3"), 1)),
        (
            {
                **STEP,
                "SLURM_STEP_NODELIST": "n[2-3]",
                "SLURM_STEP_NUM_NODES": "2",
                "SLURM_NODEID": "0",
            },
            SlurmTask("42", "0", ("n2", "n3"), 0),
        ),
        (
            {
                "SLURM_JOBID": "7",
                "SLURM_STEPID": "3",
                "SLURM_JOB_NODELIST": "a",
                "SLURM_NODEID": "0",
            },
            SlurmTask("7", "3", ("a",), 0),
        ),
    ],
)
def test_task_from_env(environ, task):
    """A step's task from its variables (the step's own node list first); none outside a step."""
    assert task_from_env(environ) == task


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"SLURM_JOB_NODELIST": ""}, "SLURM_JOB_NODELIST is not set"),
        ({"SLURM_JOB_NODELIST": "n[1-"}, "SLURM_JOB_NODELIST: hostlist"),
        ({"SLURM_NODEID": "x"}, "SLURM_NODEID"),
        ({"SLURM_NODEID": "3"}, "SLURM_NODEID=3 is not one of the 3"),
        ({"SLURM_NNODES": "4"}, "SLURM_NNODES=4"),
    ],
)
def test_task_from_env_refuses_an_inconsistent_step(changes, message):
    """A step whose variables disagree is a ConfigError naming the variable."""
    with pytest.raises(ConfigError, match=message):
        task_from_env({**STEP, **changes})


@pytest.mark.parametrize(
    ("text", "pair"), [("3", (3, 3)), ("2:3", (2, 3)), (" 1:4 ", (1, 4)), ("2:", (2, 2))]
)
def test_parse_nnodes(text, pair):
    """torchrun's N or MIN:MAX."""
    assert parse_nnodes(text) == pair


@pytest.mark.parametrize("text", ["0", "3:2", "a", "1:b", "-1:2", ""])
def test_parse_nnodes_refuses(text):
    with pytest.raises(ConfigError, match="--nnodes"):
        parse_nnodes(text)


NODES = ("n1", "n2", "n3")


@pytest.mark.parametrize(
    ("node_id", "store_url", "port", "hosts", "submits"),
    [
        (0, None, 0, True, True),  # the first node hosts the store and submits
        (2, None, 0, False, False),
        (0, "etcd://10.0.0.9:2379", 0, False, True),  # an etcd given: nobody hosts one
        (1, "etcd://10.0.0.9:2379", 0, False, False),
        (0, None, 31000, True, True),
    ],
)
def test_plan_allocation_run(node_id, store_url, port, hosts, submits):
    """Who hosts the store and who submits; every task derives the same id, store host and
    port (the one given, else one from the job and step ids)."""
    plan = plan_allocation_run(
        SlurmTask("42", "0", NODES, node_id), "2:3", store_url=store_url, port=port
    )
    assert (plan.hosts_store, plan.submits) == (hosts, submits)
    assert plan.node_name == NODES[node_id]
    assert (plan.job_id, plan.store_host, plan.store_url) == ("slurm-42.0", "n1", store_url)
    assert (plan.min_nodes, plan.max_nodes) == (2, 3)
    others = plan_allocation_run(SlurmTask("42", "0", NODES, 1), "2:3", port=port)
    assert others.store_port == plan.store_port
    if port:
        assert plan.store_port == port
    else:
        assert PORT_BASE <= plan.store_port < PORT_BASE + PORT_SPAN


def test_two_steps_of_a_job_get_their_own_ids():
    """Another step of the job (or another job) is another elasticd job, usually on
    another port."""
    a = plan_allocation_run(SlurmTask("42", "0", NODES, 0), "3")
    b = plan_allocation_run(SlurmTask("42", "1", NODES, 0), "3")
    assert a.job_id != b.job_id
    assert a.store_port != b.store_port


def test_a_job_needing_more_nodes_than_the_step_has_is_refused():
    """MIN above the step's node count can never form: refused at once, saying so."""
    with pytest.raises(ConfigError, match="needs 4 nodes but the step has 3"):
        plan_allocation_run(SlurmTask("42", "0", NODES, 0), "4:5")


def test_spares_beyond_max_still_take_part():
    """Nodes beyond MAX are spares: the job's bounds stay MIN:MAX whatever the step's size."""
    plan = plan_allocation_run(SlurmTask("42", "0", (*NODES, "n4"), 3), "2:3")
    assert (plan.min_nodes, plan.max_nodes, plan.submits) == (2, 3, False)


def test_store_environ_keeps_only_the_store_settings():
    """A step's daemons read the store's credentials from ELASTICD_STORE_*, nothing else of
    the user's ELASTICD_* (their own daemon's settings) nor anything else."""
    environ = {
        "ELASTICD_STORE_USERNAME": "job",
        "ELASTICD_STORE_PASSWORD_FILE": "/home/u/.etcd-pw",
        "ELASTICD_ALLOW_INSECURE_STORE": "true",
        "ELASTICD_PORT": "7070",
        "ELASTICD_STORE_URL": "http://elsewhere:7070",
        "PATH": "/usr/bin",
    }
    assert store_environ(environ) == {
        "ELASTICD_STORE_USERNAME": "job",
        "ELASTICD_STORE_PASSWORD_FILE": "/home/u/.etcd-pw",
        "ELASTICD_ALLOW_INSECURE_STORE": "true",
    }
