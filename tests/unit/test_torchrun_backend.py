"""The torchrun backend's pure decisions: endpoint, settings, and what num_nodes_waiting says."""

from __future__ import annotations

import pytest

from elasticd.keys import keys_of_job, torchrun_store_prefix
from elasticd.rendezvous import Change
from elasticd.torchrun_backend import backend_config, endpoint_url, node_name, waiting_nodes


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
