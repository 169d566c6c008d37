"""An agent task that dies is noticed (issue 12, defect 2: the agent's error path used to raise).

When even the agent's own error handling raises, the task's exception must
not be lost ("Task exception was never retrieved") and the job must not stay
RUNNING with nobody supervising it. It is treated like a crash of the daemon:
the dead agent's workers are stopped, ``agent.crashed`` names the error, and
the job resumes as a new attempt without spending its restart budget; after
``MAX_AGENT_CRASHES`` deaths this node gives the job up, and the job is never
FAILED for it (only its workers or its budget may fail it).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest

from elasticd.agent.agent import JobAgent
from elasticd.node.jobs import MAX_AGENT_CRASHES
from tests.conftest import PY, events_of, script, wait_job

pytestmark = pytest.mark.timeout(90)

#: The first round's worker runs until it is stopped (a minute at most), so it is still
#: running when its agent dies, however fast or slow the machine; a later one exits 0.
FIRST_RUNS_ON = """
import os, time
if os.environ["ELASTICD_ATTEMPT"].startswith("0."):  # <round>.<restart count>
    time.sleep(60)
"""


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
    worker = script(tmp_path, "first_runs_on.py", FIRST_RUNS_ON)
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


async def test_an_agent_that_keeps_dying_is_given_up_by_the_node_never_failing_the_job(
    client: Any, daemon: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every agent dies: after MAX_AGENT_CRASHES the node gives the job up (saying why, naming
    the error); the job is RESTARTING, not FAILED; no agent, worker or slot is left behind."""
    break_agents(monkeypatch, 100)
    out = tmp_path / "pids"
    out.mkdir()
    sleeper = script(
        tmp_path,
        "sleeper.py",
        f"import os, time\nopen(os.path.join({str(out)!r}, str(os.getpid())), 'w').close()\n"
        "time.sleep(60)\n",
    )
    r = await client.post("/jobs", json={"id": "doomed", "entrypoint": PY, "args": [sleeper]})
    assert r.status_code == 201
    async with asyncio.timeout(60):
        while True:
            events = await events_of(client, "doomed")
            crashed = [e for e in events if e["kind"] == "agent.crashed"]
            if len(crashed) == MAX_AGENT_CRASHES and not daemon.jobs.reconciler.crashing:
                break
            await asyncio.sleep(0.1)
    assert "gives the job up" in crashed[-1]["message"], crashed[-1]
    assert "the error path broke too" in crashed[-1]["message"], crashed[-1]
    job = (await client.get("/jobs/doomed")).json()
    assert job["state"] != "FAILED", job
    assert not daemon.jobs.supervisor.agents and not daemon.jobs.supervisor.tasks
    assert "doomed" not in daemon.jobs.reconciler.slots.held
    assert (
        len(daemon.jobs.reconciler.slots.free) == daemon.jobs.reconciler.slots.count
    )  # every slot given back
    for pid in (int(p.name) for p in out.iterdir()):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
