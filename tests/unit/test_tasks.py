"""elasticd.tasks: a race cancels and awaits its losers; no task outlives its owner."""

from __future__ import annotations

import asyncio
import logging

import pytest

from elasticd.tasks import cancel_and_wait, race

pytestmark = pytest.mark.timeout(10)


async def test_the_first_to_finish_wins_and_the_losers_are_finished_before_it_returns():
    cleaned: list[str] = []

    async def slow(name: str) -> str:
        try:
            await asyncio.sleep(60)
        finally:
            await asyncio.sleep(0)  # clean-up that itself awaits
            cleaned.append(name)
        return name

    async def quick() -> str:
        await asyncio.sleep(0.01)
        return "quick"

    before = asyncio.all_tasks()
    assert await race(slow("a"), quick(), slow("b")) == (1, "quick")
    assert sorted(cleaned) == ["a", "b"]  # done before race returned, not later
    assert asyncio.all_tasks() == before


async def test_simultaneous_finishers_resolve_to_the_lowest_index():
    ready = asyncio.Event()
    ready.set()
    assert await race(ready.wait(), ready.wait()) == (0, True)


async def test_the_winners_exception_is_raised_and_the_losers_still_end():
    ended = asyncio.Event()

    async def loser() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            ended.set()

    async def boom() -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        await race(loser(), boom())
    assert ended.is_set()


async def test_a_cancelled_race_cancels_and_awaits_every_contender():
    ended: list[int] = []

    async def contender(i: int) -> None:
        try:
            await asyncio.sleep(60)
        finally:
            ended.append(i)

    before = asyncio.all_tasks()
    task = asyncio.create_task(race(contender(0), contender(1)))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sorted(ended) == [0, 1]
    assert asyncio.all_tasks() - {asyncio.current_task()} <= before


async def test_cancel_and_wait_logs_a_failure_instead_of_losing_it(caplog):
    async def failing() -> None:
        raise OSError("lost")

    task = asyncio.ensure_future(failing())
    await asyncio.sleep(0)  # it fails before it is cancelled
    with caplog.at_level(logging.DEBUG, logger="elasticd.tasks"):
        await cancel_and_wait(task)
    assert "lost" in caplog.text


async def test_a_task_set_keeps_its_tasks_logs_failures_and_closes_them(caplog):
    from elasticd.tasks import TaskSet

    ended = asyncio.Event()

    async def forever() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            ended.set()

    async def failing() -> None:
        raise OSError("disk gone")

    owned = TaskSet("test")
    with caplog.at_level(logging.WARNING, logger="elasticd.tasks"):
        owned.spawn(failing(), name="failing")
        owned.spawn(forever(), name="forever")
        await asyncio.sleep(0.01)
    assert "failing" in caplog.text and "disk gone" in caplog.text
    assert len(owned) == 1  # the failed one is forgotten, the running one kept
    await owned.aclose()
    assert ended.is_set() and len(owned) == 0
    late = forever()
    assert owned.spawn(late) is None  # closed: nothing new outlives the owner


async def test_a_task_set_lets_its_tasks_finish_within_the_grace():
    from elasticd.tasks import TaskSet

    done: list[str] = []

    async def short() -> None:
        await asyncio.sleep(0.05)
        done.append("short")

    owned = TaskSet("test")
    owned.spawn(short())
    await owned.aclose(grace=5)
    assert done == ["short"]
