"""When a node's lease may have expired (issue 12, defect 3): the fencing clock, as a table."""

from __future__ import annotations

import pytest

from elasticd.node.cluster import lease_lapse


@pytest.mark.parametrize(
    ("renewed_at", "now", "lapse"),
    [
        (None, 100.0, None),  # never granted: nothing to lose
        (10.0, 10.0, None),
        (10.0, 12.9, None),  # the lease lives lease_ttl from the send of its last renewal
        (10.0, 13.0, 0.0),  # ... and may be gone from then on: fence
        (10.0, 14.5, 1.5),
    ],
)
def test_lease_lapse(renewed_at: float | None, now: float, lapse: float | None) -> None:
    """A lease renewed (sent) at ``renewed_at`` with a 3 s TTL may have expired ``lapse`` ago."""
    assert lease_lapse(renewed_at, 3.0, now) == lapse
