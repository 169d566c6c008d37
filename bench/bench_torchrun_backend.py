"""torchrun with elasticd's rendezvous against torchrun with its own c10d rendezvous.

The scenario, the same for both backends: two ``torchrun`` agents on
loopback, one worker each (``--nproc-per-node=1``, a tiny script that does
not import torch); rank 1 crashes on its first start (it writes the wall
clock, then ``os._exit(3)``). torch's agent on that node restarts its
group, the other agent sees the re-formation through ``num_nodes_waiting``
and restarts too. Measured: **crash -> every worker of the new round
started** (each worker writes the wall clock as its first statement, so
both figures include the same Python start-up), per run, over ``--runs``
runs, for:

* ``--nnodes=2`` (min = max): both backends complete a round once both
  agents are in;
* ``--nnodes=2:4`` with ``--rdzv-conf last_call_timeout=1``: torch's c10d
  re-rendezvous waits out the last call; elasticd's completes as soon as
  every live node is back.

The elasticd backend talks to one ``elasticd serve`` (its token in a 0600 file, loopback)
started once for all runs; each run has its own ``--rdzv-id``. Both use
``--monitor-interval=0.1``.

Usage: ``python bench/bench_torchrun_backend.py [--runs 5] [--quick] [--json]``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from _common import (
    PYTHON,
    ROOT,
    ElasticdServer,
    Stats,
    fmt,
    free_port,
    md_table,
    new_tag,
    ratio,
    reap_tagged,
    stop_process,
    tagged_env,
    torchrun_path,
)

#: Longest one run may take (a run takes a few seconds).
RUN_TIMEOUT = 60.0

WORKER = """
import os, sys, time
now = time.time()
rank, restart = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
crash = os.path.exists(sys.argv[2]) is False and rank == "1"
with open(sys.argv[1], "a") as f:
    f.write(f"start {rank} {now!r}\\n")
if crash:
    open(sys.argv[2], "w").close()
    time.sleep(0.3)
    with open(sys.argv[1], "a") as f:
        f.write(f"crash {rank} {time.time()!r}\\n")
    os._exit(3)
