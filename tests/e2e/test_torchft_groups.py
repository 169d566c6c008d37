"""torchft on elasticd, end to end (issue 39): real daemons, real ``torchft==0.2.0``
Managers on gloo (``examples/torchft_train.py``), elasticd as their Lighthouse.

- one daemon, three groups: a group's worker killed leaves the other groups' pids and steps
  going, and the group rejoins healed (its weights equal its peers' at the same step); a
  re-exec of the daemon during training restarts no group;
- three daemons, one group each: kill -9 of the daemon that leads the job's Lighthouse and
  of its workers: the other groups commit again within the lease TTL plus a heartbeat
  timeout, the quorum ids rise and no quorum is ever of one group.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from elasticd.keys import lighthouse_leader_key
from elasticd.store.codec import decode_entry
from tests.conftest import PY, ROOT
from tests.e2e.cluster import LocalCluster
from tests.e2e.test_inplace_upgrade import reexec

pytest.importorskip("torchft")
pytest.importorskip("grpc")

pytestmark = [pytest.mark.slow, pytest.mark.torch]

TRAIN = str(ROOT / "examples" / "torchft_train.py")
GROUPS = 3
LEASE_TTL = 2.0
HEARTBEAT = 1.0
#: What the daemons' torchft Lighthouse waits for (fast: a test's groups are all local).
LIGHTHOUSE_ENV = {
    "ELASTICD_LIGHTHOUSE_HEARTBEAT_TIMEOUT": str(HEARTBEAT),
    "ELASTICD_LIGHTHOUSE_JOIN_TIMEOUT": "1",
}
#: On a loaded 2-core machine a step of three gloo groups is not 0.05 s: the slack the
#: bound on the stall gets for the machine (the claim is TTL + heartbeat timeout).
SLACK = 4.0


def lines(out: Path, group: int) -> list[dict[str, Any]]:
    path = out / f"g{group}.jsonl"
    if not path.exists():
        return []
    got = []
    for raw in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            got.append(json.loads(raw))
    return got


def full_since(out: Path, group: int, since: float) -> dict[str, Any] | None:
    """The group's first commit after ``since`` in a quorum of every group."""
    return next(
        (x for x in lines(out, group) if x["t"] > since and x["participants"] == GROUPS), None
    )


async def until(what: str, check: Any, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.1)


def spec(job_id: str, out: Path, **extra: Any) -> dict[str, Any]:
    return {
        "id": job_id,
        "entrypoint": PY,
        "args": ["-u", TRAIN, "--steps", "100000", "--step-time", "0.05", "--out", str(out)],
        "env": {"PYTHONPATH": str(ROOT)},
        "cwd": str(ROOT),
        "nproc_per_node": 1,
        "replica_groups": GROUPS,
        "max_restarts": 3,
        "termination_grace": 2,
        **extra,
    }


async def workers_by_group(c: httpx.AsyncClient, job_id: str) -> dict[int, dict[str, Any]]:
    """Each group's running worker (groups of one worker), with its node."""
    r = await c.get(f"/jobs/{job_id}/workers")
    assert r.status_code == 200, r.text
    got = {}
    for group in r.json()["groups"]:
        for w in group["workers"]:
            if w.get("pid") and w["state"] == "HEALTHY":
                got[group["replica_group"]] = {**w, "node": group["node"]}
    return got


async def submit_and_train(c: httpx.AsyncClient, job_id: str, out: Path) -> None:
    """Submit the job and return once every group commits in a quorum of all of them."""
    r = await c.post("/jobs", json=spec(job_id, out))
    assert r.status_code == 201, r.text
    began = time.time()
    for g in range(GROUPS):
        await until(f"group {g} in a full quorum", lambda g=g: full_since(out, g, began), 240)


