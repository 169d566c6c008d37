"""Is a job's first attempt slowed by its own standbys (issue 27: "the first attempt is never
delayed by its own standbys")?

One ``elasticd serve``; jobs of ``bench/workers/crash_torch.py`` (its first statement is
``import torch``) that do not crash, with and without ``"prewarm": ["torch"]``, alternating,
``--runs`` of each. The figure: the job's submission → the first statement after ``import
torch`` of its first worker (``first``) and of its last (``all``), first attempt. With
prewarm, the standbys for the next attempt start while the workers import torch; on a
machine with fewer cores than workers plus standbys they compete for the CPU.

    PYTHONPATH=$PWD .venv/bin/python bench/bench_first_attempt.py --runs 5
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import (  # noqa: E402 - after the path above
    PYTHON,
    ElasticdServer,
    Stats,
    fmt,
    machine_info,
    md_table,
    scratch,
)

TORCH_WORKER = str(Path(__file__).resolve().parent / "workers" / "crash_torch.py")


def one_job(
    server: ElasticdServer, root: Path, nproc: int, *, prewarm: bool
) -> tuple[float, float]:
    """(submission → first worker's first statement, → last worker's), seconds."""
    job = f"first-{'warm' if prewarm else 'cold'}-{uuid.uuid4().hex[:6]}"
    folder = root / job
    folder.mkdir()
    spec: dict[str, object] = {
        "id": job,
        "entrypoint": PYTHON,
        "args": ["-u", TORCH_WORKER, str(folder), "0", "0"],  # no crash: ends after its init
        "nproc_per_node": nproc,
        "max_restarts": 0,
        "termination_grace": 3,
        "gpu_health_check": False,
    }
    if prewarm:
        spec["prewarm"] = ["torch"]
    submitted = time.time()
    server.submit(spec)
    done = server.wait_terminal(job, 120)
    if done["state"] != "SUCCEEDED":
        raise RuntimeError(f"{job} ended {done['state']}\n{server.diagnose(job)}")
    firsts = sorted(json.loads(p.read_text())["first_stmt"] for p in folder.glob("start-*.json"))
    if len(firsts) != nproc:
        raise RuntimeError(f"{job}: {len(firsts)} of {nproc} workers measured")
    return firsts[0] - submitted, firsts[-1] - submitted


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5, help="jobs of each kind (alternating)")
    p.add_argument("--nproc", type=int, default=2, help="workers per job")
    p.add_argument("--json", help="write every sample here")
    args = p.parse_args(argv)
    load_start = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    got: dict[str, dict[str, list[float]]] = {
        kind: {"first": [], "all": []} for kind in ("cold", "prewarm")
    }
    with scratch("elasticd-bench-first-") as root, ElasticdServer(root, "first") as server:
        one_job(server, root, args.nproc, prewarm=False)  # the page cache warm for both
        for i in range(2 * args.runs):
            prewarm = i % 2 == 1
            first, last = one_job(server, root, args.nproc, prewarm=prewarm)
            kind = "prewarm" if prewarm else "cold"
            got[kind]["first"].append(first)
            got[kind]["all"].append(last)
            print(f"[bench_first_attempt] {kind}: {first * 1000:.0f} / {last * 1000:.0f} ms")
    load_end = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    rows = []
    for kind, figs in got.items():
        a, b = Stats.of(figs["first"], 1000.0), Stats.of(figs["all"], 1000.0)
        rows.append(
            [
                "with prewarm" if kind == "prewarm" else "without",
                f"{fmt(a.p50, 0)} ({fmt(a.min, 0)}–{fmt(a.max, 0)}, n={a.n})",
                f"{fmt(b.p50, 0)} ({fmt(b.min, 0)}–{fmt(b.max, 0)}, n={b.n})",
            ]
        )
    info = {k: v for k, v in machine_info().items() if not k.startswith("loadavg")}
    print(f"load average {load_start} at the start, {load_end} at the end; {info}")
    print(
        md_table(
            [
                f"first attempt, 1 node x {args.nproc}",
                "submit → first worker past `import torch`, p50 ms (min–max)",
                "→ every worker past it",
            ],
            rows,
        )
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"loadavg": [load_start, load_end], **got}))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
