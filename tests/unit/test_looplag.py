"""The event loop's lag (elasticd.node.looplag): each tick's lateness, and the histogram fed."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram

from elasticd.node.looplag import LAG_BUCKETS, TICK, LoopLag, lag_of


@pytest.mark.parametrize(
    ("previous", "now", "lag"),
    [
        (None, 5.0, None),  # the first tick: nothing to be late against
        (5.0, 5.0 + TICK, 0.0),  # on time
        (5.0, 5.0 + TICK + 0.25, 0.25),  # a quarter of a second late
        (5.0, 5.0 + TICK / 2, 0.0),  # early (a tick's own work shifts it): never negative
    ],
)
def test_lag_of_a_tick(previous: float | None, now: float, lag: float | None) -> None:
    """A tick's lag is how much later than TICK after the previous one it came."""
    assert lag_of(previous, now) == (None if lag is None else pytest.approx(lag))


def test_ticks_feed_the_histogram_and_a_restart_forgets_the_gap() -> None:
    """Each tick after the first is observed; a restarted server's first tick is not a lag."""
    registry = CollectorRegistry()
    hist = Histogram("lag_seconds", "x", buckets=LAG_BUCKETS, registry=registry)
    lag = LoopLag(hist)
    for now in (1.0, 1.1, 1.6):
        lag.tick(now)
    assert lag.max == pytest.approx(0.4)
    lag.restart()
    lag.tick(100.0)
    assert registry.get_sample_value("lag_seconds_count") == 2  # the first ticks: no lag
