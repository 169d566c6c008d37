"""The torchrun backend's pure decisions: endpoint, settings, num_nodes_waiting, the run's record."""

from __future__ import annotations

import subprocess
import sys

import pytest

from elasticd.config import parse_labels
from elasticd.keys import keys_of_job, torchrun_store_prefix
from elasticd.models import Job, JobSpec
from elasticd.rendezvous import Change
from elasticd.states import JobState
from elasticd.torchrun_backend import (
    NEVER_SCHEDULED,
    RunStep,
    backend_config,
    endpoint_url,
    node_name,
    run_edit,
    run_spec,
    waiting_nodes,
)


@pytest.mark.parametrize(
    ("endpoint", "url"),
    [
        ("127.0.0.1:7070", "http://127.0.0.1:7070"),
        ("node1", "http://node1:7070"),
        ("node1:8080", "http://node1:8080"),
        ("[::1]:7071", "http://[::1]:7071"),
        ("http://node1:7070/", "http://node1:7070"),
        ("https://node1:443", "https://node1:443"),
    ],
)
def test_an_endpoint_becomes_a_daemon_url(endpoint: str, url: str) -> None:
    assert endpoint_url(endpoint) == url


@pytest.mark.parametrize("endpoint", ["", "node1:notaport", "ftp://node1", "node1:7070/path"])
def test_a_malformed_endpoint_is_refused(endpoint: str) -> None:
    with pytest.raises(ValueError, match="rdzv-endpoint"):
        endpoint_url(endpoint)


