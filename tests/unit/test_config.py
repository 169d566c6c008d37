"""Configuration precedence, TOML files, token-file permissions and the loopback rule."""

import pytest

from elasticd.config import load_config, own_token, read_token
from elasticd.errors import ConfigError


def test_flags_beat_env_beat_file(tmp_path):
    """A flag overrides ELASTICD_*, which overrides the TOML file."""
    cfg = tmp_path / "elasticd.toml"
    cfg.write_text('[elasticd]\nport = 9000\nnode-name = "from-file"\nlabels = "a=1"\nslots = 3\n')
    env = {"ELASTICD_PORT": "9100", "ELASTICD_NODE_NAME": "from-env"}
    c = load_config({"config": str(cfg), "node_name": "from-flag"}, environ=env)
    assert (c.port, c.node_name, c.labels, c.slots) == (9100, "from-flag", {"a": "1"}, 3)


def test_bad_values_are_config_errors(tmp_path):
    """A bad port or an unknown key is a ConfigError that names it."""
    with pytest.raises(ConfigError, match="port"):
        load_config({"port": 99999}, environ={})
    bad = tmp_path / "bad.toml"
    bad.write_text("nonsense = 1\n")
    with pytest.raises(ConfigError, match="nonsense"):
        load_config({"config": str(bad)}, environ={})
    with pytest.raises(ConfigError, match="does not exist"):
        load_config({"config": str(tmp_path / "missing.toml")}, environ={})


def test_token_file_must_be_private(tmp_path):
    """A token file readable by group/others is refused with the chmod to run."""
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    token.chmod(0o644)
    config = load_config({"token_file": str(token)}, environ={})
    with pytest.raises(ConfigError, match="chmod 600"):
        read_token(config, environ={})
    token.chmod(0o600)
    assert read_token(config, environ={}) == "s3cret"


def test_a_daemon_given_no_token_makes_its_own_once(tmp_path):
    """No token file: <state_dir>/token is made 0600 at the first start and read after."""
    state = tmp_path / "state"
    token, path = own_token(state)
    assert path == state / "token" and path.read_text().strip() == token
    assert path.stat().st_mode & 0o777 == 0o600 and len(token) >= 40
    assert own_token(state) == (token, path)
    path.chmod(0o644)  # readable by others: refused, as any token file
    with pytest.raises(ConfigError, match="token file"):
        own_token(state)


def test_elasticd_runs_api_port_is_never_the_workers_master_port():
    """Found by CI: the embedded daemon's API got the port chosen for --master-port (free until
    rank 0 bound it), and the workers failed with EADDRINUSE."""
    import socket

    from elasticd.cli import _api_port

    assert _api_port(7070, 7070) == 7070  # a port asked for is the user's business
    assert _api_port(0, None) == 0
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            recent = probe.getsockname()[1]  # just freed: the kernel's likely next pick
        assert _api_port(0, recent) != recent


@pytest.mark.parametrize(
    ("left", "degraded", "bound"),
    [
        (10.0, False, 10.0),  # the first step may take all of shutdown_timeout
        (3.5, False, 3.5),  # a later one what is left
        (0.2, False, 1.0),  # at least MIN_STEP, however late
        (-4.0, False, 1.0),
        (10.0, True, 1.0),  # a write while the disk refuses: 1 s
        (0.2, True, 1.0),
    ],
)
def test_each_step_of_the_wind_down_gets_what_is_left_of_shutdown_timeout(
    left: float, degraded: bool, bound: float
) -> None:
    """The daemon's stop bounds each step by what remains of shutdown_timeout."""
    from elasticd.node.daemon import step_bound

    assert step_bound(left, degraded=degraded) == bound


def test_the_prewarm_move_budget_is_read_and_bounded():
    """ELASTICD_PREWARM_MOVE_BUDGET reaches the setting (0: every contained rank cold); a
    negative one, or one that would hold the event loop for long, is refused by name."""
    assert load_config({}, environ={}).prewarm_move_budget == 0.1
    env = {"ELASTICD_PREWARM_MOVE_BUDGET": "0"}
    assert load_config({}, environ=env).prewarm_move_budget == 0
    for bad in ("-1", "60"):
        with pytest.raises(ConfigError, match="prewarm_move_budget"):
            load_config({}, environ={"ELASTICD_PREWARM_MOVE_BUDGET": bad})


def test_a_prewarm_move_budget_that_could_outlast_the_lease_is_refused():
    """The move holds the daemon's event loop, the lease's keep-alive (every third of
    lease_ttl) with it: a budget of a third of the TTL or more could let the node's lease
    lapse on one slow hand-off (its jobs fenced, its peers re-forming without it). The
    default TTL (3 s) took any budget up to 5 s before; the refusal names both settings."""
    for budget, ttl in (("1", "3"), ("4", "3"), ("0.5", "1")):
        env = {"ELASTICD_PREWARM_MOVE_BUDGET": budget, "ELASTICD_LEASE_TTL": ttl}
        with pytest.raises(ConfigError, match="prewarm_move_budget.*lease_ttl"):
            load_config({}, environ=env)
    env = {"ELASTICD_PREWARM_MOVE_BUDGET": "0.9", "ELASTICD_LEASE_TTL": "3"}
    assert load_config({}, environ=env).prewarm_move_budget == 0.9
    env = {"ELASTICD_PREWARM_MOVE_BUDGET": "5", "ELASTICD_LEASE_TTL": "30"}
    assert load_config({}, environ=env).prewarm_move_budget == 5
    # The default budget is not held against a small TTL somebody set (it was a constant).
    assert load_config({}, environ={"ELASTICD_LEASE_TTL": "0.2"}).prewarm_move_budget == 0.1
