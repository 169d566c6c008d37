"""``elasticd slurm prolog`` in a real Slurm's ``slurm.conf``: a node whose health check fails
is drained, with the reason; a healthy node runs the job."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.slurm_cluster import SlurmCluster, require_slurm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

#: The node daemon's config: the health check fails on n2 only (the node's hostname is its
#: own in its UTS namespace).
CONFIG = """
health_check = ["sh", "-c", "test \\"$(hostname)\\" != n2 || { echo n2 disk is sick >&2; exit 1; }"]
health_check_timeout = 20
"""


@pytest.fixture
def slurm(tmp_path: Path) -> Iterator[SlurmCluster]:
    require_slurm()
    config = tmp_path / "elasticd.toml"
    config.write_text(CONFIG)
    prolog = tmp_path / "elasticd-prolog"
    prolog.write_text(
        f"#!/bin/sh\nexec {sys.executable} -m elasticd slurm prolog --config {config}\n"
    )
    prolog.chmod(0o755)
    (tmp_path / "slurm").mkdir()
    cluster = SlurmCluster(tmp_path / "slurm", extra_conf=(f"Prolog={prolog}",))
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.close()


def node_fields(slurm: SlurmCluster, name: str) -> dict[str, str]:
    """``scontrol show node NAME``'s fields (``State``, ``Reason``, ...)."""
    text = slurm.run("scontrol", "-o", "show", "node", name).stdout
    fields = {}
    for word in text.replace(" Reason=", "\nReason=").split("\n")[0].split():
        key, _, value = word.partition("=")
        fields[key] = value
    reason = text.partition(" Reason=")[2].strip()
    fields["Reason"] = reason
    return fields


def test_the_prolog_drains_a_node_whose_health_check_fails(slurm):
    """A job sent to n2 does not run there: the prolog fails, n2 is drained with the health
    check's reason; the same job on n1 (healthy) runs."""
    failed = slurm.run("srun", "-N1", "-w", "n2", "true", timeout=60)
    assert failed.returncode != 0, failed
    deadline = time.monotonic() + 30
    while "DRAIN" not in node_fields(slurm, "n2").get("State", ""):
        assert time.monotonic() < deadline, node_fields(slurm, "n2")
        time.sleep(0.1)
    fields = node_fields(slurm, "n2")
    assert "elasticd prolog: node_health_check failed" in fields["Reason"], fields
    assert "n2 disk is sick" in fields["Reason"], fields
    ran = slurm.run("srun", "-N1", "-w", "n1", "hostname", timeout=60)
    assert (ran.returncode, ran.stdout.strip()) == (0, "n1"), ran
    assert "DRAIN" not in node_fields(slurm, "n1")["State"]
