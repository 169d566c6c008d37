"""The fleet scheduler on real daemons, side by side with the ideal schedule (issue 14).

Three figures, each on `elasticd serve` processes on 127.0.0.1 sharing n0's store:

* **burst**: 50 jobs of one worker (a 1 s sleep) submitted at once to a
  3-node x 2-slot cluster: the peak of busy slots (placements seen by
  ``GET /queue``, and the overlap of the jobs' own run intervals), and the
  makespan against the ideal one: ceil(50 / 6) waves of one job's own time
  from placement to end, measured alone on the same cluster first.
* **gangs**: 3 jobs of ``min_nodes = 2`` on 4 one-slot nodes: how many ran
  at once (overlap of their run intervals; the goal is 2).
* **handoff**: one one-slot node, a job that ends by itself and a queued one
  behind it: from the first job's last statement (its worker writes the
  time) to the next job's ``workers.started`` event and to its worker's
  first statement; 10 reps. No polling is involved in the hand-off: the job
  watch wakes the scheduler, the plan watch starts the agent.

Usage::

    .venv/bin/python bench/bench_fleet.py [--quick] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH))

import httpx  # noqa: E402
from _common import machine_info  # noqa: E402

from tests.e2e.cluster import LocalCluster  # noqa: E402

PY = sys.executable
SLEEPER = "import sys, time; time.sleep(float(sys.argv[1]))"
STAMP = (
    "import sys, time\n"
    "open(sys.argv[1], 'a').write(f'first {time.time()}\\n')\n"
    "time.sleep(float(sys.argv[2]))\n"
    "open(sys.argv[1], 'a').write(f'last {time.time()}\\n')\n"
)


async def post(c: httpx.AsyncClient, body: dict[str, Any]) -> None:
    r = await c.post("/jobs", json=body)
    r.raise_for_status()


async def wait_end(c: httpx.AsyncClient, job_id: str, timeout: float = 300) -> dict[str, Any]:
    async with asyncio.timeout(timeout):
        while True:
            job = (await c.get(f"/jobs/{job_id}")).json()
            if job["state"] in ("SUCCEEDED", "FAILED", "CANCELLED"):
                return dict(job)
            await asyncio.sleep(0.1)


def overlap(intervals: list[tuple[float, float]]) -> int:
    """The most intervals open at one instant."""
    points = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    best = now = 0
    for _, step in points:
        now += step
        best = max(best, now)
    return best


async def placed_at(c: httpx.AsyncClient, job_id: str) -> float:
    events = (await c.get(f"/jobs/{job_id}/events")).json()
    return min(e["time"] for e in events if e["kind"] == "job.placed")


async def burst(root: Path, jobs: int) -> dict[str, Any]:
    with LocalCluster(root, slots=2) as cluster:
        await cluster.start_all("n0", "n1", "n2")
        async with cluster.client("n1") as c:
            body = {"entrypoint": PY, "args": ["-c", SLEEPER, "1.0"]}
            await post(c, {"id": "alone", **body})
            alone = await wait_end(c, "alone")
            single = alone["finished_at"] - await placed_at(c, "alone")
            t0 = time.time()
            await asyncio.gather(*(post(c, {"id": f"b{i:03}", **body}) for i in range(jobs)))
            peak_plan = 0
            done: dict[str, dict[str, Any]] = {}
            async with asyncio.timeout(600):
                while len(done) < jobs:
                    placements = (await c.get("/queue")).json()["placements"]
                    peak_plan = max(peak_plan, sum(len(p["nodes"]) for p in placements.values()))
                    page = (await c.get("/jobs", params={"limit": 500})).json()["jobs"]
                    for j in page:
                        if j["id"].startswith("b") and j["state"] in ("SUCCEEDED", "FAILED"):
                            done[j["id"]] = j
                    await asyncio.sleep(0.05)
            makespan = max(j["finished_at"] for j in done.values()) - t0
            ideal = math.ceil(jobs / 6) * single
            runs = [(j["started_at"], j["finished_at"]) for j in done.values()]
            nodes = set()
            for j in done.values():
                view = (await c.get(f"/jobs/{j['id']}/workers")).json()
                nodes |= {g["node"] for g in view["groups"]}
            return {
                "jobs": jobs,
                "succeeded": sum(j["state"] == "SUCCEEDED" for j in done.values()),
                "single_job_s": round(single, 3),
                "makespan_s": round(makespan, 2),
                "ideal_s": round(ideal, 2),
                "ratio_to_ideal": round(makespan / ideal, 3),
                "peak_busy_slots_plan": peak_plan,
                "peak_running_jobs": overlap(runs),
                "nodes_used": sorted(nodes),
            }


async def gangs(root: Path) -> dict[str, Any]:
    with LocalCluster(root, slots=1) as cluster:
        await cluster.start_all("n0", "n1", "n2", "n3")
        async with cluster.client("n2") as c:
            body = {"entrypoint": PY, "args": ["-c", SLEEPER, "2.0"], "min_nodes": 2}
            t0 = time.time()
            await asyncio.gather(*(post(c, {"id": f"g{i}", **body}) for i in range(3)))
            ends = [await wait_end(c, f"g{i}") for i in range(3)]
            return {
                "succeeded": sum(j["state"] == "SUCCEEDED" for j in ends),
                "at_once": overlap([(j["started_at"], j["finished_at"]) for j in ends]),
                "makespan_s": round(max(j["finished_at"] for j in ends) - t0, 2),
            }


async def handoff(root: Path, reps: int) -> dict[str, Any]:
    to_spawn: list[float] = []
    to_first: list[float] = []
    with LocalCluster(root, slots=1) as cluster:
        await cluster.start_all("n0")
        async with cluster.client() as c:
            for rep in range(reps):
                a, b = root / f"a{rep}.txt", root / f"b{rep}.txt"
                await post(
                    c, {"id": f"a{rep}", "entrypoint": PY, "args": ["-c", STAMP, str(a), "0.5"]}
                )
                await post(
                    c, {"id": f"b{rep}", "entrypoint": PY, "args": ["-c", STAMP, str(b), "0"]}
                )
                await wait_end(c, f"b{rep}")
                last_a = float(a.read_text().split("last ")[1])
                first_b = float(b.read_text().split("first ")[1].split()[0])
                events = (await c.get(f"/jobs/b{rep}/events")).json()
                spawned = min(e["time"] for e in events if e["kind"] == "workers.started")
                to_spawn.append(spawned - last_a)
                to_first.append(first_b - last_a)
    return {
        "reps": reps,
        "to_workers_started_ms_p50": round(statistics.median(to_spawn) * 1000, 1),
        "to_workers_started_ms_max": round(max(to_spawn) * 1000, 1),
        "to_first_statement_ms_p50": round(statistics.median(to_first) * 1000, 1),
        "to_first_statement_ms_max": round(max(to_first) * 1000, 1),
    }


async def measure(quick: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        root = Path(tmp)
        for part in ("burst", "gangs", "handoff"):
            (root / part).mkdir()
        return {
            "machine": machine_info(),
            "burst": await burst(root / "burst", 20 if quick else 50),
            "gangs": await gangs(root / "gangs"),
            "handoff": await handoff(root / "handoff", 5 if quick else 10),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="20 jobs in the burst, 5 hand-offs")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    figures = asyncio.run(measure(args.quick))
    figures["loadavg"] = Path("/proc/loadavg").read_text().split()[:3]
    print(json.dumps(figures, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
