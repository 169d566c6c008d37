"""Review of issue 27: reading a prewarm job's workers must not write the store each time."""

from __future__ import annotations

from types import SimpleNamespace

from elasticd.agent.group import LocalGroup
from elasticd.supervise.standby import StandbyInfo


def test_reading_the_standbys_memory_publishes_only_when_a_standby_changes() -> None:
    """``GET /jobs/{id}/workers`` calls refresh_progress, which shows the standbys: their
    memory changes at every read, and a publish per read is a store write per API request
    (any reader could drive the store's write rate). Only a new, gone or ready standby
    publishes; the memory is fresh in the node's own view all the same."""
    rss = iter(range(1000, 10**6, 4096))
    pids = {0: 11}
    pool = SimpleNamespace(
        infos=lambda: [StandbyInfo(r, p, "ready", next(rss)) for r, p in pids.items()]
    )
    published: list[int] = []
    group = LocalGroup.__new__(LocalGroup)
    group.standbys = pool  # type: ignore[assignment]
    group.attempt = SimpleNamespace(view=SimpleNamespace(standbys=[]))  # type: ignore[assignment]
    group.changed = lambda: published.append(1)
    for _ in range(5):
        group.show_standbys()
    assert len(published) == 1
    assert group.attempt is not None
    assert group.attempt.view.standbys[0].rss_bytes == 1000 + 4 * 4096
    pids[0] = 12  # a replacement
    group.show_standbys()
    assert len(published) == 2
