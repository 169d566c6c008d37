"""In-process restart with tiny torch-free ranks: faults, the daemon's notice, timeouts, spares."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator, Iterator

import pytest

from elasticd.inprocess import report_terminated
from elasticd.store.http import HttpStore
from tests.worker_lib.support import store_server

from .support import RankGroup

pytestmark = pytest.mark.timeout(60)

WORKER = """
    import os, sys, time
    from elasticd.inprocess import CallWrapper, MaxActiveWorldSize, RankShouldRestart, Wrapper

    fault = os.environ.get("FAULT", "none")
    calls = int(os.environ.get("CALLS", "1"))
    fault_rank = int(os.environ.get("FAULT_RANK", "1"))
    spares = int(os.environ.get("ACTIVE", "0"))

    def health(state, exc):
        if exc is not None and fault == "unhealthy" and state.initial_rank == fault_rank:
            raise RuntimeError("ECC errors on GPU 1")

    @Wrapper(
        soft_timeout=float(os.environ.get("SOFT", "1")),
        hard_timeout=float(os.environ.get("HARD", "2")),
        barrier_timeout=10,
        completion_timeout=10,
        last_call_wait=0.05,
        progress_watchdog_interval=0.1,
        termination_grace_time=1,
        max_iterations=int(os.environ.get("MAX_ITERATIONS", "0")) or None,
        abort=None,
        health_check=health,
        rank_filter=MaxActiveWorldSize(spares) if spares else None,
    )
    def train(call: CallWrapper | None = None):
        me = call.state.initial_rank
        print(f"enter iteration={call.iteration} rank={call.rank} world={call.world_size} pid={os.getpid()} t={time.time()}", flush=True)
        started = time.monotonic()
        if call.iteration == 0 and me == fault_rank:
            time.sleep(0.2)
            print(f"fault t={time.time()}", flush=True)
            if fault in ("raise", "unhealthy", "atomic", "always", "swallow"):
                raise ValueError(f"rank {me} fails")
            if fault == "hang":
                time.sleep(10_000)  # stuck in a C call: no bytecode, no progress
            if fault == "exit":
                os._exit(3)
        if call.iteration == 0 and fault == "swallow" and me == 0:
            try:  # as a library with a bare except would: the interruption is lost
                while True:
                    call.ping()
                    time.sleep(0.02)
            except RankShouldRestart:
                print(f"swallowed t={time.time()}", flush=True)
            while True:  # runs on, with no progress
                time.sleep(0.05)
        if fault == "always" and me == fault_rank:
            raise ValueError(f"rank {me} fails every time")
        if call.iteration == 0 and fault == "atomic" and me == 0:
            with call.atomic():
                print("atomic begin", flush=True)
                time.sleep(0.6)
                print(f"atomic end t={time.time()}", flush=True)
        seconds = float(os.environ.get("RUN", "1.5")) if call.iteration == 0 else 0.3
        while time.monotonic() - started < seconds:
            call.ping()
            time.sleep(0.02)
        return call.iteration

    for number in range(calls):
        print(f"result {train()} pid={os.getpid()}", flush=True)
