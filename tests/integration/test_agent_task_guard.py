"""An agent task that dies is noticed (issue 12, defect 2: the agent's error path used to raise).

When even the agent's own error handling raises, the task's exception must
not be lost ("Task exception was never retrieved") and the job must not stay
RUNNING with nobody supervising it. It is treated like a crash of the daemon:
the dead agent's workers are stopped, ``agent.crashed`` names the error, and
the job resumes as a new attempt without spending its restart budget; an
agent that keeps dying fails the job after ``MAX_AGENT_CRASHES``.
"""

from __future__ import annotations

from typing import Any

import pytest

from elasticd.agent.agent import JobAgent
from elasticd.jobs import MAX_AGENT_CRASHES
from tests.conftest import PY, events_of, script, wait_job

pytestmark = pytest.mark.timeout(90)

#: Exits 0 after a moment, so a first attempt is still running when its agent dies.
SHORT = "import time\ntime.sleep(0.5)\n"


def break_agents(monkeypatch: pytest.MonkeyPatch, times: int) -> None:
    """The first ``times`` agents raise after spawning, and their error path raises too."""
    real_set_state = JobAgent._set_state
    real_stop = JobAgent._stop_workers
    broken: dict[int, bool] = {}
    left = {"n": times}

    def set_state(self: JobAgent, target: Any) -> None:
        real_set_state(self, target)
        if target.name == "HEALTHY" and left["n"] > 0:
            left["n"] -= 1
            broken[id(self)] = True
            raise RuntimeError("boom after the spawn")

    async def stop_workers(self: JobAgent, target: Any) -> None:
        if broken.pop(id(self), False):  # the agent's own error path breaks
            raise RuntimeError("the error path broke too")
        await real_stop(self, target)

    monkeypatch.setattr(JobAgent, "_set_state", set_state)
    monkeypatch.setattr(JobAgent, "_stop_workers", stop_workers)


async def test_a_dead_agent_is_noticed_and_the_job_resumes_without_spending_its_budget(
    client: Any, daemon: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One agent death: its worker stopped, agent.crashed, a new attempt that succeeds."""
    break_agents(monkeypatch, 1)
    worker = script(tmp_path, "short.py", SHORT)
    r = await client.post("/jobs", json={"id": "once", "entrypoint": PY, "args": [worker]})
    assert r.status_code == 201
    job = await wait_job(client, "once", timeout=60)
    assert job["state"] == "SUCCEEDED", job
    assert job["restart_count"] == 0, job
    kinds = [e["kind"] for e in await events_of(client, "once")]
    assert kinds.count("agent.crashed") == 1, kinds
    assert kinds.count("rendezvous.complete") == 2, kinds  # a second attempt, under a new agent
    crashed = kinds.index("agent.crashed")
    assert "workers.stopped" in kinds[:crashed], kinds  # the dead agent's worker was stopped


async def test_an_agent_that_keeps_dying_fails_the_job_naming_the_error(
    client: Any, daemon: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every agent dies: after MAX_AGENT_CRASHES the job is FAILED with the error, not left RUNNING."""
    break_agents(monkeypatch, 100)
    sleeper = script(tmp_path, "sleeper.py", "import time\ntime.sleep(60)\n")
    r = await client.post("/jobs", json={"id": "doomed", "entrypoint": PY, "args": [sleeper]})
    assert r.status_code == 201
    job = await wait_job(client, "doomed", timeout=60)
    assert job["state"] == "FAILED", job
    assert "the error path broke too" in job["reason"], job
    kinds = [e["kind"] for e in await events_of(client, "doomed")]
    assert kinds.count("agent.crashed") == MAX_AGENT_CRASHES, kinds
    assert not daemon.jobs._agents and not daemon.jobs._tasks
