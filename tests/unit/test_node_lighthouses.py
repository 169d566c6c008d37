"""When a node closes a job's torchft Lighthouse (``node/lighthouses.unused_for``, pure)."""

from __future__ import annotations

import pytest

from elasticd.node.lighthouses import unused_for


@pytest.mark.parametrize(
    ("served", "active", "unused", "now", "close", "since"),
    [
        # A job with a group's agent here stays, and its unused clock is dropped.
        (["a"], {"a"}, {"a": 1.0}, 50.0, [], {}),
        # No agent since now: kept, its clock starts.
        (["a"], set(), {}, 50.0, [], {"a": 50.0}),
        # No agent for less than the grace (a re-exec's adoption): kept.
        (["a"], set(), {"a": 45.0}, 50.0, [], {"a": 45.0}),
        # No agent for the whole grace: closed.
        (["a"], set(), {"a": 40.0}, 50.0, ["a"], {}),
        # Each job by its own clock.
        (["a", "b", "c"], {"b"}, {"a": 40.0, "c": 49.0}, 50.0, ["a"], {"c": 49.0}),
        # A clock of a job no longer served is forgotten.
        ([], set(), {"gone": 1.0}, 50.0, [], {}),
    ],
)
def test_a_lighthouse_is_closed_after_its_grace_with_no_group_here(
    served: list[str],
    active: set[str],
    unused: dict[str, float],
    now: float,
    close: list[str],
    since: dict[str, float],
) -> None:
    """A job's Lighthouse is closed once no group's agent has run here for the grace (10 s
    here), never sooner: a re-exec's new image serves it before it takes the agents up."""
    assert unused_for(served, active, unused, now, 10.0) == (close, since)
