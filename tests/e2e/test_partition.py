"""A network partition: a daemon in its own network namespace is cut off, then comes back.

The test builds its own hosts: a namespace with a veth pair (10.213.7.1 on
the host side, 10.213.7.2 inside). The store node and one more node stay
outside, listening on the host side of the link; the third node runs inside
the namespace. No traffic leaves these addresses.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import uuid

import pytest

from tests.conftest import PY, ROOT
from tests.e2e.cluster import LocalCluster, follow_until, job_ended, read_notes

pytestmark = [pytest.mark.slow, pytest.mark.torch]
pytest.importorskip("torch")

HOST_IP, NS_IP = "10.213.7.1", "10.213.7.2"


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, timeout=30)


@pytest.fixture
def netns():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        if os.environ.get("CI"):
            pytest.fail("the partition test needs root and iproute2 in CI")
        pytest.skip("needs root and iproute2 (ip netns)")
    tag = uuid.uuid4().hex[:6]
    ns, host_if, ns_if = f"edt{tag}", f"vh{tag}", f"vn{tag}"
    sh("ip", "netns", "add", ns)
    try:
        sh("ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        sh("ip", "link", "set", ns_if, "netns", ns)
        sh("ip", "addr", "add", f"{HOST_IP}/24", "dev", host_if)
        sh("ip", "link", "set", host_if, "up")
        sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{NS_IP}/24", "dev", ns_if)
        sh("ip", "netns", "exec", ns, "ip", "link", "set", ns_if, "up")
        sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        yield ns, host_if, ns_if
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_cut_off_node_is_fenced_and_the_rest_carry_on(netns, tmp_path):
    """Cut the link: the others re-form without the node, which stops its own workers; heal it."""
    ns, host_if, ns_if = netns
    cluster = LocalCluster(tmp_path, lease_ttl=2.0)
    outside = ["--host", "0.0.0.0", "--advertise-addr", HOST_IP]
    try:
        cluster.start("n0", *outside, env={"GLOO_SOCKET_IFNAME": host_if})
        await cluster.wait_ready("n0")
        cluster.store_url = f"http://{HOST_IP}:{cluster.nodes['n0'].port}"
        cluster.start("n1", *outside, env={"GLOO_SOCKET_IFNAME": host_if})
        cluster.start(
            "n2",
            "--host",
            NS_IP,
            "--advertise-addr",
            NS_IP,
            env={"GLOO_SOCKET_IFNAME": ns_if},
            netns=ns,
        )
        await cluster.wait_ready("n1")
        await cluster.wait_ready("n2", via="n0")
        out, hold = tmp_path / "notes.jsonl", tmp_path / "hold"
        async with cluster.client("n0") as c:
            r = await c.post(
                "/jobs",
                json={
                    "id": "part",
                    "entrypoint": PY,
                    "nproc_per_node": 1,
                    "min_nodes": 2,
                    "max_nodes": 3,
                    "termination_grace": 2,
                    "args": [
                        str(ROOT / "examples" / "train_elastic.py"),
                        "--out",
                        str(out),
                        "--hold",
                        str(hold),
                    ],
                },
            )
            assert r.status_code == 201
            await follow_until(c, "part", lambda ev: len(read_notes(out)) >= 3, 120)
            view = (await c.get("/jobs/part/workers")).json()
            cut_pids = [w["pid"] for g in view["groups"] if g["node"] == "n2" for w in g["workers"]]
            assert cut_pids
            sh("ip", "link", "set", host_if, "down")  # the partition
            await follow_until(
                c, "part", lambda ev: [n for n in read_notes(out)[3:] if n["world"] == 2], 60
            )
            # The cut-off node fences itself: its workers stop although nobody can tell it to.
            async with asyncio.timeout(30):
                while any(alive(p) for p in cut_pids):
                    await asyncio.sleep(0.1)
            sh("ip", "link", "set", host_if, "up")  # healed
            hold.touch()
            await follow_until(c, "part", job_ended, 90)
            job = (await c.get("/jobs/part")).json()
            assert job["state"] == "SUCCEEDED", cluster.logs()
            assert job["restart_count"] == 0
            # Once healed, the fenced node publishes what it recorded while cut off.
            await follow_until(
                c,
                "part",
                lambda ev: any(e["kind"] == "agent.fenced" and e["node"] == "n2" for e in ev),
                30,
            )
    finally:
        cluster.stop_all()
