"""Rank assignment across nodes and roles, and the exact torchrun worker environment."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elasticd.rendezvous.ranks import NodeSlot, assign_ranks
from elasticd.supervise.env import (
    AttemptInfo,
    ReplicaGroup,
    job_base_env,
    worker_args,
    worker_env,
)

TORCHRUN_VARS = {
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_ERROR_FILE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
}


def test_ranks_two_roles():
    """Global ranks run node by node; role ranks count within each role."""
    nodes = [NodeSlot(0, "trainer", 2), NodeSlot(1, "ps", 1), NodeSlot(2, "trainer", 2)]
    third = assign_ranks(nodes, 2)
    assert [w.rank for w in third] == [3, 4]
    assert [w.role_rank for w in third] == [2, 3]
    assert {w.world_size for w in third} == {5}
    assert {w.role_world_size for w in third} == {4}
    ps = assign_ranks(nodes, 1)
    assert (ps[0].rank, ps[0].role_rank, ps[0].role_world_size) == (2, 0, 1)


@given(st.lists(st.tuples(st.sampled_from("ab"), st.integers(1, 4)), min_size=1, max_size=6))
def test_ranks_are_unique_and_contiguous(spec):
    """For any mix of nodes and roles, global ranks are exactly 0..world-1, role ranks too."""
    nodes = [NodeSlot(i, role, n) for i, (role, n) in enumerate(spec)]
    workers = [w for i in range(len(nodes)) for w in assign_ranks(nodes, i)]
    assert sorted(w.rank for w in workers) == list(range(len(workers)))
    for role in "ab":
        mine = sorted(w.role_rank for w in workers if w.role_name == role)
        assert mine == list(range(len(mine)))


def _env(base=None, job=None, nproc=2):
    ranks = assign_ranks([NodeSlot(0, "default", nproc)], 0)[1 if nproc > 1 else 0]
    info = AttemptInfo(
        job_id="j1",
        run_id="j1",
        master_addr="127.0.0.1",
        master_port=29500,
        restart_count=2,
        max_restarts=3,
        daemon_url="http://127.0.0.1:7070",
        token_file="/etc/elasticd/token",
    )
    return worker_env(base or {}, job or {}, ranks, info, error_file="/logs/e.json")


def test_env_has_the_torchrun_contract():
    """Every variable torchrun gives a worker is present with torchrun's meaning."""
    env = _env()
    assert env.keys() >= TORCHRUN_VARS
    assert env["RANK"] == "1" and env["LOCAL_RANK"] == "1" and env["WORLD_SIZE"] == "2"
    assert env["TORCHELASTIC_RESTART_COUNT"] == "2"
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "False"
    assert env["OMP_NUM_THREADS"] == "1"
    assert env["ELASTICD_TOKEN_FILE"] == "/etc/elasticd/token"


def test_env_precedence_and_withheld_variables():
    """Inherited OMP/NCCL settings are kept, contract vars win, NOTIFY_SOCKET and tokens never leak."""
    env = _env(
        base={
            "NOTIFY_SOCKET": "/run/x",
            "ELASTICD_TOKEN": "secret",
            "OMP_NUM_THREADS": "8",
            "PATH": "/bin",
        },
        job={"RANK": "99", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "NOTIFY_SOCKET": "/y"},
    )
    assert "NOTIFY_SOCKET" not in env and "ELASTICD_TOKEN" not in env
    assert "secret" not in env.values()
    assert env["RANK"] == "1" and env["OMP_NUM_THREADS"] == "8" and env["PATH"] == "/bin"
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"


