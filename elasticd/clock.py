"""Clocks, injectable so that tests can drive time.

Decisions take `now` as an argument; only the thin async loops that apply them
read a clock, and they read it through one of these.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """A source of monotonic and wall time."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back."""
        ...

    def time(self) -> float:
        """Seconds since the Unix epoch (wall time, for timestamps shown to people)."""
        ...


class SystemClock:
    """The real clocks."""

    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()


class FakeClock:
    """A clock that moves only when told to; for unit tests of decisions."""

    def __init__(self, start: float = 1_000.0, wall_offset: float = 1_700_000_000.0) -> None:
        self._now = start
        self._wall_offset = wall_offset

    def monotonic(self) -> float:
        return self._now

    def time(self) -> float:
        return self._now + self._wall_offset

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a clock cannot go back")
        self._now += seconds


class SteadyWallClock:
    """Wall time that never steps: the wall clock read once, then carried on by the monotonic one.

    For stamps that are subtracted from each other (goodput's facts, issue 33): a step of
    the wall clock after the anchor (NTP correcting it by an hour) moves none of them, so
    an interval between two of its stamps is the monotonic time between them. It keeps
    the offset of the moment it was made; a later step shows only in the stamps of
    other clocks (the job document's).
    """

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._offset = clock.time() - clock.monotonic()

    def monotonic(self) -> float:
        return self._clock.monotonic()

    def time(self) -> float:
        return self._offset + self._clock.monotonic()

    def of_wall(self, stamp: float, not_before: float | None = None) -> float:
        """This clock's time of a stamp just read from the underlying wall clock."""
        return steady_of(stamp, self._clock.time(), self.time(), not_before)


def steady_of(stamp: float, wall_now: float, steady_now: float, not_before: float | None) -> float:
    """A wall ``stamp`` taken a moment ago, on a steady clock that reads ``steady_now`` while
    the wall clock reads ``wall_now``: as old as the wall clock says, but never in the
    future (the wall clock stepped back since), nor before ``not_before`` (it stepped on)."""
    at = steady_now - max(0.0, wall_now - stamp)
    return at if not_before is None else max(at, not_before)


SYSTEM_CLOCK = SystemClock()