async def kill_one_group(
    c: httpx.AsyncClient, job_id: str, out: Path, before: dict[int, dict[str, Any]], victim: int
) -> None:
    """kill -9 the group's worker: the others keep their pids and commit without it (a
    quorum one smaller), it comes back in a full quorum, and its weights equal a peer's at
    every step both committed after its return; only its group restarted."""
    others = [g for g in range(GROUPS) if g != victim]
    killed = time.time()
    os.kill(before[victim]["pid"], signal.SIGKILL)
    for g in others:
        await until(
            f"group {g} commits without group {victim}",
            lambda g=g: any(
                x["t"] > killed and x["participants"] == GROUPS - 1 for x in lines(out, g)
            ),
            60,
        )
    back = await until(
        f"group {victim} back in a full quorum", lambda: full_since(out, victim, killed), 240
    )
    assert back["pid"] != before[victim]["pid"]
    peer = others[0]
    await until(
        "a step both committed after the rejoin",
        lambda: (
            {x["step"] for x in lines(out, victim) if x["t"] >= back["t"]}
            & {x["step"] for x in lines(out, peer)}
        ),
        60,
    )
    weights = {x["step"]: x["weights"] for x in lines(out, peer)}
    shared = [x for x in lines(out, victim) if x["t"] >= back["t"] and x["step"] in weights]
    assert shared and all(abs(x["weights"] - weights[x["step"]]) < 1e-6 for x in shared)
    after = await workers_by_group(c, job_id)
    assert all(after[g]["pid"] == before[g]["pid"] for g in others), (before, after)
    groups = {g["group"]: g for g in (await c.get(f"/jobs/{job_id}")).json()["groups"]}
    assert [groups[g]["restart_count"] for g in range(GROUPS)] == [
        int(g == victim) for g in range(GROUPS)
    ], groups


def no_quorum_of_one(out: Path) -> None:
    for group in range(GROUPS):
        small = [x for x in lines(out, group) if x["participants"] < 2]
        assert not small, (group, small[:3])


@pytest.fixture
def cluster(tmp_path):
    c = LocalCluster(tmp_path, lease_ttl=LEASE_TTL, slots=GROUPS)
    try:
        yield c
    finally:
        c.stop_all()


@pytest.mark.timeout(420)
async def test_one_daemon_a_killed_group_rejoins_healed_and_a_reexec_restarts_none(
    cluster, tmp_path
):
    """One daemon, three groups of one worker: kill -9 one group's worker, the others keep
    their pids and commit on (a quorum of 2), the group rejoins and its weights equal its
    peers' at the same step; then a re-exec (SIGHUP) restarts no group."""
    out = tmp_path / "out"
    out.mkdir()
    cluster.start("n0", env=LIGHTHOUSE_ENV)
    await cluster.wait_ready("n0")
    async with cluster.client() as c:
        await submit_and_train(c, "tft", out)
        before = await workers_by_group(c, "tft")
        assert sorted(before) == [0, 1, 2], before
        for w in before.values():
            assert w["replica_group"] is not None

        await kill_one_group(c, "tft", out, before, 2)
        after = await workers_by_group(c, "tft")
        groups = {g["group"]: g for g in (await c.get("/jobs/tft")).json()["groups"]}
        assert [groups[g]["restart_count"] for g in range(GROUPS)] == [0, 0, 1], groups
        parent = (await c.get("/jobs/tft")).json()
        assert parent["state"] == "RUNNING", parent
        # The served quorum names its groups; the rejoin is an event of the job.
        assert parent["quorum"]["leader"] == "n0", parent["quorum"]
        assert parent["quorum"]["quorum_id"] >= 3, parent["quorum"]
        assert parent["quorum"]["groups"] == [0, 1, 2], parent["quorum"]
        events = (await c.get("/jobs/tft/events")).json()
        quorums = [e["message"] for e in events if e["kind"] == "lighthouse.quorum"]
        assert any("left: " in m for m in quorums), quorums
        assert any("joined: " in m and ": 3 replica group(s)" in m for m in quorums), quorums

    # A re-exec during training: the same pids, no restart, commits after it.
    await reexec(cluster, "n0")
    reloaded = time.time()
    async with cluster.client() as c:
        for g in range(GROUPS):
            await until(
                f"group {g} commits after the re-exec", lambda g=g: full_since(out, g, reloaded), 90
            )
        again = await workers_by_group(c, "tft")
        assert {g: w["pid"] for g, w in again.items()} == {g: w["pid"] for g, w in after.items()}
        groups = {g["group"]: g for g in (await c.get("/jobs/tft")).json()["groups"]}
        assert [groups[g]["restart_count"] for g in range(GROUPS)] == [0, 0, 1], groups
        await c.post("/jobs/tft/cancel", json={})
    no_quorum_of_one(out)