def test_torchrun_launcher_defaults_are_set_unless_the_job_sets_them():
    """python -u's effect and the signals torchrun's launcher exports; the job's values win."""
    env = _env()
    assert env["PYTHONUNBUFFERED"] == "1"
    assert env["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    env = _env(job={"PYTHONUNBUFFERED": "", "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGUSR2"})
    assert env["PYTHONUNBUFFERED"] == "" and env["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGUSR2"
    assert worker_args(["--local_rank=${local_rank}", "${local_rank}x", "n"], 3) == [
        "--local_rank=3",
        "3x",
        "n",
    ]


def test_single_worker_gets_no_omp_default():
    """OMP_NUM_THREADS is only defaulted when a node runs several workers."""
    assert "OMP_NUM_THREADS" not in _env(nproc=1)


def _job(restarts: int, max_restarts: int, pending_round: int | None, participants=("a",)):
    from elasticd.models import Job, JobSpec, PendingFailure, RootCause
    from elasticd.states import JobState

    pending = None
    if pending_round is not None:
        pending = PendingFailure(
            round=pending_round, participants=list(participants), error=RootCause(message="boom")
        )
    return Job(
        id="j",
        spec=JobSpec(entrypoint="x", max_restarts=max_restarts),
        state=JobState.RESTARTING,
        restart_count=restarts,
        max_restarts=max_restarts,
        created_at=0.0,
        pending_failure=pending,
    )


def _round(n: int, participants=("a",)):
    from elasticd.rendezvous import RoundInfo

    return RoundInfo(
        round=n,
        group_rank=0,
        group_world_size=len(participants),
        nodes=[],
        master_addr="h",
        master_port=1,
        participants={p: 0 for p in participants},
    )


def test_restart_policy_is_torchruns():
    """A failure restarts while restarts remain; the budget spent means FAILED."""
    from elasticd.agent.edits import settle_failure
    from elasticd.states import JobState

    assert settle_failure(_round(1))(_job(0, 1, 0)) == {
        "pending_failure": None,
        "charged_round": 0,
        "restart_count": 1,
    }
    spent = settle_failure(_round(2))(_job(1, 1, 1))
    assert spent["state"] is JobState.FAILED and "budget spent" in spent["reason"]
    assert settle_failure(_round(1))(_job(0, 0, 0))["state"] is JobState.FAILED
    assert settle_failure(_round(1))(_job(0, 3, None)) == {}  # nothing pending: nothing spent


def test_a_lost_participant_is_a_free_membership_change():
    """When a node of the failed round did not come back, the failure costs no restart."""
    from elasticd.agent.edits import settle_failure

    edit = settle_failure(_round(1, ("a",)))(_job(0, 0, 0, participants=("a", "b")))
    assert edit == {"pending_failure": None, "charged_round": 0}


DAEMON_ENV = {
    "PATH": "/usr/bin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "TZ": "UTC",
    "AWS_SECRET_ACCESS_KEY": "k",
    "LD_PRELOAD": "/opt/x.so",
    "PYTHONPATH": "/srv/daemon",
    "NOTIFY_SOCKET": "/run/systemd/notify",
    "ELASTICD_TOKEN": "t",
}


@pytest.mark.parametrize(
    ("inherit", "expected"),
    [
        (False, {"PATH", "HOME", "LANG", "LC_ALL", "TZ"}),
        (True, set(DAEMON_ENV) - {"NOTIFY_SOCKET", "ELASTICD_TOKEN"}),
    ],
    ids=["served: allowlist", "embedded: the caller's, less the withheld"],
)
def test_a_jobs_base_environment_is_the_allowlist_unless_the_daemon_is_embedded(inherit, expected):
    """A served daemon passes only neutral names (PATH, locale, TZ) of its environment to a job;
    an embedded one passes all of it but the withheld names, as torchrun does."""
    assert set(job_base_env(DAEMON_ENV, inherit=inherit)) == expected


def test_a_served_daemon_passes_on_the_node_settings_it_is_told_to() -> None:
    """job_env_passthrough (default NCCL_*, GLOO_*, UCX_*, FI_*): the node's network settings
    reach the job; a name no pattern matches (a secret) does not."""
    from elasticd.config import load_config

    patterns = load_config({}, environ={}).job_env_passthrough
    daemon = {"NCCL_SOCKET_IFNAME": "eth1", "GLOO_SOCKET_IFNAME": "eth1", "NCCL_X": "1"}
    daemon |= {"AWS_SECRET_ACCESS_KEY": "s", "PATH": "/usr/bin", "ELASTICD_TOKEN": "t"}
    got = job_base_env(daemon, inherit=False, passthrough=patterns)
    assert got == {
        k: daemon[k] for k in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_X", "PATH")
    }
    assert job_base_env(daemon, inherit=False, passthrough=["AWS_*"])["AWS_SECRET_ACCESS_KEY"]


def test_a_restarted_attempt_is_told_the_jobs_last_checkpoint():
    """ELASTICD_CHECKPOINT_STEP/_PATH: the daemon's value wins; the daemon's own environment
    never leaks one; a job's env may seed a first attempt that has none from the daemon."""
    from dataclasses import replace

    ranks = assign_ranks([NodeSlot(0, "default", 1)], 0)[0]
    info = AttemptInfo("j1", "j1", "127.0.0.1", 29500, 1, 3, "http://127.0.0.1:7070")

    def env(info, base=None, job=None):
        return worker_env(base or {}, job or {}, ranks, info, error_file="/e.json")

    stale = {"ELASTICD_CHECKPOINT_STEP": "1", "ELASTICD_CHECKPOINT_PATH": "/old"}
    assert "ELASTICD_CHECKPOINT_STEP" not in env(info, base=stale)
    assert env(info, job={"ELASTICD_CHECKPOINT_STEP": "7"})["ELASTICD_CHECKPOINT_STEP"] == "7"
    told = env(replace(info, checkpoint_step=40, checkpoint_path="/ck/40"), job=stale)
    assert told["ELASTICD_CHECKPOINT_STEP"] == "40" and told["ELASTICD_CHECKPOINT_PATH"] == "/ck/40"
    no_path = env(replace(info, checkpoint_step=0), base=stale)
    assert no_path["ELASTICD_CHECKPOINT_STEP"] == "0" and "ELASTICD_CHECKPOINT_PATH" not in no_path


@pytest.mark.parametrize(
    ("replica", "job_env", "expected"),
    [
        # an ordinary job: none of torchft's variables is set, the job's own pass
        (
            None,
            {},
            {"REPLICA_GROUP_ID": None, "NUM_REPLICA_GROUPS": None, "TORCHFT_LIGHTHOUSE": None},
        ),
        (None, {"TORCHFT_LIGHTHOUSE": "http://own:1"}, {"TORCHFT_LIGHTHOUSE": "http://own:1"}),
        # a group with this node's Lighthouse: every variable, the daemon's winning
        (
            ReplicaGroup(2, 3, "http://127.0.0.1:29510"),
            {"REPLICA_GROUP_ID": "9", "TORCHFT_LIGHTHOUSE": "http://own:1"},
            {
                "REPLICA_GROUP_ID": "2",
                "NUM_REPLICA_GROUPS": "3",
                "TORCHFT_LIGHTHOUSE": "http://127.0.0.1:29510",
            },
        ),
        # no Lighthouse here: the group and count are set, the address is the job's (or none)
        (
            ReplicaGroup(0, 1),
            {},
            {"REPLICA_GROUP_ID": "0", "NUM_REPLICA_GROUPS": "1", "TORCHFT_LIGHTHOUSE": None},
        ),
        (
            ReplicaGroup(0, 2),
            {"TORCHFT_LIGHTHOUSE": "http://own:1"},
            {"TORCHFT_LIGHTHOUSE": "http://own:1"},
        ),
    ],
)
def test_a_replica_groups_workers_get_torchfts_variables(replica, job_env, expected):
    """A replica group's workers get REPLICA_GROUP_ID, NUM_REPLICA_GROUPS and, where the
    node has a Lighthouse, TORCHFT_LIGHTHOUSE, beside torchrun's contract; the Manager's
    own ports are left alone."""
    (ranks,) = assign_ranks([NodeSlot(0, "default", 1)], 0)
    info = AttemptInfo("j.g2", "j.g2", "127.0.0.1", 29500, 0, 3, "http://x:1", replica=replica)
    env = worker_env({}, job_env, ranks, info, error_file="/logs/e.json")
    assert {name: env.get(name) for name in expected} == expected
    assert env.keys() >= TORCHRUN_VARS and "TORCHFT_MANAGER_PORT" not in env
