"""A skewed or stepped clock never deletes a fresh job, nor keeps one past its retention
(issue 23, defect 4).

Retention used to compare the job document's ``finished_at``, stamped by the
wall clock of the node that ended the job, with the deleting node's wall
clock: a node an hour behind the deleter (or a +1 h step of the deleter's
clock) had a job deleted seconds after it ended, and an hour ahead kept it an
hour too long. Now each node counts from when it saw the end, on its monotonic
clock (:mod:`elasticd.node.retention`).

First the pure decision as a table; then two daemons in one process sharing one
store, each with its own injected clock: ``runner`` runs the job (its clock
skewed; retention off, so only the other node deletes), ``deleter`` runs
retention (its clock stepped in some cases, restarted in one).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from elasticd.config import load_config
from elasticd.node.daemon import Daemon
from elasticd.node.retention import EndSeen, expired, retention_due, seen_end
from elasticd.testing import MemoryStore
from tests.conftest import asgi_client

HOUR = 3600.0
BOOT = "boot-1"


class Job:
    def __init__(self, job_id: str, finished_at: float | None) -> None:
        self.id = job_id
        self.finished_at = finished_at


# -- the decision, as tables ------------------------------------------------------------


@pytest.mark.parametrize(
    ("seen_at", "now", "retention", "due"),
    [
        (100.0, 100.0, 60.0, False),  # just seen
        (100.0, 159.9, 60.0, False),  # inside the retention
        (100.0, 160.0, 60.0, True),  # exactly the retention
        (100.0, 10_000.0, 60.0, True),  # long past
        (100.0, 10_000.0, 0.0, False),  # 0 keeps forever
        (0.0, 59.0, 60.0, False),  # seen at the clock's origin
    ],
)
def test_retention_is_due_once_this_node_saw_the_end_retention_seconds_ago(
    seen_at: float, now: float, retention: float, due: bool
) -> None:
    """Due exactly when ``retention`` seconds of this node's monotonic clock have passed."""
    assert retention_due(seen_at, now, retention) is due


WALL = 1_700_000_000.0


@pytest.mark.parametrize(
    ("finished_at", "seen_at", "now", "due"),
    [
        # The finisher's clock an hour behind (finished "in the past"), ahead (in the future),
        # on time, or unknown: the stamp is never compared with a clock.
        (WALL - HOUR, 500.0, 505.0, False),
        (WALL + HOUR, 500.0, 505.0, False),
        (WALL, 500.0, 505.0, False),
        (WALL - HOUR, 500.0, 560.0, True),
        (WALL + HOUR, 500.0, 560.0, True),
        (None, 500.0, 560.0, True),
    ],
)
def test_the_finishers_wall_clock_changes_nothing(
    finished_at: float | None, seen_at: float, now: float, due: bool
) -> None:
    """A job stamped by a clock an hour off either way is kept for the whole retention
    (60 s here) from when this node saw it end, then deleted."""
    job = Job("j", finished_at)
    ends = {"j": EndSeen(finished_at, BOOT, seen_at)}
    assert expired([job], ends, now, 60.0) == (["j"] if due else [])


def test_a_step_of_this_nodes_wall_clock_is_no_input() -> None:
    """The decision reads the monotonic clock only: a +1 h or -1 h step of the wall clock
    after the end moves nothing (the monotonic clock does not step)."""
    job = Job("j", WALL)
    end = seen_end(job, None, BOOT, now=500.0)
    for now, due in [(500.0, False), (530.0, False), (559.9, False), (560.0, True)]:
        assert expired([job], {"j": end}, now, 60.0) == (["j"] if due else [])


@pytest.mark.parametrize(
    ("record", "finished_at", "boot", "kept"),
    [
        (None, WALL, BOOT, False),  # first sight: now
        (EndSeen(WALL, BOOT, 100.0), WALL, BOOT, True),  # restarted daemon, same boot: kept
        (EndSeen(WALL, "boot-0", 100.0), WALL, BOOT, False),  # after a reboot: counts again
        (EndSeen(WALL - 5, BOOT, 100.0), WALL, BOOT, False),  # an id used again: a new end
    ],
)
def test_the_record_of_an_end_is_kept_only_for_the_same_end_on_the_same_boot(
    record: EndSeen | None, finished_at: float, boot: str, kept: bool
) -> None:
    """A record from before a restart keeps counting; one from another boot or of another
    end of the same id starts again at ``now`` (a job kept longer, never deleted early)."""
    end = seen_end(Job("j", finished_at), record, boot, now=900.0)
    assert end == (record if kept else EndSeen(finished_at, boot, 900.0))


def test_a_job_without_a_record_or_of_another_end_is_not_expired() -> None:
    assert expired([Job("j", WALL)], {}, 10_000.0, 60.0) == []
    assert expired([Job("j", WALL)], {"j": EndSeen(WALL - 1, BOOT, 0.0)}, 10_000.0, 60.0) == []


# -- two daemons, one store, their own clocks ----------------------------------------------

RETENTION = 3.0
PY = sys.executable


