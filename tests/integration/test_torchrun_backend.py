"""``torchrun --rdzv-backend=elasticd`` against a real daemon: torch's agents, elasticd's rendezvous.

The daemon is a real ``elasticd serve`` process with a token; the backend
reaches it over ``/store`` as torchrun would. The entry point is found as
installed (``pip install -e .``); where the installed metadata predates it,
a one-file ``*.dist-info`` on ``PYTHONPATH`` declares the same entry point.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import ROOT, script
from tests.e2e.cluster import TOKEN, LocalCluster

pytestmark = pytest.mark.slow

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def wait_until(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll ``predicate`` under a deadline (the backend's state is in another thread)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[LocalCluster]:
    """One real daemon, ``n0``, serving the embedded store."""
    cluster = LocalCluster(tmp_path, lease_ttl=2.0)
    try:
        cluster.start("n0")
        asyncio.run(asyncio.wait_for(cluster.wait_ready("n0"), 30))
        yield cluster
    finally:
        cluster.stop_all()


def store_keys(cluster: LocalCluster, prefix: str) -> dict[str, dict[str, Any]]:
    r = httpx.get(
        f"{cluster.nodes['n0'].url}/store/list",
        params={"prefix": prefix},
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=10,
    )
    r.raise_for_status()
    return {e["key"]: e for e in r.json()["entries"]}


def core(cluster: LocalCluster, run_id: str, name: str, min_nodes: int = 2, **conf: object) -> Any:
    from elasticd.torchrun_backend import TorchrunRendezvous, backend_config

    config = backend_config(
        endpoint=f"127.0.0.1:{cluster.nodes['n0'].port}",
        run_id=run_id,
        min_nodes=min_nodes,
        max_nodes=2,
        local_addr="127.0.0.1",
        conf={"token_file": str(cluster.token_file), "last_call_timeout": 1, **conf},
        environ={},
    )
    return TorchrunRendezvous(config, node=name)


@pytest.mark.timeout(60)
def test_two_backends_form_rounds_reform_and_close(node: LocalCluster) -> None:
    """Two torchrun sides form a round; one re-forming makes the other's num_nodes_waiting 1 (after
    saying it is leaving); a shutdown closes the rendezvous and revokes the lease."""
    a, b = core(node, "r1", "a"), core(node, "r1", "b")
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            ra, rb = pool.submit(a.next_round), pool.submit(b.next_round)
            first = (ra.result(30), rb.result(30))
            assert {r.round for r in first} == {0}
            assert sorted(r.group_rank for r in first) == [0, 1]
            assert first[0].master_addr == "127.0.0.1" and first[0].master_port > 0
            assert (a.num_nodes_waiting(), b.num_nodes_waiting()) == (0, 0)

            ra = pool.submit(a.next_round)  # a's worker failed: torch calls next_rendezvous
            wait_until(lambda: b.num_nodes_waiting() == 1, 10, "b to see the re-formation")
            presence = store_keys(node, "rdzv/r1/m/node/b")["rdzv/r1/m/node/b"]
            assert presence["lease"] is not None
            rb = pool.submit(b.next_round)
            second = (ra.result(30), rb.result(30))
            assert {r.round for r in second} == {1}
            assert (a.num_nodes_waiting(), b.num_nodes_waiting()) == (0, 0)

        a.shutdown()  # torch's launcher calls shutdown() when the run ends: it closes
        wait_until(b.is_closed, 10, "b to see the rendezvous closed")
        assert b.num_nodes_waiting() == 0  # closing is no reason to re-form
        assert "rdzv/r1/m/node/a" not in store_keys(node, "rdzv/r1/m/node/")  # lease revoked
    finally:
        a.shutdown()
        b.shutdown(close=False)


DIES = """
import sys
from elasticd.torchrun_backend import TorchrunRendezvous, backend_config
config = backend_config(endpoint=sys.argv[1], run_id="r2", min_nodes=1, max_nodes=2,
    local_addr="127.0.0.1", conf={"token_file": sys.argv[2], "lease_ttl": 1,
    "last_call_timeout": 30}, environ={})