"""


@pytest.fixture
def url() -> Iterator[str]:
    """A real store server on loopback for the ranks (and the test acting as the daemon)."""
    with store_server() as served:
        yield served


@pytest.fixture
async def group_factory(url: str) -> AsyncIterator[list[RankGroup]]:
    """Groups a test starts; whatever still runs is killed at teardown."""
    groups: list[RankGroup] = []
    yield groups
    async with asyncio.timeout(20):
        for group in groups:
            await group.close()


async def run_group(groups: list[RankGroup], url: str, world: int, **env: str) -> RankGroup:
    group = RankGroup(url, f"mech-{len(groups)}-{time.monotonic_ns()}", world, env)
    groups.append(group)
    await group.start(code=WORKER)
    return group


async def test_a_raising_rank_restarts_every_rank_in_the_same_process(
    url: str, group_factory: list[RankGroup]
) -> None:
    """Rank 1 raises: both ranks re-enter the function with iteration 1, in the same processes."""
    group = await run_group(group_factory, url, 2, FAULT="raise")
    async with asyncio.timeout(40):
        codes = await group.wait()
    assert codes == [0, 0], group.dump()
    for rank in group.ranks:
        enters = rank.fields("enter")
        assert [e["iteration"] for e in enters] == ["0", "1"], group.dump()
        assert {e["pid"] for e in enters} == {str(rank.proc.pid)}
        assert enters[1]["world"] == "2"
        assert rank.lines("result") == [f"result 1 pid={rank.proc.pid}"]


async def test_a_dead_rank_reported_by_the_daemon_shrinks_the_world(
    url: str, group_factory: list[RankGroup]
) -> None:
    """Rank 1 dies; once the daemon writes its termination, rank 0 restarts at once with world size 1."""
    group = await run_group(group_factory, url, 2, FAULT="exit", RUN="30")
    async with asyncio.timeout(40):
        assert await group.ranks[1].proc.wait() == 3
        await asyncio.sleep(0.5)
        assert len(group.ranks[0].lines("enter")) == 1, (
            "rank 0 restarted before the daemon said anything"
        )
        async with HttpStore(url) as daemon_store:
            reported = time.time()
            assert await report_terminated(
                daemon_store, group.job, "restart0", 1, "exited with code 3", exit_code=3
            )
        await group.line(0, "enter iteration=1")
        assert await group.ranks[0].proc.wait() == 0
    [first, second] = group.ranks[0].fields("enter")
    assert second["world"] == "1" and second["rank"] == "0" and second["pid"] == first["pid"]
    assert float(second["t"]) - reported < 2.0, group.dump()


async def test_a_hung_rank_gets_the_soft_then_the_hard_timeout(
    url: str, group_factory: list[RankGroup]
) -> None:
    """Rank 1 blocks in a C call: soft timeout (interrupt) fires first, then hard (SIGTERM); rank 0 goes on alone."""
    group = await run_group(group_factory, url, 2, FAULT="hang", RUN="30", SOFT="1", HARD="2")
    async with asyncio.timeout(40):
        codes = await group.wait()
    assert codes == [0, -signal.SIGTERM], group.dump()
    hung = group.ranks[1]
    soft = [i for i, line in enumerate(hung.err) if "soft timeout" in line]
    hard = [i for i, line in enumerate(hung.err) if "hard timeout" in line]
    assert soft and hard and soft[0] < hard[0], group.dump()
    assert [e["world"] for e in group.ranks[0].fields("enter")] == ["2", "1"]
    assert group.ranks[0].lines("result") == [f"result 1 pid={group.ranks[0].proc.pid}"]


async def test_an_interruption_that_did_not_take_is_made_again_at_the_soft_timeout(
    url: str, group_factory: list[RankGroup]
) -> None:
    """Rank 1 raises; rank 0's function swallows the interruption and runs on without
    progress. Its soft timeout interrupts it again (before, a no-op: the iteration counted
    as interrupted already, and the hard timeout killed the rank): both ranks restart in
    their processes and finish with the whole world."""
    group = await run_group(group_factory, url, 2, FAULT="swallow", SOFT="1", HARD="4")
    async with asyncio.timeout(40):
        codes = await group.wait()
    assert codes == [0, 0], group.dump()
    assert group.ranks[0].lines("swallowed"), group.dump()
    assert any("soft timeout" in line for line in group.ranks[0].err), group.dump()
    for rank in group.ranks:
        assert [e["world"] for e in rank.fields("enter")] == ["2", "2"], group.dump()
        assert rank.lines("result") == [f"result 1 pid={rank.proc.pid}"]


async def test_a_failed_health_check_takes_the_rank_out(
    url: str, group_factory: list[RankGroup]
) -> None:
    """After a fault, rank 1's health check fails: it leaves with HealthCheckError, rank 0 continues alone."""
    group = await run_group(group_factory, url, 2, FAULT="unhealthy")
    async with asyncio.timeout(40):
        codes = await group.wait()
    assert codes == [0, 1], group.dump()
    assert any(
        "HealthCheckError: rank 1: health check failed: ECC errors on GPU 1" in line
        for line in group.ranks[1].err
    )
    assert [e["world"] for e in group.ranks[0].fields("enter")] == ["2", "1"]