@pytest.mark.timeout(420)
async def test_three_daemons_the_lighthouse_leaders_loss_costs_one_bounded_stall(
    tmp_path,
):
    """Three daemons, one group each: kill -9 the daemon that leads the job's Lighthouse
    (and its node's worker): the other two groups commit again within the lease TTL plus
    a heartbeat timeout, quorum ids rise and never go back, no quorum is of one group."""
    out = tmp_path / "out"
    out.mkdir()
    cluster = LocalCluster(tmp_path, lease_ttl=LEASE_TTL, slots=1)
    try:
        # The store on a node of its own: the node lost is the Lighthouse's leader, never
        # the store's host (whose loss is the store's outage, not the Lighthouse's).
        await cluster.start_store("store")
        for name in ("n1", "n2", "n3"):
            cluster.start(name, env=LIGHTHOUSE_ENV)
        await asyncio.gather(*(cluster.wait_ready(n) for n in ("n1", "n2", "n3")))
        async with cluster.client("n1") as c:
            await submit_and_train(c, "tft3", out)
            by_group = await workers_by_group(c, "tft3")
            assert len({w["node"] for w in by_group.values()}) == GROUPS, by_group
            entry = await c.get("/store/kv", params={"key": lighthouse_leader_key("tft3")})
            assert entry.status_code == 200, entry.text
            leader = decode_entry(entry.json()["entry"]).value.decode()
            # First a group's worker on another node: only it restarts, and it rejoins healed.
            lone = next(g for g, w in by_group.items() if w["node"] != leader)
            await kill_one_group(c, "tft3", out, by_group, lone)
            by_group = await workers_by_group(c, "tft3")
        victim = next(g for g, w in by_group.items() if w["node"] == leader)
        survivors = [g for g in range(GROUPS) if g != victim]
        killed = time.time()
        cluster.nodes[leader].proc.send_signal(signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.kill(by_group[victim]["pid"], signal.SIGKILL)
        for g in survivors:
            await until(
                f"group {g} commits after the leader's loss",
                lambda g=g: [x for x in lines(out, g) if x["t"] > killed + LEASE_TTL],
                120,
            )
        for g in survivors:
            times = [x["t"] for x in lines(out, g)]
            last_before = max(t for t in times if t <= killed)
            first_after = min(t for t in times if t > killed)
            stall = first_after - last_before
            assert stall < LEASE_TTL + HEARTBEAT + SLACK, (g, stall)
            ids = [x["quorum"] for x in lines(out, g)]
            assert ids == sorted(ids), ids  # never back
            assert max(ids) > max(x["quorum"] for x in lines(out, g) if x["t"] <= killed)
        no_quorum_of_one(out)
        alive = next(n for n in ("n1", "n2", "n3") if n != leader)
        async with cluster.client(alive) as c:
            parent = (await c.get("/jobs/tft3")).json()
            assert parent["state"] == "RUNNING", parent
            for g in survivors:  # the lone group's one restart was its own kill's
                assert parent["groups"][g]["restart_count"] == int(g == lone), parent["groups"]
            await c.post("/jobs/tft3/cancel", json={})
    finally:
        cluster.stop_all()


@pytest.mark.timeout(300)
def test_the_readme_recipe_runs_three_groups_to_success(tmp_path):
    """The README's torchft recipe as written (its `elasticd run` line, in the tests' venv,
    which has what its `pip install` line installs): three groups train to their last step
    on the embedded daemon, its Lighthouse theirs, and the run ends 0."""
    import subprocess
    import sys

    from tests.normal_user import recipe

    pip, run = recipe("### Per-step fault tolerance (torchft replica groups)").strip().split("\n")
    assert pip.startswith("pip install 'elasticd[torchft]' torchft==0.2.0"), pip
    assert run.startswith("elasticd run --replica-groups 3 "), run
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT)}
    env = {k: v for k, v in env.items() if not k.startswith("ELASTICD_")}
    done = subprocess.run(
        ["bash", "-c", f"set -euo pipefail\n{run} --out {tmp_path}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for g in range(GROUPS):
        last = lines(tmp_path, g)[-1]
        assert last["step"] == 100 and last["participants"] >= 2, last
