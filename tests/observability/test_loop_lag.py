"""A job that crash-loops does not stall the daemon's event loop (issue 27, point 6): the
daemon's own ``elasticd_event_loop_lag_seconds``, scraped from a real ``elasticd serve``.

The figure (p99 of the API's answers under load) lives in ``bench/bench_api_load.py``; this
test asserts what holds on any machine, however loaded: the histogram is fed by the
server's tick, and while a job restarts over and over no tick of the loop comes a whole
second late (the supervisor used to fork, wait for the exec, and write on the loop).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.hardening.support import PY, serve

#: Exits 1 a moment after it starts: the daemon restarts it as fast as it can.
CRASH = "import sys, time; time.sleep(0.1); sys.exit(1)"
RESTARTS = 10
#: A bound no loaded machine reaches unless the loop is blocked for real.
BOUND_S = 1.0


def lag_histogram(text: str) -> dict[float, float]:
    """``elasticd_event_loop_lag_seconds``: cumulative count per upper bound (pure)."""
    buckets: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "elasticd_event_loop_lag_seconds":
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    buckets[float(sample.labels["le"])] = sample.value
    return buckets


def test_lag_histogram_reads_the_cumulative_buckets() -> None:
    """The reader of the scrape takes each bucket's bound and cumulative count."""
    text = (
        "# HELP elasticd_event_loop_lag_seconds x\n"
        "# TYPE elasticd_event_loop_lag_seconds histogram\n"
        'elasticd_event_loop_lag_seconds_bucket{le="0.1"} 3.0\n'
        'elasticd_event_loop_lag_seconds_bucket{le="1.0"} 4.0\n'
        'elasticd_event_loop_lag_seconds_bucket{le="+Inf"} 5.0\n'
        "elasticd_event_loop_lag_seconds_count 5.0\n"
        "elasticd_event_loop_lag_seconds_sum 2.5\n"
    )
    assert lag_histogram(text) == {0.1: 3.0, 1.0: 4.0, float("inf"): 5.0}


async def test_a_crash_loop_never_stalls_the_event_loop_for_a_second(tmp_path: Path) -> None:
    """While a job restarts RESTARTS times, every tick of the daemon's loop comes within
    BOUND_S of when it was due, and the ticks are counted."""
    daemon = serve(tmp_path)
    try:
        async with asyncio.timeout(110):
            await daemon.wait_ready()
            async with daemon.client() as c:
                before = lag_histogram((await c.get("/metrics")).text)
                assert before, "no elasticd_event_loop_lag_seconds on /metrics"
                r = await c.post(
                    "/jobs",
                    json={
                        "id": "crashloop",
                        "entrypoint": PY,
                        "args": ["-I", "-S", "-c", CRASH],
                        "max_restarts": 1000,
                        "termination_grace": 2,
                    },
                )
                assert r.status_code == 201, r.text
                started = time.monotonic()
                while (await c.get("/jobs/crashloop")).json()["restart_count"] < RESTARTS:
                    await asyncio.sleep(0.1)
                elapsed = time.monotonic() - started
                after = lag_histogram((await c.get("/metrics")).text)
                await c.post("/jobs/crashloop/cancel", json={})
        ticks = after[float("inf")] - before[float("inf")]
        late = ticks - (after[BOUND_S] - before[BOUND_S])
        # uvicorn ticks every 0.1 s: at least a few per second of the crash loop.
        assert ticks >= elapsed * 3, (ticks, elapsed)
        assert late == 0, f"{late:g} of {ticks:g} ticks came more than {BOUND_S} s late"
    finally:
        daemon.stop()
