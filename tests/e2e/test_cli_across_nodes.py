"""The `elasticd` CLI against two real daemons: `nodes` lists both, `logs --rank` finds a
global rank on the other node, `logs --node` reads it there, `delete` forgets the job."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import PY, ROOT, script
from tests.e2e.cluster import LocalCluster, follow_until, job_ended

pytestmark = [pytest.mark.slow]

#: Prints its global and local rank, to stdout and (once) to stderr.
SAY_RANK = """
import os, sys
print("rank", os.environ["RANK"], "local", os.environ["LOCAL_RANK"], flush=True)
print("stderr of rank", os.environ["RANK"], file=sys.stderr, flush=True)
"""


def elasticd(cluster: LocalCluster, node: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """`elasticd ARGV` as its own process, talking to ``node`` with the cluster's token."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICD_")}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [sys.executable, "-m", "elasticd", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        env={
            **env,
            "ELASTICD_URL": cluster.nodes[node].url,
            "ELASTICD_TOKEN_FILE": str(cluster.token_file),
        },
    )


async def test_cli_reads_any_ranks_log_through_one_daemon_and_lists_the_nodes(tmp_path):
    """A 2-node job (1 worker each): through n0, `logs --rank R` prints the log of global
    rank R wherever it ran, `--node N --local-rank 0` the same, `nodes` shows both, and
    `delete` forgets the ended job."""
    cluster = LocalCluster(tmp_path)
    try:
        await cluster.start_all("n0", "n1")
        path = script(tmp_path, "say_rank.py", SAY_RANK)
        async with cluster.client("n0") as c:
            spec = {"id": "ranks", "entrypoint": PY, "args": [path], "min_nodes": 2}
            assert (await c.post("/jobs", json=spec)).status_code == 201
            await follow_until(c, "ranks", job_ended, 120)
            assert (await c.get("/jobs/ranks")).json()["state"] == "SUCCEEDED", cluster.logs()
            view = (await c.get("/jobs/ranks/workers")).json()
        where = {g["node"]: g["workers"][0]["rank"] for g in view["groups"]}
        assert sorted(where) == ["n0", "n1"]

        def run(*argv: str) -> subprocess.CompletedProcess[str]:
            return elasticd(cluster, "n0", *argv)

        for node, rank in where.items():
            by_rank = await asyncio.to_thread(run, "logs", "ranks", "--rank", str(rank))
            assert (by_rank.returncode, by_rank.stdout) == (0, f"rank {rank} local 0\n")
            by_node = await asyncio.to_thread(
                run, "logs", "ranks", "--node", node, "--local-rank", "0", "--stream", "stderr"
            )
            assert by_node.stdout == f"stderr of rank {rank}\n", by_node.stderr
        missing = await asyncio.to_thread(run, "logs", "ranks", "--rank", "2")
        assert missing.returncode == 2
        assert "has no rank 2 in its current round (ranks 0-1)" in missing.stderr

        nodes = await asyncio.to_thread(run, "nodes")
        header, *rows = nodes.stdout.splitlines()
        assert header.split()[:3] == ["NAME", "ADDR", "FREE/SLOTS"]
        assert [r.split()[0] for r in rows] == ["n0", "n1"]
        listed = json.loads((await asyncio.to_thread(run, "nodes", "--json")).stdout)
        assert sorted(n["name"] for n in listed) == ["n0", "n1"]

        deleted = await asyncio.to_thread(run, "delete", "ranks")
        assert (deleted.returncode, deleted.stdout) == (
            0,
            "job ranks deleted (its log files stay on disk)\n",
        )
        gone = await asyncio.to_thread(run, "status", "ranks")
        assert gone.returncode == 1 and "(404)" in gone.stderr
    finally:
        cluster.stop_all()
