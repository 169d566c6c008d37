"""What a daemon tells Slurm of its node's quarantine (``slurm_drain``; pure table)."""

from __future__ import annotations

import pytest

from elasticd.node.quarantine import NodeHealth, Quarantine
from elasticd.node.slurm_drain import MAX_REASON, SlurmAction, SlurmNode, decide, parse_show_node

REASON = "elasticd: bad HBM (by admin)"
IDLE = SlurmNode("IDLE")


def health(until: float | None = None, reason: str = "bad HBM") -> NodeHealth:
    q = Quarantine(reason=reason, since=0.0, by="admin", until=until)
    return NodeHealth(node="n2", quarantine=q)


def drained(reason: str, state: str = "IDLE+DRAIN") -> SlurmNode:
    return SlurmNode(state, reason)


@pytest.mark.parametrize(
    ("record", "slurm", "now", "want"),
    [
        (health(), IDLE, 1.0, SlurmAction("drain", REASON)),  # quarantined: drain
        (health(), drained(REASON), 1.0, None),  # already drained with that reason
        (health(), drained(REASON, "DRAINED"), 1.0, None),
        (
            health(reason="other"),
            drained(REASON),
            1.0,
            SlurmAction("drain", "elasticd: other (by admin)"),
        ),
        (health(), drained("admin: reseat"), 1.0, None),  # another's drain: not overwritten
        (NodeHealth(node="n2"), drained(REASON), 1.0, SlurmAction("resume")),  # released
        (health(until=5.0), drained(REASON, "MIXED+DRAIN"), 6.0, SlurmAction("resume")),  # TTL out
        (NodeHealth(node="n2"), IDLE, 1.0, None),  # nothing to undo
        (NodeHealth(node="n2"), drained("admin: reseat"), 1.0, None),  # not elasticd's drain
        (NodeHealth(node="n2"), drained("Prolog error"), 1.0, None),  # Slurm's own
        # The prolog's drain: its own check failed, not a quarantine to end.
        (NodeHealth(node="n2"), drained("elasticd prolog: gpu failed: x"), 1.0, None),
    ],
)
def test_the_record_and_slurm_decide_the_node_state_in_slurm(record, slurm, now, want):
    """Drain while a quarantine is in force, resume only a drain Slurm shows as elasticd's
    (a fresh daemon, which remembers nothing, resumes what an earlier one drained)."""
    assert decide(record, slurm, now) == want


LINE = (
    "NodeName=n2 Arch=x86_64 CoresPerSocket=1 CPUAlloc=0 CPUTot=2 CPULoad=0.10 "
    "AvailableFeatures=(null) ActiveFeatures=(null) Gres=(null) NodeAddr=10.213.7.3 "
    "NodeHostName=n2 Version=22.05.8 OS=Linux 6.1.0 RealMemory=1 AllocMem=0 FreeMem=100 "
    "Sockets=2 Boards=1 State=IDLE+DRAIN ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A "
    "MCS_label=N/A Partitions=debug BootTime=2024-05-01T10:00:00 CfgTRES=cpu=2,mem=1M "
    "AllocTRES= CapWatts=n/a CurrentWatts=0 AveWatts=0 ExtSensorsJoules=n/s "
    "ExtSensorsWatts=0 ExtSensorsTemp=n/s Reason=elasticd: bad HBM on gpu3 (by admin) "
    "[root@2024-05-01T10:01:02]\n"
)


@pytest.mark.parametrize(
    ("text", "want"),
    [
        (LINE, SlurmNode("IDLE+DRAIN", "elasticd: bad HBM on gpu3 (by admin)")),
        (LINE.replace(" Reason=elasticd: bad HBM on gpu3 (by admin) [root@2024-05-01T10:01:02]", ""),
         SlurmNode("IDLE+DRAIN", "")),
        ("NodeName=n2 State=MIXED Reason=(null)\n", SlurmNode("MIXED", "")),
        ("Node n9 not found\n", None),
    ],
)  # fmt: skip
def test_scontrol_show_node_gives_the_state_and_reason(text, want):
    """One line of ``scontrol -o show node``: the State and the Reason without Slurm's stamp."""
    assert parse_show_node(text) == want


def test_a_long_reason_is_clipped_and_the_args_name_the_node():
    """Slurm gets a bounded reason; the scontrol words name the node and the state."""
    action = decide(health(reason="x" * 500), IDLE, 1.0)
    assert action is not None and action.reason is not None
    assert len(action.reason) == MAX_REASON
    assert action.args("n2")[:3] == ["update", "nodename=n2", "state=drain"]
    assert SlurmAction("resume").args("n2") == ["update", "nodename=n2", "state=resume"]
