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


SYSTEM_CLOCK = SystemClock()
