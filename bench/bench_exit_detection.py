"""How long after a worker exits does the agent hear of it?

Each run starts a worker group whose workers read the wall clock and call
``os._exit`` straight after, having first written that time to a file
opened in advance; the group's ``on_exit`` callback reads the clock when it
is called. The difference, over many runs, is the exit-detection latency
of :class:`elasticd.supervise.WorkerGroupProcesses`: kernel exit -> child
watcher -> event loop -> callback. ``wait()`` is timed the same way.

For comparison, torch's agent looks at its workers every ``monitor_interval``
(0.1 s by default in current torch), so it notices an exit 50 ms later on
average and up to 100 ms later.

Usage: ``python bench/bench_exit_detection.py [--runs 100] [--workers 1] [--json]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from elasticd.supervise import WorkerExit, WorkerGroupProcesses, WorkerLaunch

# The time is written before os._exit, so the latency below includes that
# one small write (a few microseconds): it errs on the slow side.
CHILD = """
import os, sys, time
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
now = time.time()
os.write(fd, repr(now).encode())
os._exit(0)
"""


async def one_run(root: Path, run: int, workers: int) -> tuple[list[float], float]:
    """Latencies (s) from each worker's exit to its on_exit call, and to wait() returning."""
    called: dict[int, float] = {}

    def on_exit(exit_: WorkerExit) -> None:
        called[exit_.local_rank] = time.time()

    launches = []
    for rank in range(workers):
        log_dir = root / f"run{run}" / str(rank)
        launches.append(
            WorkerLaunch(
                local_rank=rank,
                argv=[sys.executable, "-S", "-c", CHILD, str(log_dir / "exit_time")],
                env=dict(os.environ),
                cwd=None,
                log_dir=log_dir,
            )
        )
    group = await WorkerGroupProcesses.start(launches, on_exit=on_exit)
    async with group:
        result = await group.wait()
        waited = time.time()
    if not result.succeeded:
        raise RuntimeError(f"run {run}: a worker failed: {result.failures}")
    exited = {
        rank: float((root / f"run{run}" / str(rank) / "exit_time").read_text())
        for rank in range(workers)
    }
    return [called[rank] - exited[rank] for rank in range(workers)], waited - max(exited.values())


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), nearest-rank."""
    ordered = sorted(values)
    index = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[index]


async def main_async(runs: int, workers: int) -> dict[str, float | int]:
    on_exit: list[float] = []
    on_wait: list[float] = []
    with tempfile.TemporaryDirectory(prefix="elasticd-bench-") as tmp:
        for run in range(runs):
            latencies, waited = await one_run(Path(tmp), run, workers)
            on_exit.extend(latencies)
            on_wait.append(waited)
    ms = 1000.0
    return {
        "runs": runs,
        "workers_per_run": workers,
        "exits": len(on_exit),
        "on_exit_p50_ms": percentile(on_exit, 50) * ms,
        "on_exit_p99_ms": percentile(on_exit, 99) * ms,
        "on_exit_max_ms": max(on_exit) * ms,
        "on_exit_mean_ms": statistics.fmean(on_exit) * ms,
        "wait_p50_ms": percentile(on_wait, 50) * ms,
        "wait_p99_ms": percentile(on_wait, 99) * ms,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100, help="runs (>= 50 for a stable p99)")
    parser.add_argument("--workers", type=int, default=1, help="workers per run, exiting together")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    stats = asyncio.run(main_async(args.runs, args.workers))
    if args.json:
        print(json.dumps(stats))
    else:
        print(
            f"exit -> on_exit over {stats['exits']} exits "
            f"({stats['runs']} runs x {stats['workers_per_run']} workers): "
            f"p50 {stats['on_exit_p50_ms']:.3f} ms, p99 {stats['on_exit_p99_ms']:.3f} ms, "
            f"max {stats['on_exit_max_ms']:.3f} ms"
        )
        print(
            f"last exit -> wait() returns: p50 {stats['wait_p50_ms']:.3f} ms, "
            f"p99 {stats['wait_p99_ms']:.3f} ms"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