time.sleep(1.0 if os.path.exists(sys.argv[2]) else 30)
"""


def entry_point_path(root: Path) -> list[str]:
    """PYTHONPATH entries so torchrun finds the backend: the checkout, and (when the installed
    metadata predates it) a one-file dist-info declaring the ``torchrun.handlers`` entry point."""
    paths = [str(ROOT)]
    if "elasticd" not in {e.name for e in entry_points(group="torchrun.handlers")}:
        info = root / "ep" / "elasticd_torchrun_entry-0.dist-info"
        info.mkdir(parents=True, exist_ok=True)
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: elasticd-torchrun-entry\n")
        (info / "entry_points.txt").write_text(
            "[torchrun.handlers]\nelasticd = elasticd.torchrun_backend:create_handler\n"
        )
        paths.append(str(info.parent))
    return paths


def one_run(
    root: Path, backend: str, nnodes: str, run: int, daemon: ElasticdServer | None
) -> float | None:
    """One crash and recovery; seconds from the crash to the last new-round worker's start.

    None when the agents did not finish within ``RUN_TIMEOUT`` (counted and reported as a hang;
    the agents' last lines go to stderr).
    """
    work = root / f"{backend}-{nnodes.replace(':', '_')}-{run}"
    work.mkdir()
    notes, marker = work / "notes.txt", work / "crashed"
    train = work / "train.py"
    train.write_text(WORKER)
    run_id = f"bench-{backend}-{nnodes.replace(':', '_')}-{run}-{os.getpid()}"
    if backend == "elasticd":
        assert daemon is not None
        endpoint = f"127.0.0.1:{daemon.port}"
    else:
        endpoint = f"127.0.0.1:{free_port()}"
    settings = ["last_call_timeout=1"] if ":" in nnodes else []
    if daemon is not None:
        token_file = root / "rdzv-token"
        if not token_file.exists():
            token_file.write_text(daemon.token)
            token_file.chmod(0o600)
        settings.append(f"token_file={token_file}")
    conf = [f"--rdzv-conf={','.join(settings)}"] if settings else []
    argv = [
        torchrun_path(),
        f"--rdzv-backend={backend}",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={run_id}",
        f"--nnodes={nnodes}",
        "--nproc-per-node=1",
        "--max-restarts=1",
        "--monitor-interval=0.1",
        *conf,
        str(train),
        str(notes),
        str(marker),
    ]
    tag = new_tag()
    env = tagged_env(tag, {"PYTHONPATH": os.pathsep.join(entry_point_path(root))})
    procs = []
    try:
        for i in range(2):
            log = (work / f"agent{i}.log").open("wb")
            procs.append(
                subprocess.Popen(
                    argv,
                    cwd=work,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        deadline = time.monotonic() + RUN_TIMEOUT
        codes = [p.wait(timeout=max(0.1, deadline - time.monotonic())) for p in procs]
    except subprocess.TimeoutExpired:
        logs = "\n".join((work / f"agent{i}.log").read_text()[-1500:] for i in range(2))
        print(f"{backend} {nnodes} run {run}: hung for {RUN_TIMEOUT} s\n{logs}", file=sys.stderr)
        return None
    finally:
        for p in procs:
            stop_process(p, grace=5.0)
        reap_tagged(tag)
    if codes != [0, 0]:
        logs = "\n".join((work / f"agent{i}.log").read_text()[-2000:] for i in range(2))
        raise RuntimeError(f"{backend} {nnodes} run {run}: agents exited {codes}\n{logs}")
    lines = [line.split() for line in notes.read_text().splitlines()]
    crashed_at = next(float(t) for kind, _, t in lines if kind == "crash")
    restarted = {}
    for kind, rank, t in lines:
        if kind == "start" and float(t) > crashed_at:
            restarted.setdefault(rank, float(t))
    if sorted(restarted) != ["0", "1"]:
        raise RuntimeError(f"{backend} {nnodes} run {run}: the new round did not start: {lines}")
    return max(restarted.values()) - crashed_at


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="2 runs per configuration")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    runs = 2 if args.quick else args.runs
    results: dict[str, dict[str, Any]] = {}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-torchrun-") as tmp:
        root = Path(tmp)
        with ElasticdServer(root, name="rdzv") as daemon:
            for nnodes in ("2", "2:4"):
                for backend in ("c10d", "elasticd"):
                    samples = [
                        one_run(
                            root, backend, nnodes, run, daemon if backend == "elasticd" else None
                        )
                        for run in range(runs)
                    ]
                    done = [x for x in samples if x is not None]
                    results[f"{backend} --nnodes={nnodes}"] = {
                        "samples_s": done,
                        "hung": len(samples) - len(done),
                        "ms": Stats.of(done, 1000).as_dict(),
                    }
    if args.json:
        print(json.dumps(results, indent=2))
        return
    rows = []
    for nnodes in ("2", "2:4"):
        c10d_run = results[f"c10d --nnodes={nnodes}"]
        ours_run = results[f"elasticd --nnodes={nnodes}"]
        c10d, ours = c10d_run["ms"], ours_run["ms"]
        rows.append(
            [
                f"`--nnodes={nnodes}`" + (" (last call 1 s)" if ":" in nnodes else ""),
                f"{fmt(c10d['p50'], 0)} ({fmt(c10d['min'], 0)}–{fmt(c10d['max'], 0)})",
                f"{fmt(ours['p50'], 0)} ({fmt(ours['min'], 0)}–{fmt(ours['max'], 0)})",
                ratio(c10d["p50"], ours["p50"]),
                f"{c10d_run['hung']} / {ours_run['hung']}",
            ]
        )
    print(f"python {PYTHON}; {runs} runs per configuration; {time.monotonic() - started:.0f} s")
    print("crash -> every worker of the new round started, ms: p50 (min–max)")
    print(
        md_table(
            ["scenario", "torchrun c10d", "torchrun elasticd", "c10d / elasticd", "hung runs"],
            rows,
        )
    )


if __name__ == "__main__":
    main()