core = TorchrunRendezvous(config, node="dies")
print("round", core.next_round().round, flush=True)
sys.stdin.read()  # until killed
"""


@pytest.mark.timeout(60)
def test_a_torchrun_killed_without_a_word_is_dropped_when_its_lease_expires(
    node: LocalCluster, tmp_path: Path
) -> None:
    """kill -9 of one torchrun: its lease expires (lease_ttl 1 s), the survivor's watch sees the
    loss at once (num_nodes_waiting 1) and the next round forms without it."""
    survivor = core(node, "r2", "survivor", min_nodes=1, lease_ttl=1)
    with subprocess.Popen(
        [sys.executable, "-c", DIES, f"127.0.0.1:{node.nodes['n0'].port}", str(node.token_file)],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as dies:
        try:
            # Both in the first round, however long the dying one's interpreter takes to
            # start: the survivor joins once it has announced itself. Either the dying one
            # opened the round (its last call, 30 s, waits for the survivor) or the survivor
            # places both at once; the second of max_nodes completes the round.
            wait_until(
                lambda: "rdzv/r2/m/node/dies" in store_keys(node, "rdzv/r2/m/node/"),
                30,
                "the dying torchrun to announce itself",
            )
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                mine = pool.submit(survivor.next_round)
                assert dies.stdout is not None
                assert dies.stdout.readline().split()[0] == "round"
                first = mine.result(30)
            assert first.group_world_size == 2  # both in: the second completed the round
            dies.kill()
            dies.wait(10)
            # Seen by the survivor's watch, without asking for a round: the lease expires at
            # most lease_ttl (1 s) after the kill; the store's notice and the watch's answer
            # after that depend on the machine's load, not on any setting (a loaded 2-core
            # machine took over 3 s), so the bound is this wait's, far below every timeout
            # that could otherwise reveal the loss (last call, join: 600 s).
            wait_until(lambda: survivor.num_nodes_waiting() == 1, 10, "the loss to be seen")
            second = survivor.next_round()
            assert (second.group_world_size, second.group_rank) == (1, 0)
        finally:
            dies.kill()
            survivor.shutdown()


def entry_point_env(tmp_path: Path) -> dict[str, str]:
    """The environment for torchrun: this checkout first, and the entry point declared."""
    paths = [str(ROOT)]
    if "elasticd" not in {e.name for e in entry_points(group="torchrun.handlers")}:
        info = tmp_path / "ep" / "elasticd_torchrun_entry-0.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: elasticd-torchrun-entry\n")
        (info / "entry_points.txt").write_text(
            "[torchrun.handlers]\nelasticd = elasticd.torchrun_backend:create_handler\n"
        )
        paths.append(str(info.parent))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTICD_", "PET_"))}
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def torchrun(
    cluster: LocalCluster, run_id: str, env: dict[str, str], *train: str
) -> subprocess.Popen[str]:
    """One torchrun agent with the elasticd backend, against ``cluster``'s daemon."""
    args = [
        *TORCHRUN,
        "--rdzv-backend=elasticd",
        f"--rdzv-endpoint=127.0.0.1:{cluster.nodes['n0'].port}",
        f"--rdzv-id={run_id}",
        "--nnodes=2:4",
        "--nproc-per-node=1",
        "--max-restarts=2",
        "--monitor-interval=0.1",
        "--rdzv-conf=last_call_timeout=1",
        *train,
    ]
    env = {**env, "ELASTICD_TOKEN_FILE": str(cluster.token_file)}
    return subprocess.Popen(
        args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


#: Rank 1 of the first round crashes; rank 0 of that round runs until its agent stops it for
#: the new round (a minute at most): however long the crash takes to reach the other agent,
#: the survivor is still there to be restarted. Every later round's workers exit 0.
WORKER = """
import json, os, sys, time
env = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
       "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE")}
with open(sys.argv[1], "a") as f:
    f.write(json.dumps(env) + "\\n")
with open(sys.argv[1]) as f:
    first_round = json.loads(f.readline())["MASTER_PORT"] == env["MASTER_PORT"]
crash = sys.argv[2]
if env["RANK"] == "1" and not os.path.exists(crash):
    open(crash, "w").close()
    time.sleep(0.5)
    sys.exit(3)
end = time.monotonic() + (60 if first_round else 1.5)
while time.monotonic() < end:
    time.sleep(0.05)
"""


@pytest.mark.timeout(90)
def test_torchrun_agents_restart_a_crashed_worker_on_the_daemons_rendezvous(
    node: LocalCluster, tmp_path: Path
) -> None:
    """Two torchrun agents on one daemon's store: rank 1 crashes once, torch's agent restarts the
    group in a new round (fresh master port), both exit 0, and the run leaves the rendezvous
    closed with no presence key."""
    notes, crashed = tmp_path / "notes.jsonl", tmp_path / "crashed"
    train = script(tmp_path, "train.py", WORKER)
    env = entry_point_env(tmp_path)
    procs = [torchrun(node, "tr1", env, train, str(notes), str(crashed)) for _ in range(2)]
    outputs = []
    for p in procs:
        out, _ = p.communicate(timeout=75)
        outputs.append(out)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    runs = [json.loads(line) for line in notes.read_text().splitlines()]
    assert crashed.exists()
    first, last = runs[:2], runs[-2:]
    assert sorted(r["RANK"] for r in first) == ["0", "1"]
    assert sorted(r["RANK"] for r in last) == ["0", "1"]
    assert {r["WORLD_SIZE"] for r in runs} == {"2"}
    assert {r["TORCHELASTIC_RUN_ID"] for r in runs} == {"tr1"}
    assert {r["TORCHELASTIC_USE_AGENT_STORE"] for r in runs} == {"False"}
    assert len({(r["MASTER_ADDR"], r["MASTER_PORT"]) for r in first}) == 1
    assert {r["MASTER_PORT"] for r in first}.isdisjoint({r["MASTER_PORT"] for r in last})
    assert "1" in {r["TORCHELASTIC_RESTART_COUNT"] for r in last}  # the crashed side restarted
    keys = store_keys(node, "rdzv/tr1/")
    state = json.loads(base64.b64decode(keys["rdzv/tr1/m/state"]["value"]))
    assert state["closed"] is True and state["round"] >= 1
    assert not [k for k in keys if k.startswith("rdzv/tr1/m/node/")]
    assert store_keys(node, "jobs/tr1/torchrun/1/")  # the agents' store of the second round

    # Operators see the run, read-only: its document, both nodes, and their events.
    with httpx.Client(
        base_url=node.nodes["n0"].url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10
    ) as api:
        assert "tr1" in [j["id"] for j in api.get("/jobs").json()["jobs"]]
        job = api.get("/jobs/tr1").json()
        assert (job["launcher"], job["state"]) == ("torchrun", "SUCCEEDED"), job
        assert job["round"] >= 1 and job["restart_count"] == 1  # one round ended in a crash
        spec = job["spec"]
        assert (spec["entrypoint"], spec["nproc_per_node"], spec["max_restarts"]) == (
            "torchrun",
            1,
            2,
        )
        assert (spec["min_nodes"], spec["max_nodes"]) == (2, 4)
        assert "--rdzv-backend=elasticd" in spec["args"]
        groups = api.get("/jobs/tr1/workers").json()["groups"]
        assert len(groups) == 2 and {g["state"] for g in groups} == {"SUCCEEDED"}
        kinds = [e["kind"] for e in api.get("/jobs/tr1/events", params={"after": 0}).json()]
        assert kinds[0] == "job.submitted" and kinds.count("job.submitted") == 1
        assert kinds.count("rendezvous.complete") >= 4  # two nodes, two rounds
        assert "rendezvous.change" in kinds and "job.state" in kinds
        refused = api.post("/jobs/tr1/cancel", json={})
        assert refused.status_code == 409 and "torchrun" in refused.text


ALWAYS_FAILS = """
import sys
sys.exit(3)
"""


@pytest.mark.timeout(60)
def test_a_run_whose_workers_fail_for_good_ends_failed(node: LocalCluster, tmp_path: Path) -> None:
    """--max-restarts=0 and workers that exit 3: both torchruns fail as torchrun does, and the
    run's document says FAILED with the first failure (recorded at torch's shutdown call)."""
    train = script(tmp_path, "train.py", ALWAYS_FAILS)
    env = entry_point_env(tmp_path)
    procs = [torchrun(node, "tr2", env, "--max-restarts=0", train) for _ in range(2)]
    outputs = [p.communicate(timeout=50)[0] for p in procs]
    assert [p.returncode for p in procs] == [1, 1], "\n".join(o[-3000:] for o in outputs)
    with httpx.Client(
        base_url=node.nodes["n0"].url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10
    ) as api:
        job = api.get("/jobs/tr2").json()
    assert (job["launcher"], job["state"]) == ("torchrun", "FAILED"), job
    reason = job["reason"]
    assert reason.startswith("the workers failed: rank ") and reason.endswith("code 3"), reason


CONTRACT = """
import sys
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError, RendezvousInfo
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

params = RendezvousParameters(
    backend="elasticd", endpoint=sys.argv[1], run_id="contract", min_nodes=1, max_nodes=1,
    token_file=sys.argv[2], last_call_timeout=1,
)
handler = get_rendezvous_handler(params)  # through torch's registry: the entry point
assert handler.get_backend() == "elasticd", handler.get_backend()
assert handler.get_run_id() == "contract"
assert handler.use_agent_store is False
assert not handler.is_closed()
info = handler.next_rendezvous()
assert isinstance(info, RendezvousInfo)
assert (info.rank, info.world_size) == (0, 1), (info.rank, info.world_size)
assert info.bootstrap_store_info.master_addr and info.bootstrap_store_info.master_port > 0
info.store.set("k", b"v")
assert info.store.get("k") == b"v"
assert handler.num_nodes_waiting() == 0
handler.set_closed()
assert handler.is_closed()
try:
    handler.next_rendezvous()
except RendezvousClosedError:
    pass
else:
    raise AssertionError("next_rendezvous after set_closed must raise RendezvousClosedError")
assert handler.shutdown() is True
print("contract ok", flush=True)
"""


@pytest.mark.timeout(90)
def test_torchs_handler_contract_through_its_own_registry(
    node: LocalCluster, tmp_path: Path
) -> None:
    """The cases torch's handler tests check of every handler, asked the way torch's agent asks:
    the handler comes from torch's registry (the entry point); backend and run id, no agent store,
    a first round of one node with a working store and bootstrap info, nobody waiting, set_closed
    then is_closed, next_rendezvous refused once closed, shutdown."""
    endpoint = f"127.0.0.1:{node.nodes['n0'].port}"
    done = subprocess.run(
        [sys.executable, "-c", CONTRACT, endpoint, str(node.token_file)],
        env=entry_point_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=80,
    )
    assert done.returncode == 0 and "contract ok" in done.stdout, done.stdout + done.stderr
