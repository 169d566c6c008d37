"""Replica groups (torchft) on a real daemon: each group is its own gang, a failure
restarts its group only, and the job's state follows ``min_replicas``.

Tiny non-torch workers: each writes its pid and its torchft variables to a file
named after its group and restart, then waits (or fails, as told by a file).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import PY, script

#: A worker of a group: says who it is, then sleeps until stopped; it exits 7 at once
#: while ``<dir>/fail.<group>`` exists.
WORKER = """
import json, os, sys, time
out = sys.argv[1]
group = os.environ["REPLICA_GROUP_ID"]
restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
names = ("REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS", "TORCHFT_LIGHTHOUSE", "ELASTICD_JOB_ID",
         "MASTER_PORT", "WORLD_SIZE", "RANK")
info = {n: os.environ.get(n) for n in names} | {"pid": os.getpid()}
with open(os.path.join(out, f"w.{group}.{restart}.tmp"), "w") as fh:
    json.dump(info, fh)
os.rename(os.path.join(out, f"w.{group}.{restart}.tmp"), os.path.join(out, f"w.{group}.{restart}"))
if os.path.exists(os.path.join(out, f"fail.{group}")):
    sys.exit(7)
while True:
    time.sleep(0.2)
"""


async def until(what: str, check: Any, timeout: float = 30.0, every: float = 0.05) -> Any:
    """Poll ``check()`` (async) under a deadline until it returns something true."""
    async with asyncio.timeout(timeout):
        while True:
            got = await check()
            if got:
                return got
            await asyncio.sleep(every)
    raise AssertionError(what)  # pragma: no cover


def started(out: Path, group: int, restart: int) -> dict[str, Any] | None:
    path = out / f"w.{group}.{restart}"
    return json.loads(path.read_text()) if path.exists() else None


async def job_in(client: httpx.AsyncClient, job_id: str, *states: str) -> dict[str, Any] | None:
    job = (await client.get(f"/jobs/{job_id}")).json()
    return job if job["state"] in states else None


def spec(path: str, out: Path, job_id: str, **extra: Any) -> dict[str, Any]:
    return {
        "id": job_id,
        "entrypoint": PY,
        "args": [path, str(out)],
        "replica_groups": 3,
        "termination_grace": 2,
        **extra,
    }


async def test_a_killed_groups_worker_restarts_only_its_group(client, daemon, tmp_path):
    """3 groups of 1 worker: kill -9 one group's worker, and only that child restarts
    (its restart_count 1); the other two keep their pids, the parent stays RUNNING, and
    the workers route shows all 3 groups, each worker naming its group."""
    lighthouses: list[str] = []

    async def lighthouse(parent: str) -> str:
        lighthouses.append(parent)
        return f"http://127.0.0.1:29510/{parent}"

    daemon.jobs.use_lighthouse(lighthouse)
    out = tmp_path / "out"
    out.mkdir()
    path = script(tmp_path, "worker.py", WORKER)
    r = await client.post("/jobs", json=spec(path, out, "ft"))
    assert r.status_code == 201, r.text
    assert r.json()["launcher"] == "groups"
    again = await client.post("/jobs", json=spec(path, out, "ft"))  # idempotent, as any job
    assert again.status_code == 200 and again.json()["created_at"] == r.json()["created_at"]
    other = await client.post("/jobs", json={"id": "zz.g1", "entrypoint": PY, "args": ["-V"]})
    assert other.status_code == 201  # an ordinary job at an id a parent's group would have
    taken = await client.post("/jobs", json=spec(path, out, "zz"))
    assert taken.status_code == 409 and "zz.g1" in taken.json()["detail"]
    assert (await client.get("/jobs/zz")).status_code == 404  # nothing of it written
    first = [await until(f"group {k} starts", lambda k=k: _started(out, k, 0)) for k in range(3)]
    await until("the parent runs", lambda: job_in(client, "ft", "RUNNING"))
    for k, info in enumerate(first):
        assert info["REPLICA_GROUP_ID"] == str(k)
        assert info["NUM_REPLICA_GROUPS"] == "3"
        assert info["ELASTICD_JOB_ID"] == f"ft.g{k}"
        assert info["TORCHFT_LIGHTHOUSE"] == "http://127.0.0.1:29510/ft"
        assert (info["WORLD_SIZE"], info["RANK"]) == ("1", "0")  # each group its own gang
    assert len({info["MASTER_PORT"] for info in first}) == 3
    assert set(lighthouses) == {"ft"}

    os.kill(first[1]["pid"], signal.SIGKILL)
    again = await until("group 1 restarts", lambda: _started(out, 1, 1))
    child = await until("group 1 runs again", lambda: job_in(client, "ft.g1", "RUNNING"))
    assert child["restart_count"] == 1 and child["replica_group"] == 1
    assert again["pid"] != first[1]["pid"]
    for k in (0, 2):
        assert not (out / f"w.{k}.1").exists()  # never restarted
        os.kill(first[k]["pid"], 0)  # the same process still runs
        assert (await client.get(f"/jobs/ft.g{k}")).json()["restart_count"] == 0
    parent = (await client.get("/jobs/ft")).json()
    assert parent["state"] == "RUNNING"
    assert [(g["group"], g["job"], g["state"]) for g in parent["groups"]] == [
        (k, f"ft.g{k}", "RUNNING") for k in range(3)
    ]
    assert [g["restart_count"] for g in parent["groups"]] == [0, 1, 0]

    async def three_running() -> dict[str, Any] | None:
        view = (await client.get("/jobs/ft/workers")).json()
        running = [g for g in view["groups"] if g["state"] == "HEALTHY"]
        return view if len(running) == 3 else None

    view = await until("all 3 groups shown running", three_running)
    assert sorted(g["replica_group"] for g in view["groups"]) == [0, 1, 2]
    pids = {w["replica_group"]: w["pid"] for g in view["groups"] for w in g["workers"]}
    assert pids == {0: first[0]["pid"], 1: again["pid"], 2: first[2]["pid"]}

    events = (await client.get("/jobs/ft/events")).json()  # the groups' events, merged
    seqs = [e["seq"] for e in events]
    assert seqs == sorted(seqs)
    restarts = [e for e in events if e["kind"] == "group.restarting"]
    assert [(e["job_id"], e["replica_group"]) for e in restarts] == [("ft.g1", 1)]
    assert {e["replica_group"] for e in events if e["job_id"] == "ft.g2"} == {2}

    own = [e["message"] for e in events if e["job_id"] == "ft" and e["kind"] == "job.state"]
    assert own == ["job PENDING -> RUNNING"]  # it never left RUNNING for group 1's restart

    refused = await client.post("/jobs/ft.g1/cancel", json={})
    assert refused.status_code == 409 and "cancel 'ft'" in refused.json()["detail"]
    r = await client.post("/jobs/ft/cancel", json={})
    assert r.status_code == 200
    for k in range(3):
        await until(f"group {k} cancelled", lambda k=k: job_in(client, f"ft.g{k}", "CANCELLED"))
    await until(
        "no worker left", lambda: _all_gone([first[0]["pid"], again["pid"], first[2]["pid"]])
    )
    assert (await client.get("/jobs/ft")).json()["state"] == "CANCELLED"
    assert (await client.delete("/jobs/ft.g0")).status_code == 409
    assert (await client.delete("/jobs/ft")).status_code == 204
    for k in range(3):
        assert (await client.get(f"/jobs/ft.g{k}")).status_code == 404


async def _started(out: Path, group: int, restart: int) -> dict[str, Any] | None:
    return started(out, group, restart)


async def _all_gone(pids: list[int]) -> bool:
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        return False
    return True


async def test_min_replicas_keeps_the_job_running_until_too_few_groups_can(client, tmp_path):
    """A group whose budget is spent leaves the job RUNNING while min_replicas groups
    still run; once fewer can, the job FAILS naming the groups, and the last one is
    ended (no stray process)."""
    out = tmp_path / "out"
    out.mkdir()
    path = script(tmp_path, "worker.py", WORKER)
    (out / "fail.0").touch()  # group 0 fails at once, with no restart left
    body = spec(path, out, "mr", max_restarts=0, min_replicas=2)
    assert (await client.post("/jobs", json=body)).status_code == 201
    await until("group 0 fails", lambda: job_in(client, "mr.g0", "FAILED"))
    first = [await until(f"group {k} starts", lambda k=k: _started(out, k, 0)) for k in (1, 2)]
    parent = await until("the parent runs on 2 groups", lambda: job_in(client, "mr", "RUNNING"))
    assert [g["state"] for g in parent["groups"]] == ["FAILED", "RUNNING", "RUNNING"]

    os.kill(first[0]["pid"], signal.SIGKILL)  # group 1's budget is spent too: 1 of 2 left
    parent = await until("the parent fails", lambda: job_in(client, "mr", "FAILED"))
    assert "fewer than 2 can run" in parent["reason"]
    assert "group 0 (mr.g0) FAILED" in parent["reason"]
    assert "group 1 (mr.g1) FAILED" in parent["reason"]
    assert parent["error"]["message"].startswith("group 0 (mr.g0): ")
    ended = await until("group 2 is ended", lambda: job_in(client, "mr.g2", "CANCELLED"))
    assert "its job mr ended as FAILED" in ended["reason"]
    await until("no worker left", lambda: _all_gone([first[1]["pid"]]))


async def test_a_parent_whose_groups_were_not_written_gets_them(client, daemon, tmp_path):
    """A daemon that died between the parent's write and its groups' leaves a parent
    alone in the store: a daemon writes the missing groups (replicas.created) and the
    job runs."""
    from elasticd.keys import job_key
    from elasticd.models import JobSpec
    from elasticd.node.jobs.groups import children_of
    from elasticd.states import JobState

    out = tmp_path / "out"
    out.mkdir()
    path = script(tmp_path, "worker.py", WORKER)
    job, _ = await daemon.jobs.submit(JobSpec(**spec(path, out, "lost", replica_groups=2)))
    await until("both groups start", lambda: _started(out, 1, 0))
    await client.post("/jobs/lost/cancel", json={})
    await until("group 0 ended", lambda: job_in(client, "lost.g0", "CANCELLED"))
    await until("group 1 ended", lambda: job_in(client, "lost.g1", "CANCELLED"))
    assert (await client.delete("/jobs/lost")).status_code == 204

    # The same parent again, written alone (as a daemon killed after its first write).
    parent = job.model_copy(update={"state": JobState.PENDING, "finished_at": None, "reason": None})
    assert [c.id for c in children_of(parent)] == ["lost.g0", "lost.g1"]
    store = daemon.jobs.store
    assert (
        await store.compare_and_set(job_key("lost"), parent.model_dump_json().encode(), None)
    ).ok
    await until("the parent runs again", lambda: job_in(client, "lost", "RUNNING"))
    kinds = [e["kind"] for e in (await client.get("/jobs/lost/events")).json()]
    assert "replicas.created" in kinds


def test_elasticd_run_runs_every_group_on_its_one_node(tmp_path):
    """``elasticd run --replica-groups 3 --min-replicas 2`` runs the 3 groups side by
    side on its embedded daemon (nproc_per_node 2 each: 6 workers) and succeeds when
    they all have."""
    import subprocess
    import sys

    out = tmp_path / "out"
    out.mkdir()
    body = (
        "import os, sys\n"
        "name = os.environ['REPLICA_GROUP_ID'] + '.' + os.environ['LOCAL_RANK']\n"
        "open(os.path.join(sys.argv[1], name), 'w').write("
        "os.environ['NUM_REPLICA_GROUPS'] + ' ' + os.environ['ELASTICD_JOB_ID'])\n"
    )
    worker = script(tmp_path, "once.py", body)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICD_")}
    env["ELASTICD_ALLOW_ROOT"] = "true"
    done = subprocess.run(
        [sys.executable, "-m", "elasticd", "run", "--replica-groups", "3", "--min-replicas", "2"]
        + ["--nproc-per-node", "2", "--run-id", "cli", "--state-dir", str(tmp_path / "state")]
        + ["--", PY, worker, str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "job cli SUCCEEDED" in done.stderr
    written = {p.name: p.read_text() for p in out.iterdir()}
    assert written == {f"{k}.{r}": f"3 cli.g{k}" for k in range(3) for r in range(2)}


async def test_elasticd_status_shows_the_groups(daemon, tmp_path):
    """``elasticd status P`` names each group's child job, state and restarts."""
    from elasticd.cli_commands import group_lines
    from elasticd.models import JobSpec

    out = tmp_path / "out"
    out.mkdir()
    path = script(tmp_path, "worker.py", WORKER)
    await daemon.jobs.submit(JobSpec(**spec(path, out, "st", replica_groups=2)))
    for k in range(2):
        await until(f"group {k} starts", lambda k=k: _started(out, k, 0))

    async def running() -> Any:
        job = await daemon.jobs.get("st")
        return job if job.state.value == "RUNNING" else None

    job = await until("the parent runs", running)
    lines = dict(group_lines(job))
    assert lines["replica groups"] == "2, at least 2 running"
    assert lines["group 0"].startswith("st.g0 RUNNING, 0 restart(s) on node-a")
    assert lines["group 1"].startswith("st.g1 RUNNING, 0 restart(s)")
    await daemon.jobs.cancel("st")


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_three_groups_spread_over_three_daemons_one_killed(tmp_path):
    """3 groups on 3 daemons of one slot each: one per node. A group's worker killed
    with -9 restarts that group only; then its node lost whole (kill -9 of the daemon and
    its worker) leaves the job RUNNING on the other two, whose workers keep their pids."""
    from tests.e2e.cluster import LocalCluster

    out = tmp_path / "out"
    out.mkdir()
    path = script(tmp_path, "worker.py", WORKER)
    with LocalCluster(tmp_path, slots=1) as cluster:
        await cluster.start_all("n0", "n1", "n2")
        async with cluster.client("n1") as c:
            r = await c.post("/jobs", json=spec(path, out, "wide"))
            assert r.status_code == 201, r.text
            first = [
                await until(f"{k} starts", lambda k=k: _started(out, k, 0), 60) for k in range(3)
            ]
            parent = await until("the parent runs", lambda: job_in(c, "wide", "RUNNING"), 60)
            where = {g["group"]: g["nodes"] for g in parent["groups"]}
            assert sorted(n for nodes in where.values() for n in nodes) == ["n0", "n1", "n2"]

            victim = next(k for k, nodes in where.items() if nodes == ["n2"])
            os.kill(first[victim]["pid"], signal.SIGKILL)
            again = await until("its group restarts", lambda: _started(out, victim, 1), 60)
            child = await until("it runs again", lambda: job_in(c, f"wide.g{victim}", "RUNNING"))
            assert child["restart_count"] == 1
            others = [k for k in range(3) if k != victim]
            for k in others:
                os.kill(first[k]["pid"], 0)
                assert not (out / f"w.{k}.1").exists()
            view = (await c.get("/jobs/wide/workers")).json()
            shown = {w["replica_group"]: w["pid"] for g in view["groups"] for w in g["workers"]}
            assert shown == {k: first[k]["pid"] if k != victim else again["pid"] for k in range(3)}

            cluster.kill9("n2", [again["pid"]])  # the node lost, with everything on it
            await until("the fleet drops n2", lambda: _off(c, f"wide.g{victim}", "n2"), 60)
            parent = (await c.get("/jobs/wide")).json()
            assert parent["state"] == "RUNNING"
            for k in others:
                os.kill(first[k]["pid"], 0)
                got = (await c.get(f"/jobs/wide.g{k}")).json()
                assert (got["state"], got["restart_count"]) == ("RUNNING", 0)
            assert (await c.post("/jobs/wide/cancel", json={})).status_code == 200
            await until("no worker left", lambda: _all_gone([first[k]["pid"] for k in others]), 60)