class SkewedClock:
    """The real clocks, the wall one shifted by ``offset`` seconds (a test moves it: a step)."""

    def __init__(self, offset: float = 0.0) -> None:
        self.offset = offset

    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time() + self.offset


class SharedStore(MemoryStore):
    """One in-memory store for several daemons: a daemon's shutdown does not close it."""

    async def close(self) -> None:
        pass

    async def really_close(self) -> None:
        await super().close()


def daemon(root: Path, name: str, store: SharedStore, clock: SkewedClock, **flags: Any) -> Daemon:
    config = {
        "state_dir": str(root / name),
        "node_name": name,
        "slots": 2,
        "port": 0,
        **flags,
    }
    environ = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICD_")}
    return Daemon(
        load_config(config, environ={}), store=store, serve_http=False, clock=clock, environ=environ
    )


async def state_of(c: httpx.AsyncClient, job_id: str) -> str | None:
    r = await c.get(f"/jobs/{job_id}")
    if r.status_code == 404:
        return None
    assert r.status_code == 200, r.text
    return str(r.json()["state"])


async def run_until_deleted(
    tmp_path: Path, *, runner_offset: float, step: float = 0.0, restart: bool = False
) -> tuple[float, float]:
    """Run a job on ``runner`` (wall clock ``runner_offset`` off), then wait for ``deleter``
    (retention 3 s; its wall clock stepped by ``step`` once the job ended, or the daemon
    restarted halfway) to delete it. Returns (seconds from the end to the deletion, the
    deleter's wall clock minus the stamp ``finished_at``)."""
    store = SharedStore()
    runner = daemon(
        tmp_path,
        "runner",
        store,
        SkewedClock(runner_offset),
        labels={"role": "runner"},
        job_retention=0,
    )
    deleter_clock = SkewedClock()
    deleter = daemon(tmp_path, "deleter", store, deleter_clock, job_retention=RETENTION)
    try:
        async with asyncio.timeout(60):
            await runner.start()
            await deleter.start()
            async with asgi_client(runner) as c:
                spec = {
                    "id": "brief",
                    "entrypoint": PY,
                    "args": ["-c", "pass"],
                    "node_selector": {"role": "runner"},
                }
                r = await c.post("/jobs", json=spec)
                assert r.status_code == 201, r.text
                while await state_of(c, "brief") != "SUCCEEDED":
                    await asyncio.sleep(0.02)
                ended = time.monotonic()
                finished_at = (await c.get("/jobs/brief")).json()["finished_at"]
            deleter_clock.offset += step
            skew = deleter_clock.time() - finished_at
            if restart:
                # Halfway through the retention, the deleter restarts on its database.
                while time.monotonic() - ended < RETENTION / 2:
                    await asyncio.sleep(0.05)
                await deleter.shutdown()
                deleter = daemon(tmp_path, "deleter", store, deleter_clock, job_retention=RETENTION)
                await deleter.start()
            async with asgi_client(deleter) as c:
                while await state_of(c, "brief") is not None:
                    if time.monotonic() - ended > RETENTION + 10:
                        return time.monotonic() - ended, skew  # kept too long: the caller says
                    await asyncio.sleep(0.05)
                return time.monotonic() - ended, skew
    finally:
        async with asyncio.timeout(60):
            await deleter.shutdown()
            await runner.shutdown()
            await store.really_close()


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("runner_offset", "step", "why"),
    [
        (-HOUR, 0.0, "the job's end stamped an hour in the deleter's past"),
        (+HOUR, 0.0, "the job's end stamped an hour in the deleter's future"),
        (0.0, +HOUR, "the deleter's clock stepped an hour forward after the end"),
        (0.0, -HOUR, "the deleter's clock stepped an hour back after the end"),
    ],
)
async def test_a_job_is_kept_for_the_whole_retention_and_deleted_after_it_whatever_the_clocks(
    tmp_path: Path, runner_offset: float, step: float, why: str
) -> None:
    """Skewed either way, or stepped either way: deleted between the retention (3 s) and the
    retention plus one pass of the loop and the watch's delay, never seconds early or an
    hour late."""
    took, skew = await run_until_deleted(tmp_path, runner_offset=runner_offset, step=step)
    print(f"\nCLOCK-SKEW {why}: deleted {took:.2f} s after its end (retention {RETENTION} s)")
    assert abs(abs(skew) - HOUR) < 60, (why, skew)  # the fault was really there
    assert took >= RETENTION - 0.2, f"{why}: deleted {took:.2f} s after its end"
    assert took <= RETENTION + 2.5, f"{why}: still kept {took:.2f} s after its end"


@pytest.mark.timeout(90)
async def test_a_restart_of_the_deleter_neither_resets_nor_forgets_when_it_saw_the_end(
    tmp_path: Path,
) -> None:
    """The deleter restarts halfway through the retention: the job goes at the retention
    counted from the end it saw before the restart (kept in its database), not at once,
    and not a whole retention after the restart."""
    took, _ = await run_until_deleted(tmp_path, runner_offset=-HOUR, restart=True)
    print(f"\nCLOCK-SKEW restart: deleted {took:.2f} s after its end (retention {RETENTION} s)")
    assert RETENTION - 0.2 <= took <= RETENTION + 1.2, took
