"""An agent task that dies is noticed (issue 12, defect 2: the agent's error path used to raise).

When even the agent's own error handling raises, the task's exception must
not be lost ("Task exception was never retrieved") and the job must not stay
RUNNING with nobody supervising it: the daemon stops the agent's workers,
records ``agent.crashed`` and fails the job naming the error.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from elasticd.agent.agent import JobAgent
from tests.conftest import PY, events_of, script, wait_job

pytestmark = pytest.mark.timeout(60)


async def test_an_agent_whose_error_path_raises_is_noticed_and_its_job_ends(
    client: Any, daemon: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dead agent's worker is stopped, the job FAILED with agent.crashed, never left RUNNING."""
    real_set_state = JobAgent._set_state
    calls = {"n": 0}

    def set_state(self: JobAgent, target: Any) -> None:
        real_set_state(self, target)
        if target.name == "HEALTHY":
            raise RuntimeError("boom after the spawn")

    real_stop = JobAgent._stop_workers

    async def stop_workers(self: JobAgent, target: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 1:  # the agent's own error path breaks
            raise RuntimeError("the error path broke too")
        await real_stop(self, target)

    monkeypatch.setattr(JobAgent, "_set_state", set_state)
    monkeypatch.setattr(JobAgent, "_stop_workers", stop_workers)
    sleeper = script(tmp_path, "sleeper.py", "import time\ntime.sleep(60)\n")
    r = await client.post("/jobs", json={"id": "doomed", "entrypoint": PY, "args": [sleeper]})
    assert r.status_code == 201
    started = time.monotonic()
    job = await wait_job(client, "doomed", timeout=30)
    assert job["state"] == "FAILED", job
    assert "agent" in job["reason"] and "the error path broke too" in job["reason"], job
    assert time.monotonic() - started < 30
    events = await events_of(client, "doomed")
    kinds = [e["kind"] for e in events]
    assert "agent.crashed" in kinds, kinds
    assert "workers.stopped" in kinds, kinds  # the abandoned worker was stopped
    assert not daemon.jobs._agents and not daemon.jobs._tasks