async def _off(c: httpx.AsyncClient, job_id: str, node: str) -> bool:
    return node not in ((await c.get(f"/jobs/{job_id}")).json()["nodes"] or [])


async def test_a_group_without_its_lighthouse_starts_and_says_why(client, daemon, tmp_path):
    """A Lighthouse that cannot be found leaves TORCHFT_LIGHTHOUSE unset (the group runs
    without one) and says so in a ``lighthouse.missing`` event of the group."""

    async def broken(parent: str) -> str:
        raise OSError(f"no Lighthouse serves {parent}")

    daemon.jobs.use_lighthouse(broken)
    out = tmp_path / "out"
    out.mkdir()
    path = script(tmp_path, "worker.py", WORKER)
    assert (
        await client.post("/jobs", json=spec(path, out, "nl", replica_groups=1))
    ).status_code == 201
    info = await until("the group starts", lambda: _started(out, 0, 0))
    assert info["TORCHFT_LIGHTHOUSE"] is None and info["REPLICA_GROUP_ID"] == "0"
    events = (await client.get("/jobs/nl/events")).json()
    (missing,) = [e for e in events if e["kind"] == "lighthouse.missing"]
    assert missing["job_id"] == "nl.g0" and "no Lighthouse serves nl" in missing["message"]
    assert (await client.post("/jobs/nl/cancel", json={})).status_code == 200
    await until("no worker left", lambda: _all_gone([info["pid"]]))


async def test_a_parents_event_stream_has_its_groups_and_ends_with_it(client):
    """The parent's SSE stream carries its groups' events (each naming its group) and
    ends after the parent's own final job.state, once every group succeeded."""
    body = {"id": "sse", "entrypoint": PY, "args": ["-c", "pass"], "replica_groups": 2}
    assert (await client.post("/jobs", json=body)).status_code == 201
    await until("the job succeeds", lambda: job_in(client, "sse", "SUCCEEDED"))
    headers = {"Accept": "text/event-stream"}
    async with asyncio.timeout(30):
        text = (await client.get("/jobs/sse/events", headers=headers)).text
    events = [
        json.loads(line.removeprefix("data: "))
        for line in text.splitlines()
        if line.startswith("data: {") and '"seq"' in line
    ]
    assert {(e["job_id"], e.get("replica_group")) for e in events} == {
        ("sse", None),
        ("sse.g0", 0),
        ("sse.g1", 1),
    }
    assert text.rstrip().splitlines()[-2] == "event: end"
    assert '"state": "SUCCEEDED"' in text.rstrip().splitlines()[-1]
