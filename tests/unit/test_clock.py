"""The clocks (elasticd.clock): the steady wall clock that a wall-clock step does not move."""

from __future__ import annotations

import pytest

from elasticd.clock import SteadyWallClock, steady_of

HOUR = 3600.0


class SteppedClock:
    """Monotonic time that only moves on, and a wall clock a test steps either way."""

    def __init__(self) -> None:
        self.mono, self.offset = 100.0, 1_700_000_000.0

    def monotonic(self) -> float:
        return self.mono

    def time(self) -> float:
        return self.mono + self.offset


def test_a_step_of_the_wall_clock_moves_no_steady_time() -> None:
    """Steady time starts at the wall time and then moves with the monotonic clock only."""
    clock = SteppedClock()
    steady = SteadyWallClock(clock)
    start = steady.time()
    assert start == clock.time()
    clock.mono += 5
    clock.offset -= HOUR  # corrected: an hour back
    assert steady.time() - start == 5
    clock.mono += 5
    clock.offset += 2 * HOUR
    assert steady.time() - start == 10
    assert steady.monotonic() == clock.mono


@pytest.mark.parametrize(
    ("stamp", "wall_now", "steady_now", "not_before", "at"),
    [
        (98.0, 100.0, 500.0, None, 498.0),  # two seconds ago
        (100.0, 100.0, 500.0, None, 500.0),  # just now
        (98.0 + HOUR, 100.0, 500.0, None, 500.0),  # the clock stepped back since: now
        (98.0, 100.0 + HOUR, 500.0, 490.0, 490.0),  # stepped on since: not before 490
        (98.0, 100.0, 500.0, 490.0, 498.0),  # within its bound
    ],
)
def test_a_wall_stamp_is_placed_by_its_age(
    stamp: float, wall_now: float, steady_now: float, not_before: float | None, at: float
) -> None:
    """A wall stamp taken a moment ago lands as old as it is, never in the future and never
    before its bound, whatever step the wall clock took since."""
    assert steady_of(stamp, wall_now, steady_now, not_before) == at