def config(conf: dict[str, object] | None = None, env: dict[str, str] | None = None, **kw: object):
    args: dict[str, object] = {
        "endpoint": "127.0.0.1:7070",
        "run_id": "job1",
        "min_nodes": 2,
        "max_nodes": 4,
        "local_addr": None,
        "conf": conf or {},
        "environ": env or {},
        **kw,
    }
    return backend_config(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("conf", "env", "expect"),
    [
        # torch's defaults for the rendezvous options; the daemon's lease TTL
        (
            {},
            {},
            {"join": 600.0, "last_call": 30.0, "token": None, "ttl": 3.0},
        ),
        (
            {"join_timeout": "20", "last_call_timeout": "1", "lease_ttl": "2"},
            {},
            {"join": 20.0, "last_call": 1.0, "token": None, "ttl": 2.0},
        ),
        # the token file: --rdzv-conf first, then ELASTICD_TOKEN_FILE
        ({}, {"ELASTICD_TOKEN_FILE": "/e"}, {"token": "/e"}),
        ({"token_file": "/c"}, {"ELASTICD_TOKEN_FILE": "/e"}, {"token": "/c"}),
    ],
)
def test_settings_come_from_rdzv_conf(
    conf: dict[str, object], env: dict[str, str], expect: dict[str, object]
) -> None:
    c = config(conf, env)
    got = {
        "join": c.settings.join_timeout,
        "last_call": c.settings.last_call_timeout,
        "token": c.token_file,
        "ttl": c.lease_ttl,
    }
    assert {k: got[k] for k in expect} == expect
    assert (c.settings.min_nodes, c.settings.max_nodes, c.url) == (2, 4, "http://127.0.0.1:7070")


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"run_id": "a/b"}, "rdzv-id"),
        ({"run_id": ""}, "rdzv-id"),
        ({"conf": {"join_timeout": "soon"}}, "join_timeout"),
        ({"conf": {"lease_ttl": "0"}}, "lease_ttl"),
        ({"min_nodes": 3, "max_nodes": 2}, "max_nodes"),
    ],
)
def test_bad_parameters_are_refused_with_the_option_named(
    kw: dict[str, object], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        config(**kw)


@pytest.mark.parametrize(
    ("change", "waiting"),
    [
        (None, 0),
        (Change.CLOSED, 0),
        (Change.ARRIVAL, 1),
        (Change.NEW_ROUND, 1),
        (Change.LOSS, 1),
        (Change.FENCED, 1),
    ],
)
def test_every_reason_to_reform_but_closing_makes_torch_reform(
    change: Change | None, waiting: int
) -> None:
    assert waiting_nodes(change) == waiting


def test_node_names_are_valid_store_key_segments() -> None:
    assert node_name("gpu-01.example.com", 42, "abc123") == "gpu-01.example.com-42-abc123"
    assert node_name("weird host/name", 7, "ff") == "weird-host-name-7-ff"


def test_the_agent_store_is_fresh_per_round_and_deleted_with_the_job() -> None:
    assert torchrun_store_prefix("job1", 3) == "jobs/job1/torchrun/3/"
    assert torchrun_store_prefix("job1", 3) != torchrun_store_prefix("job1", 4)
    assert any(torchrun_store_prefix("job1", 3).startswith(p) for p in keys_of_job("job1"))


SPEC = JobSpec(id="job1", entrypoint="torchrun", min_nodes=2, max_nodes=4, max_restarts=2)


def doc(state: JobState, round_: int = 0, **fields: object) -> Job:
    return Job(
        id="job1",
        spec=SPEC,
        state=state,
        max_restarts=2,
        round=round_,
        created_at=1.0,
        launcher="torchrun",
        **fields,  # type: ignore[arg-type]
    )


P, R, S, F = JobState.PENDING, JobState.RUNNING, JobState.RESTARTING, JobState.SUCCEEDED
FAILED = JobState.FAILED


@pytest.mark.parametrize(
    ("current", "step", "expect"),
    [
        # (state, round, restart_count) after the step; None: no write
        (None, RunStep(P), (P, 0, 0)),  # the first torchrun makes the document
        (doc(P), RunStep(P), None),  # the others find it
        (doc(P), RunStep(R, 0), (R, 0, 0)),
        (doc(R, 0), RunStep(R, 0), None),  # every node says it; one write
        (doc(R, 0), RunStep(S, 0, "a node left"), (S, 0, 0)),
        (doc(S, 0), RunStep(S, 0, "a node left"), None),
        (doc(S, 0), RunStep(R, 0), None),  # a stale word about the round already left
        (doc(S, 0), RunStep(R, 1), (R, 1, 0)),
        (doc(R, 2), RunStep(R, 1), None),  # older round
        (doc(R, 1), RunStep(S, 0), None),  # re-forming a round already left
        # a failure charges one restart per round, whoever says it first
        (doc(R, 0), RunStep(S, 0, "workers failed", failed=True), (S, 0, 1)),
        (doc(S, 0), RunStep(S, 0, "workers failed", failed=True), (S, 0, 1)),
        (doc(S, 0, restart_count=1, charged_round=0), RunStep(S, 0, failed=True), None),
        # the end: first terminal state wins; a run that never formed a round failed
        (doc(R, 1), RunStep(F), (F, 1, 0)),
        (doc(R, 1), RunStep(FAILED, reason="boom"), (FAILED, 1, 0)),
        (doc(F, 1), RunStep(FAILED, reason="boom"), None),
        (doc(P), RunStep(F), (FAILED, 0, 0)),
    ],
)
def test_the_run_document_follows_the_torchruns_words(
    current: Job | None, step: RunStep, expect: tuple[JobState, int, int] | None
) -> None:
    new = run_edit(current, step, run_id="job1", spec=SPEC, node="a", now=5.0)
    if expect is None:
        assert new is None
        return
    assert new is not None
    assert (new.state, new.round, new.restart_count) == expect
    assert new.launcher == "torchrun"
    assert (new.finished_at == 5.0) is new.state.is_terminal
    if new.state is JobState.FAILED and current is not None and current.state is P:
        assert new.reason == "torchrun ended before any round formed"


def test_a_daemons_job_id_is_refused() -> None:
    """torch's agents never write a job the daemons run."""
    ours = doc(R).model_copy(update={"launcher": "elasticd"})
    with pytest.raises(ValueError, match="names a job the elasticd daemons run"):
        run_edit(ours, RunStep(R, 1), run_id="job1", spec=SPEC, node="a", now=5.0)


def test_the_run_spec_is_the_command_and_never_scheduled() -> None:
    c = config({"last_call_timeout": "1"})
    argv = ["torchrun", "--nnodes=2:4", "train.py", "--lr", "0.1"]
    spec = run_spec(c, argv, nproc_per_node=4, max_restarts=1, role="trainer")
    assert (spec.entrypoint, spec.args) == ("torchrun", argv[1:])
    assert (spec.nproc_per_node, spec.max_restarts, spec.role) == (4, 1, "trainer")
    assert (spec.min_nodes, spec.max_nodes, spec.last_call_timeout) == (2, 4, 1.0)
    assert spec.node_selector == NEVER_SCHEDULED
    assert not parse_labels("elasticd=torchrun,a=b").keys() & NEVER_SCHEDULED.keys()
    # what the parser could not read keeps the defaults; an odd command keeps the essentials
    assert run_spec(c, ["torchrun"]).nproc_per_node == 1
    odd = run_spec(c, ["torchrun", "x" * 100_000])
    assert (odd.args, odd.node_selector) == ([], NEVER_SCHEDULED)


def test_loading_the_entry_point_imports_no_torch() -> None:
    """torch loads every out-of-tree backend when torchrun starts; ours costs no torch import
    until torch asks it for a handler (and the daemon never imports it at all)."""
    code = (
        "import sys, elasticd.torchrun_backend as b\n"
        "creator = b.create_handler()\n"
        "assert callable(creator) and 'torch' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
