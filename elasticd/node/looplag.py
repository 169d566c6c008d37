"""How late the daemon's event loop runs what is due: ``elasticd_event_loop_lag_seconds``.

Every job's supervision, every heartbeat and every API answer of a daemon
runs on one event loop, so anything that blocks it (a fork, a synchronous
write, a long computation) delays all of them at once (issue 27: a job
crash-looping three times a second pushed the API's p99 from 5 ms to 91 ms).
The lag is the operator's signal that this happens.

No timer of its own: uvicorn's server already wakes every
:data:`TICK` seconds (its ``main_loop``: the ``Date`` header, the exit
check), and :meth:`LoopLag.tick` is called from its ``on_tick``; the lag of
a tick is how much later than :data:`TICK` after the previous one it ran
(:func:`lag_of`, pure). A blocked loop shows as one late tick as long as
the block (a 100 ms block is one sample of about 0.1 s, not ten).
"""

from __future__ import annotations

from prometheus_client import Histogram

__all__ = ["LAG_BUCKETS", "TICK", "LoopLag", "lag_of"]

#: Seconds between two ticks of uvicorn's ``Server.main_loop`` (its ``asyncio.sleep(0.1)``).
TICK = 0.1

#: The histogram's bounds, in seconds: from "unnoticeable" to "the node stalls".
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


def lag_of(previous: float | None, now: float, interval: float = TICK) -> float | None:
    """How late a tick at ``now`` is, after one at ``previous`` (None: no previous tick)."""
    if previous is None:
        return None
    return max(0.0, now - previous - interval)


class LoopLag:
    """Feeds the lag of each tick into ``histogram``; call :meth:`tick` with the loop's time."""

    def __init__(self, histogram: Histogram) -> None:
        self.histogram = histogram
        self._previous: float | None = None
        #: The largest lag seen (seconds), for logs and tests.
        self.max = 0.0

    def tick(self, now: float) -> None:
        lag = lag_of(self._previous, now)
        self._previous = now
        if lag is not None:
            self.histogram.observe(lag)
            self.max = max(self.max, lag)

    def restart(self) -> None:
        """The ticks stopped and start again (a new server): the gap is no lag."""
        self._previous = None
