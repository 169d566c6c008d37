"""The node's goodbyes to a round (elasticd.agent.watch.Departure) never outlive the agent.

A store that does not answer (a full disk under the embedded store) must not
hold the agent: the leave and the "leaving" write are bounded where the agent
waits for them, and what is still running then belongs to the agent's task
set, which ends it when the agent ends (issue 24: no leave() task past its owner).
"""

from __future__ import annotations

import asyncio

import pytest

from elasticd.agent import watch
from elasticd.agent.watch import Departure
from elasticd.tasks import TaskSet

pytestmark = pytest.mark.timeout(30)


class Unanswered:
    """A rendezvous whose store never answers: leave() and leaving() hang until cancelled."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.cancelled: list[str] = []

    async def _hang(self, what: str) -> None:
        self.calls.append(what)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.append(what)
            raise

    async def leave(self) -> None:
        await self._hang("leave")

    async def leaving(self, my_round: int) -> None:
        await self._hang(f"leaving {my_round}")


async def test_a_leave_that_hangs_is_bounded_and_ends_with_its_owner(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(watch, "LEAVE_TIMEOUT", 0.05)
    rendezvous = Unanswered()
    tasks = TaskSet("agent test")
    departure = Departure("job", rendezvous, tasks)  # type: ignore[arg-type]
    await departure.leave()  # returns at the bound
    assert rendezvous.calls == ["leave"]
    assert len(tasks) == 1  # still trying, owned by the agent's task set
    await tasks.aclose(grace=0.05)
    assert len(tasks) == 0
    assert rendezvous.cancelled == ["leave"]


async def test_after_the_owner_closed_a_leave_runs_bounded_in_place(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(watch, "LEAVE_TIMEOUT", 0.05)
    rendezvous = Unanswered()
    tasks = TaskSet("agent test")
    await tasks.aclose()
    before = asyncio.all_tasks()
    await Departure("job", rendezvous, tasks).leave()  # type: ignore[arg-type]
    assert rendezvous.cancelled == ["leave"]  # ended by the bound, no task left running
    assert asyncio.all_tasks() <= before


async def test_the_leaving_write_is_awaited_bounded_then_dropped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(watch, "LEAVING_TIMEOUT", 0.05)
    rendezvous = Unanswered()
    tasks = TaskSet("agent test")
    departure = Departure("job", rendezvous, tasks)  # type: ignore[arg-type]
    departure.say_leaving(3)
    departure.say_leaving(3)  # said once per round
    await asyncio.sleep(0)
    await departure.settle(wait=True)
    assert rendezvous.calls == ["leaving 3"]
    assert rendezvous.cancelled == ["leaving 3"]
    assert len(tasks) == 0
