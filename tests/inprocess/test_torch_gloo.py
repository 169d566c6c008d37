"""In-process restart of real torch gloo jobs (2 ranks on CPU): raise, process death, hang."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator, Iterator

import pytest

from elasticd.inprocess import report_terminated
from elasticd.store.http import HttpStore
from tests.worker_lib.support import ROOT, store_server

from .support import RankGroup

pytestmark = [pytest.mark.slow, pytest.mark.torch, pytest.mark.timeout(120)]
pytest.importorskip("torch")

SCRIPT = str(ROOT / "examples" / "inprocess_train.py")


@pytest.fixture
def url() -> Iterator[str]:
    """A real store server on loopback."""
    with store_server() as served:
        yield served


@pytest.fixture
async def groups() -> AsyncIterator[list[RankGroup]]:
    """Rank groups started by a test, killed at teardown."""
    started: list[RankGroup] = []
    yield started
    async with asyncio.timeout(20):
        for group in started:
            await group.close()


async def start(groups: list[RankGroup], url: str, world: int, **env: str) -> RankGroup:
    group = RankGroup(url, f"gloo-{time.monotonic_ns()}", world, env)
    groups.append(group)
    await group.start(script=SCRIPT)
    return group


def assert_sums_correct(group: RankGroup, rank: int) -> None:
    for line in group.ranks[rank].fields("allreduce"):
        assert line["sum"] == line["expected"], group.dump()


@pytest.mark.parametrize("world", [2, 4])
async def test_a_raising_rank_restarts_all_ranks_with_a_correct_all_reduce(
    url: str, groups: list[RankGroup], world: int
) -> None:
    """Rank 1 raises at step 3: every rank re-enters with iteration 1, same pid, correct all-reduce."""
    group = await start(groups, url, world, FAULT="raise")
    async with asyncio.timeout(100):
        codes = await group.wait()
    assert codes == [0] * world, group.dump()
    expected = str(world * (world + 1) // 2)
    for r, rank in enumerate(group.ranks):
        enters = rank.fields("enter")
        assert [(e["iteration"], e["world"], e["pid"]) for e in enters] == [
            ("0", str(world), str(rank.proc.pid)),
            ("1", str(world), str(rank.proc.pid)),
        ], group.dump()
        after = [f for f in rank.fields("allreduce") if f["iteration"] == "1"]
        assert len(after) == 6 and all(f["sum"] == expected for f in after)
        assert_sums_correct(group, r)


async def test_a_killed_rank_leaves_the_survivor_with_a_smaller_world(
    url: str, groups: list[RankGroup]
) -> None:
    """Rank 1's process dies; after the daemon's notice rank 0 continues alone (ShiftRanks), all-reducing 1."""
    group = await start(groups, url, 2, FAULT="exit", BARRIER_TIMEOUT="60")
    async with asyncio.timeout(100):
        assert await group.ranks[1].proc.wait() == 3
        async with HttpStore(url) as daemon_store:
            await report_terminated(
                daemon_store, group.job, "restart0", 1, "exited with code 3", exit_code=3
            )
        assert await group.ranks[0].proc.wait() == 0, group.dump()
        await group.wait()
    survivor = group.ranks[0]
    assert [(e["iteration"], e["world"]) for e in survivor.fields("enter")] == [
        ("0", "2"),
        ("1", "1"),
    ]
    assert [f["sum"] for f in survivor.fields("allreduce") if f["iteration"] == "1"] == ["1"] * 6
    assert_sums_correct(group, 0)


async def test_a_hung_rank_fires_soft_then_hard_and_the_survivor_goes_on(
    url: str, groups: list[RankGroup]
) -> None:
    """Rank 1 hangs mid-step: soft timeout (abort wakes rank 0's blocked all-reduce), then hard (SIGTERM)."""
    group = await start(groups, url, 2, FAULT="hang", SOFT_TIMEOUT="2", HARD_TIMEOUT="4")
    async with asyncio.timeout(100):
        codes = await group.wait()
    assert codes == [0, -signal.SIGTERM], group.dump()
    hung = group.ranks[1].err
    soft = next(i for i, line in enumerate(hung) if "soft timeout" in line)
    hard = next(i for i, line in enumerate(hung) if "hard timeout" in line)
    assert soft < hard, group.dump()
    survivor = group.ranks[0]
    assert [(e["iteration"], e["world"]) for e in survivor.fields("enter")] == [
        ("0", "2"),
        ("1", "1"),
    ]
    assert_sums_correct(group, 0)
    [fault] = group.ranks[1].fields("fault")
    [_, back] = survivor.fields("enter")
    # The survivor is back once the hung rank is declared terminated at its hard timeout.
    # (last progress precedes the fault by up to a step and a probe interval)
    assert 3.5 <= float(back["t"]) - float(fault["t"]) < 8.0, group.dump()
