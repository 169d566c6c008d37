"""What a daemon tells Slurm of its node's quarantine (``slurm_drain``; pure table)."""

from __future__ import annotations

import pytest

from elasticd.node.quarantine import NodeHealth, Quarantine
from elasticd.node.slurm_drain import MAX_REASON, SlurmAction, decide

REASON = "elasticd: bad HBM (by admin)"


def health(until: float | None = None, reason: str = "bad HBM") -> NodeHealth:
    q = Quarantine(reason=reason, since=0.0, by="admin", until=until)
    return NodeHealth(node="n2", quarantine=q)


@pytest.mark.parametrize(
    ("record", "applied", "now", "want"),
    [
        (health(), None, 1.0, SlurmAction("drain", REASON)),  # quarantined: drain
        (health(), REASON, 1.0, None),  # already drained with that reason
        (health(reason="other"), REASON, 1.0, SlurmAction("drain", "elasticd: other (by admin)")),
        (NodeHealth(node="n2"), REASON, 1.0, SlurmAction("resume")),  # released: resume
        (health(until=5.0), REASON, 6.0, SlurmAction("resume")),  # its TTL ran out
        (NodeHealth(node="n2"), None, 1.0, None),  # not elasticd's drain: left alone
    ],
)
def test_the_record_decides_the_node_state_in_slurm(record, applied, now, want):
    """Drain while a quarantine is in force, resume only a drain elasticd made."""
    assert decide(record, applied, now) == want


def test_a_long_reason_is_clipped_and_the_args_name_the_node():
    """Slurm gets a bounded reason; the scontrol words name the node and the state."""
    action = decide(health(reason="x" * 500), None, 1.0)
    assert action is not None and action.reason is not None
    assert len(action.reason) == MAX_REASON
    assert action.args("n2")[:3] == ["update", "nodename=n2", "state=drain"]
    assert SlurmAction("resume").args("n2") == ["update", "nodename=n2", "state=resume"]
