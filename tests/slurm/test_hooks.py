"""The prolog's drain reason (pure table) and the prolog itself over real check commands."""

from __future__ import annotations

import pytest

from elasticd.config import load_config
from elasticd.node.health import HealthResult
from elasticd.slurm.hooks import MAX_REASON, drain_reason, prolog

pytestmark = pytest.mark.timeout(30)


def result(name: str, ok: bool, message: str = "", skipped: bool = False) -> HealthResult:
    return HealthResult(name=name, ok=ok, skipped=skipped, message=message, duration_s=0.1)


@pytest.mark.parametrize(
    ("results", "reason"),
    [
        ([], None),
        ([result("gpu", True, "no nvidia-smi", skipped=True)], None),
        ([result("node_health_check", True)], None),
        (
            [result("node_health_check", False, "exit 1:\n  disk\tfull ")],
            "elasticd prolog: node_health_check failed: exit 1: disk full",
        ),
        (
            [result("node_health_check", False, ""), result("gpu", False, "Xid 79")],
            "elasticd prolog: node_health_check failed: no output (and 1 more)",
        ),
    ],
)
def test_drain_reason(results, reason):
    """None when every check passed (a skipped one too); else the first failure on one line."""
    assert drain_reason(results) == reason


def test_a_long_reason_is_cut():
    """Slurm shows a reason on one line: it is bounded."""
    reason = drain_reason([result("gpu", False, "x" * 1000)])
    assert reason is not None and len(reason) == MAX_REASON and reason.endswith("...")


@pytest.mark.parametrize(("command", "code"), [(["true"], 0), (["sh", "-c", "exit 3"], 1)])
async def test_prolog_exits_by_the_node_check(command, code, tmp_path, capsys):
    """The node's health_check decides the prolog's exit (outside Slurm: no drain asked)."""
    config = load_config({"state_dir": str(tmp_path), "health_check": command}, environ={})
    assert await prolog(config, {"PATH": "/usr/bin:/bin"}) == code
    said = capsys.readouterr().err
    assert ("node_health_check failed" in said) == bool(code)
