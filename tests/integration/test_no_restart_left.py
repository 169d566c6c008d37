"""A job with no restart left fails at once: it never says it restarts (issue 41)."""

from __future__ import annotations

import asyncio

import pytest

from tests.conftest import PY, events_of, wait_job

pytestmark = pytest.mark.timeout(60)


async def test_a_crash_with_no_restart_left_fails_without_restarting(client) -> None:
    """With `max_restarts` 0 (`elasticd run`'s default) a crash used to take the job RUNNING
    → RESTARTING ("re-forming the group"), form a second round, then fail. A job of one node
    can lose no participant: the crash is charged at once, and the job goes RUNNING → FAILED."""
    r = await client.post(
        "/jobs",
        json={"entrypoint": PY, "args": ["-c", "import sys; sys.exit(3)"], "max_restarts": 0},
    )
    job = await wait_job(client, r.json()["id"])
    assert (job["state"], job["restart_count"]) == ("FAILED", 0), job
    assert job["reason"].startswith("restart budget spent (0 restarts)"), job
    assert job["error"]["exit_code"] == 3, job
    async with asyncio.timeout(30):  # the agent's end: all it did after the failure is in
        while (events := await events_of(client, job["id"]))[-1]["kind"] != "agent.finished":
            await asyncio.sleep(0.05)
    states = [e["state"] for e in events if e["kind"] == "job.state"]
    assert "RESTARTING" not in states, states
    kinds = [e["kind"] for e in events]
    assert "group.restarting" not in kinds, kinds
    assert kinds.count("rendezvous.complete") == 1, kinds  # no second round
