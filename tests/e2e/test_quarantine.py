"""A node that keeps failing is quarantined, and the job goes on without it (issue 37).

Three real daemons on loopback, automatic quarantine at its defaults. Tiny non-torch
workers: the supervisor's mechanics, not torch's, are under test. A worker knows its
node by the daemon it was given (``ELASTICD_URL``).
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import PY, script
from tests.e2e.cluster import LocalCluster, follow_until, job_ended, read_notes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

#: Notes its attempt, then: on the node whose daemon is BAD_URL, dies of SIGBUS (as on a
#: bad page of memory); elsewhere waits for the hold file, and succeeds.
WORKER = """
import json, os, signal, sys, time
out, hold = sys.argv[1], sys.argv[2]
url = os.environ["ELASTICD_URL"]
note = {"url": url, "restart": int(os.environ["TORCHELASTIC_RESTART_COUNT"]),
        "world": int(os.environ["GROUP_WORLD_SIZE"]), "pid": os.getpid()}
with open(out, "a") as f:
    f.write(json.dumps(note) + "\\n")
if url == os.environ["BAD_URL"]:
    time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGBUS)
deadline = time.monotonic() + 120
while not os.path.exists(hold) and time.monotonic() < deadline:
    time.sleep(0.05)
"""


@pytest.fixture
def cluster(tmp_path):
    c = LocalCluster(tmp_path, slots=1)
    try:
        yield c
    finally:
        c.stop_all()


def _nodes_of(view: dict) -> set[str]:
    return {g["node"] for g in view["groups"] if g["workers"]}


async def test_a_node_whose_workers_die_of_sigbus_three_rounds_is_quarantined(cluster, tmp_path):
    """n1's worker dies of SIGBUS at every start. After three rounds (the threshold) n1 is
    quarantined by its own daemon's policy: shown so in /nodes, with the event in the job;
    the job re-forms on the spare n2 (started after the job) without spending a restart for
    that, and succeeds there; n1 takes no further worker."""
    await cluster.start_all("n0", "n1")
    out, hold = tmp_path / "notes.jsonl", tmp_path / "hold"
    worker = script(tmp_path, "worker.py", WORKER)
    bad = cluster.nodes["n1"].url
    async with cluster.client("n0") as c:
        r = await c.post(
            "/jobs",
            json={
                "id": "bus",
                "entrypoint": PY,
                "args": [worker, str(out), str(hold)],
                "nproc_per_node": 1,
                "min_nodes": 2,
                "max_nodes": 2,
                "max_restarts": 10,
                "termination_grace": 2,
                "env": {"BAD_URL": bad},
            },
        )
        assert r.status_code == 201, r.text
        cluster.start("n2")

        def quarantined(events: list[dict]) -> bool:
            return any(e["kind"] == "node.quarantined" for e in events)

        events = await follow_until(c, "bus", quarantined, 150)
        (note,) = [e for e in events if e["kind"] == "node.quarantined"]
        assert "n1" in note["message"], note
        nodes = {n["name"]: n for n in (await c.get("/nodes")).json()}
        assert nodes["n1"]["state"] == "quarantined", nodes
        assert "3 failures attributed" in nodes["n1"]["reason"], nodes["n1"]
        assert nodes["n0"]["state"] == "ready", nodes

        def on_the_spare(_events: list[dict]) -> bool:
            notes = read_notes(out)
            return any(n["url"] == cluster.nodes["n2"].url for n in notes)

        await follow_until(c, "bus", on_the_spare, 90)
        charged = (await c.get("/jobs/bus")).json()["restart_count"]
        nodes = {n["name"]: n for n in (await c.get("/nodes")).json()}
        assert (nodes["n1"]["state"], nodes["n2"]["state"]) == ("quarantined", "ready"), nodes
        hold.touch()
        await follow_until(c, "bus", job_ended, 60)
        job = (await c.get("/jobs/bus")).json()
        view = (await c.get("/jobs/bus/workers")).json()
    assert job["state"] == "SUCCEEDED", cluster.logs()
    # The SIGBUS rounds before the quarantine are charged (at most the threshold); moving
    # off the quarantined node is a membership change: nothing after it is.
    assert 2 <= job["restart_count"] == charged <= 3, job
    assert _nodes_of(view) == {"n0", "n2"}, view
    notes = read_notes(out)
    on_bad = [n for n in notes if n["url"] == bad]
    assert len(on_bad) == 3, json.dumps(notes, indent=1)
    last_bad = max(i for i, n in enumerate(notes) if n["url"] == bad)
    assert all(n["url"] != bad for n in notes[last_bad + 1 :])


async def test_a_failed_health_check_quarantines_before_the_next_round(cluster, tmp_path):
    """n2's operator health check fails: n2 is quarantined at once, before any round runs
    on it, and the job runs on n0 and n1 without spending a restart."""
    sick = tmp_path / "n2.toml"
    check = [PY, "-c", "import sys; print('gpu 3 fell off the bus'); sys.exit(3)"]
    sick.write_text(f"[elasticd]\nhealth_check = {json.dumps(check)}\n")
    cluster.start("n0")
    await cluster.wait_ready("n0")
    cluster.start("n1")
    cluster.start("n2", "--config", str(sick))
    await cluster.wait_ready("n1")
    await cluster.wait_ready("n2")
    out, hold = tmp_path / "notes.jsonl", tmp_path / "hold"
    worker = script(tmp_path, "worker.py", WORKER)
    hold.touch()
    async with cluster.client("n2") as c:
        r = await c.post(
            "/jobs",
            json={
                "id": "sick",
                "entrypoint": PY,
                "args": [worker, str(out), str(hold)],
                "nproc_per_node": 1,
                "min_nodes": 2,
                "max_nodes": 3,
                "max_restarts": 0,
                "env": {"BAD_URL": "none"},
            },
        )
        assert r.status_code == 201, r.text
        events = await follow_until(c, "sick", job_ended, 150)
        job = (await c.get("/jobs/sick")).json()
        nodes = {n["name"]: n for n in (await c.get("/nodes")).json()}
    assert job["state"] == "SUCCEEDED", cluster.logs()
    assert job["restart_count"] == 0, job  # max_restarts 0: a charged check would fail it
    assert nodes["n2"]["state"] == "quarantined", nodes
    assert "gpu 3 fell off the bus" in nodes["n2"]["reason"], nodes["n2"]
    started = {e["node"] for e in events if e["kind"] == "workers.started"}
    assert started == {"n0", "n1"}, events
    assert {n["world"] for n in read_notes(out)} == {2}
    assert any(e["kind"] == "node.quarantined" and "n2" in e["message"] for e in events)