async def test_a_spare_replaces_a_dead_rank(url: str, group_factory: list[RankGroup]) -> None:
    """With 2 active ranks out of 3, rank 2 waits as a spare and takes over when rank 1 dies."""
    group = await run_group(group_factory, url, 3, FAULT="exit", ACTIVE="2", RUN="30")
    async with asyncio.timeout(40):
        assert await group.ranks[1].proc.wait() == 3
        assert group.ranks[2].lines("enter") == []  # a spare does not run the function
        async with HttpStore(url) as daemon_store:
            await report_terminated(daemon_store, group.job, "restart0", 1, "exited with code 3")
        await group.line(2, "enter iteration=1")
        assert await group.ranks[0].proc.wait() == 0
        assert await group.ranks[2].proc.wait() == 0
    [spare] = group.ranks[2].fields("enter")
    assert spare["rank"] == "1" and spare["world"] == "2"
    assert group.ranks[0].fields("enter")[-1]["world"] == "2"


async def test_an_atomic_section_delays_the_interruption(
    url: str, group_factory: list[RankGroup]
) -> None:
    """Rank 0 is inside call.atomic() when rank 1 fails: the section runs to its end, then rank 0 restarts."""
    group = await run_group(group_factory, url, 2, FAULT="atomic")
    async with asyncio.timeout(40):
        codes = await group.wait()
    assert codes == [0, 0], group.dump()
    first = group.ranks[0]
    assert first.lines("atomic begin") and first.lines("atomic end"), group.dump()
    [fault] = group.ranks[1].fields("fault")
    [end] = first.fields("atomic end")
    assert float(end["t"]) > float(fault["t"])  # the fault came while rank 0 was inside
    assert [e["iteration"] for e in first.fields("enter")] == ["0", "1"]


async def test_max_iterations_stops_a_fault_that_always_comes_back(
    url: str, group_factory: list[RankGroup]
) -> None:
    """A rank that fails every iteration ends the call after max_iterations with RestartError."""
    group = await run_group(group_factory, url, 2, FAULT="always", MAX_ITERATIONS="3", RUN="0.3")
    async with asyncio.timeout(40):
        codes = await group.wait()
    assert codes == [1, 1], group.dump()
    assert [e["iteration"] for e in group.ranks[1].fields("enter")] == ["0", "1", "2"]
    # Rank 0 may learn of a fault before its function starts: it then skips that entry.
    assert {e["iteration"] for e in group.ranks[0].fields("enter")} <= {"0", "1", "2"}
    for rank in group.ranks:
        assert any("RestartError: giving up after 3 iteration(s)" in line for line in rank.err)


async def test_a_second_call_starts_from_the_initial_ranks(
    url: str, group_factory: list[RankGroup]
) -> None:
    """After ranks shifted in a first call, a second call still knows each process's own rank."""
    group = await run_group(group_factory, url, 3, FAULT="exit", FAULT_RANK="0", CALLS="2", RUN="3")
    async with asyncio.timeout(40):
        assert await group.ranks[0].proc.wait() == 3
        async with HttpStore(url) as daemon_store:
            await report_terminated(daemon_store, group.job, "restart0", 0, "exited with code 3")
        codes = [await r.proc.wait() for r in group.ranks[1:]]
        await group.wait()
    assert codes == [0, 0], group.dump()
    for initial, rank in ((1, group.ranks[1]), (2, group.ranks[2])):
        enters = rank.fields("enter")
        # call 1: iteration 0 in the full world, iteration 1 shifted; call 2: shifted from the start
        assert [(e["iteration"], e["world"], e["rank"]) for e in enters] == [
            ("0", "3", str(initial)),
            ("1", "2", str(initial - 1)),
            ("0", "2", str(initial - 1)),
        ], group.dump()
