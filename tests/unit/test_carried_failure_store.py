"""The new image of a re-exec records a carried failure past a store that fails for a
moment (hostile review: it was logged and dropped, so a crash across the exec was never
charged), and gives up, raising, only after ``CARRIED_STORE_WAIT``."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from elasticd.errors import StoreError
from elasticd.node.jobs import supervision
from elasticd.node.jobs.supervision import AgentSupervisor


class FlakyDocuments:
    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.edits: list[Any] = []

    async def update(self, job_id: str, *, mutate: Any) -> None:
        if self.failures > 0:
            self.failures -= 1
            raise StoreError("the store is away")
        self.edits.append((job_id, mutate))


def supervisor(documents: FlakyDocuments) -> AgentSupervisor:
    sup = AgentSupervisor.__new__(AgentSupervisor)
    sup.side = SimpleNamespace(documents=documents)  # type: ignore[assignment]
    return sup


async def test_a_store_that_fails_for_a_moment_still_gets_the_failure() -> None:
    docs = FlakyDocuments(failures=3)
    edit = object()
    async with asyncio.timeout(10):
        await supervisor(docs)._update_past_outages("j", edit)  # type: ignore[arg-type]
    assert docs.edits == [("j", edit)]


async def test_a_store_away_past_the_wait_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(supervision, "CARRIED_STORE_WAIT", 0.3)
    docs = FlakyDocuments(failures=1000)
    async with asyncio.timeout(10):
        with pytest.raises(StoreError):
            await supervisor(docs)._update_past_outages("j", object())  # type: ignore[arg-type]
    assert docs.edits == []
