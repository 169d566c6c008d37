"""Issue 16's restart figure: crash -> every replacement worker's first statement, on 1, 2 and 4
nodes, elasticd and torchrun side by side in one run.

The same small worker (``bench/workers/crash_files.py``: no torch, compiled
in well under a millisecond) runs under both. Global rank 1 exits 1 one second into each attempt, ``--crashes``
times per job, writing the time just before ``os._exit``; every worker writes
the time of its own first statement. A sample is one crash -> the last of the
``nodes x nproc`` replacement workers' first statements after it (all
times ``time.time()`` on this one machine).

* **elasticd**: one node is one ``elasticd serve`` with its embedded store,
  alone, as on a single machine (a one-node job restarts early: its round is
  known locally; docs/design.md, "Early restart"); 2 and 4 nodes are four
  daemons on 127.0.0.1 sharing n0's embedded store (the e2e harness), labels
  pinning the job to n0+n1 or to all four. ``max_restarts`` = the crashes.
* **torchrun** 2.13: one agent per node, ``--rdzv-backend=c10d
  --rdzv-endpoint=127.0.0.1:PORT --monitor-interval=0.1``, the rendezvous
  store not shared with the workers (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``),
  as the issue's steering benchmark ran it; on one node also ``--standalone``
  (its own store on a free port), which is what ``torchrun`` users type.

The figure is the ratio torchrun ÷ elasticd of the p50s from the same run.

Issue 27's figures (``--figures torch``, in the same run by default) use
``bench/workers/crash_torch.py``, whose first statement is ``import torch`` and
which initialises a gloo process group: crash → every replacement's statement
after ``import torch``, and crash → every new-round worker past
``init_process_group``, for elasticd without and with ``prewarm: ["torch"]``
(standby interpreters that imported torch while the attempt ran) and torchrun
(c10d), on the same shapes. Rank 1 crashes ``--torch-crash-after`` seconds into
each attempt (after ``init_process_group``): 10 by default, a late crash, the
standbys long past their own import; ``--torch-crash-after 1`` is the early
crash of issue 40 (a bad batch, an OOM at the first step), where a standby is
ready only if it started with the workers (a node with a spare CPU for each)
and the replacement starts cold at once where it is not.

Usage::

    .venv/bin/python bench/bench_restart.py            # 5 crashes per job
    .venv/bin/python bench/bench_restart.py --quick    # 3 crashes
    .venv/bin/python bench/bench_restart.py --json out.json --keep
    .venv/bin/python bench/bench_restart.py --figures torch --crashes 3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH))

from _common import (  # noqa: E402
    PYTHON,
    Deadline,
    ElasticdServer,
    Stats,
    fmt,
    free_port,
    machine_info,
    md_table,
    new_tag,
    reap_tagged,
    scratch,
    signal_group,
    tagged_env,
    torchrun_path,
)
from bench_cluster import Elasticd, crash_times  # noqa: E402

WORKER = str(BENCH / "workers" / "crash_files.py")
TORCH_WORKER = str(BENCH / "workers" / "crash_torch.py")

#: Which daemons a job of N nodes runs on (label rN).
LABELS = {"n0": "r1=1,r2=1,r4=1", "n1": "r2=1,r4=1", "n2": "r4=1", "n3": "r4=1"}

#: (nodes, workers per node) measured.
SHAPES = ((1, 2), (2, 1), (4, 1))


@dataclass(frozen=True)
class Workload:
    """Which worker runs, what its arguments after OUT are, and which times are figures."""

    worker: str = WORKER
    args: tuple[str, ...] = ()
    keys: tuple[str, ...] = ("first_stmt",)
    spec: tuple[tuple[str, Any], ...] = ()
    """Extra job-spec fields for elasticd (``prewarm``)."""

    def argv(self, folder: Path, crashes: int) -> list[str]:
        return [self.worker, str(folder), str(crashes), *self.args]

    def measured(
        self, name: str, folder: Path, workers: int, crashes: int
    ) -> dict[str, list[float]]:
        got = {key: samples(folder, workers, key) for key in self.keys}
        for key, values in got.items():
            if len(values) != crashes:
                raise RuntimeError(f"{name}: {len(values)} of {crashes} restarts measured ({key})")
        return got


#: The no-torch worker of issue 16's figure.
SMALL = Workload()


def torch_workload(crash_after: float, *, prewarm: bool) -> Workload:
    """``crash_torch.py``: after ``import torch``, and the gloo group initialised."""
    return Workload(
        TORCH_WORKER,
        (str(crash_after),),
        ("first_stmt", "pg"),
        (("prewarm", ["torch"]),) if prewarm else (),
    )


class Daemons(Elasticd):
    """The four daemons of ``bench_cluster``, labelled for jobs of 1, 2 and 4 nodes."""

    async def __aenter__(self) -> Daemons:
        try:
            for name, labels in LABELS.items():
                self.start(name, labels)
                if name == "n0":
                    await self.cluster.wait_ready("n0")
            await asyncio.gather(*(self.cluster.wait_ready(n) for n in list(LABELS)[1:]))
        except BaseException:
            self.stop()
            raise
        return self


def samples(folder: Path, workers: int, key: str = "first_stmt") -> list[float]:
    """Per crash: crash -> the last of the ``workers`` times ``key`` (first statements, or
    process groups initialised) that follow it."""
    crashes = crash_times(folder)
    firsts = sorted(json.loads(p.read_text())[key] for p in folder.glob("start-*.json"))
    out = []
    for i, crashed in enumerate(crashes):
        upper = crashes[i + 1] if i + 1 < len(crashes) else float("inf")
        after = [t for t in firsts if crashed < t < upper]
        if len(after) >= workers:
            out.append(after[workers - 1] - crashed)
    return out


async def elasticd_run(
    ed: Daemons, root: Path, nodes: int, nproc: int, crashes: int, load: Workload = SMALL
) -> dict[str, list[float]]:
    job = f"restart-{nodes}x{nproc}-{uuid.uuid4().hex[:6]}"
    folder = root / job
    folder.mkdir()
    argv = ["-u", *load.argv(folder, crashes)]
    spec = ed.spec(
        job,
        argv,
        min_nodes=nodes,
        max_nodes=nodes,
        group=f"r{nodes}",
        max_restarts=crashes,
        nproc_per_node=nproc,
        **dict(load.spec),
    )
    async with ed.client("n0") as c:
        await ed.submit(c, spec)
        state = await ed.until_ended(c, job, 40 + 6 * crashes)
        if state != "SUCCEEDED":
            raise RuntimeError(f"{job} ended {state}")
        events = await ed.events(c, job)
    say_starts(f"elasticd {nodes}x{nproc}", events, crashes)
    return load.measured(job, folder, nodes * nproc, crashes)


def say_starts(what: str, events: list[dict[str, Any]], crashes: int) -> None:
    early = sum(1 for e in events if e["kind"] == "workers.started" and e.get("early"))
    warm = sum(1 for e in events if e["kind"] == "workers.warm_start")
    cold = sum(1 for e in events if e["kind"] == "worker.cold_start")
    line = f"  {what}: {early} of {crashes} restarts started early"
    if warm or cold:
        line += f"; {warm} warm group start(s), {cold} cold worker start(s)"
    print(line, flush=True)


def torchrun_run(
    root: Path,
    nodes: int,
    nproc: int,
    crashes: int,
    *,
    standalone: bool = False,
    load: Workload = SMALL,
) -> dict[str, list[float]]:
    name = f"tr-{'sa' if standalone else 'c10d'}-{nodes}x{nproc}-{uuid.uuid4().hex[:6]}"
    folder = root / name
    folder.mkdir()
    argv = load.argv(folder, crashes)  # torchrun adds "python -u" itself
    rdzv = (
        ["--standalone"]
        if standalone
        else [
            f"--nnodes={nodes}:{nodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{free_port()}",
            f"--rdzv-id={name}",
        ]
    )
    command = [
        torchrun_path(),
        *rdzv,
        f"--nproc-per-node={nproc}",
        "--monitor-interval=0.1",
        f"--max-restarts={crashes}",
        *argv,
    ]
    extra = {"PYTHONUNBUFFERED": "1"}
    if not standalone:
        extra["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    tag = new_tag()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for k in range(nodes):
            with (root / f"{name}-agent{k}.log").open("wb") as log:
                procs.append(
                    subprocess.Popen(
                        command,
                        cwd=ROOT,
                        env=tagged_env(tag, extra),
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        deadline = Deadline(60 + 8 * crashes)
        codes = []
        for p in procs:
            try:
                codes.append(p.wait(timeout=deadline.remaining()))
            except subprocess.TimeoutExpired:
                codes.append(None)
        if codes != [0] * nodes:
            raise RuntimeError(f"{name}: agents exited {codes}; see {root}/{name}-agent0.log")
    finally:
        for p in procs:
            signal_group(p.pid, signal.SIGKILL)
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)
        reap_tagged(tag)
    return load.measured(name, folder, nodes * nproc, crashes)


def elasticd_one_node(
    root: Path, nproc: int, crashes: int, load: Workload = SMALL
) -> dict[str, list[float]]:
    """A one-node job on a daemon of its own (its embedded store on the same node)."""
    job = f"restart-1x{nproc}-{uuid.uuid4().hex[:6]}"
    folder = root / job
    folder.mkdir()
    with ElasticdServer(root, "one-node") as server:
        server.submit(
            {
                "id": job,
                "entrypoint": PYTHON,
                "args": ["-u", *load.argv(folder, crashes)],
                "nproc_per_node": nproc,
                "max_restarts": crashes,
                "termination_grace": 3,
                **dict(load.spec),
            }
        )
        done = server.wait_terminal(job, 40 + 6 * crashes)
        if done["state"] != "SUCCEEDED":
            raise RuntimeError(f"{job} ended {done['state']}\n{server.diagnose(job)}")
        events = server.events(job)
    say_starts(f"elasticd 1x{nproc}", events, crashes)
    return load.measured(job, folder, nproc, crashes)


async def measure(
    root: Path, crashes: int, *, small: bool = True, torch_after: float | None = None
) -> dict[str, Any]:
    """Issue 16's figure (``small``) and, given ``torch_after``, issue 27's torch figures."""
    figures: dict[str, Any] = {}
    loads = {}
    if torch_after is not None:
        loads = {
            "elasticd": torch_workload(torch_after, prewarm=False),
            "elasticd_prewarm": torch_workload(torch_after, prewarm=True),
        }
    for nodes, nproc in SHAPES:
        if nodes != 1:
            continue
        key = f"1x{nproc}"
        if small:
            print(f"[bench_restart] 1 node x {nproc} workers ...", flush=True)
            figures[key] = {
                "elasticd": elasticd_one_node(root, nproc, crashes)["first_stmt"],
                "torchrun": torchrun_run(root, 1, nproc, crashes)["first_stmt"],
                "torchrun_standalone": torchrun_run(root, 1, nproc, crashes, standalone=True)[
                    "first_stmt"
                ],
            }
        if loads:
            print(f"[bench_restart] torch: 1 node x {nproc} workers ...", flush=True)
            torch_rows = figures.setdefault("torch", {})[key] = {
                label: elasticd_one_node(root, nproc, crashes, load)
                for label, load in loads.items()
            }
            torch_rows["torchrun"] = torchrun_run(root, 1, nproc, crashes, load=loads["elasticd"])
    async with Daemons(root) as ed:
        for nodes, nproc in SHAPES:
            if nodes == 1:
                continue
            key = f"{nodes}x{nproc}"
            if small:
                print(f"[bench_restart] {nodes} nodes x {nproc} worker(s) ...", flush=True)
                ed_s = (await elasticd_run(ed, root, nodes, nproc, crashes))["first_stmt"]
                figures[key] = {
                    "elasticd": ed_s,
                    "torchrun": torchrun_run(root, nodes, nproc, crashes)["first_stmt"],
                }
            if loads:
                print(f"[bench_restart] torch: {nodes} nodes x {nproc} worker(s) ...", flush=True)
                rows = figures.setdefault("torch", {})[key] = {}
                for label, load in loads.items():
                    rows[label] = await elasticd_run(ed, root, nodes, nproc, crashes, load)
                rows["torchrun"] = torchrun_run(root, nodes, nproc, crashes, load=loads["elasticd"])
    return figures


def report(figures: dict[str, Any], info: dict[str, str], seconds: float) -> str:
    rows = []
    for key, f in figures.items():
        if key == "torch":
            continue
        ed = Stats.of(f["elasticd"], 1000.0)
        for label in ("torchrun", "torchrun_standalone"):
            if label not in f:
                continue
            tr = Stats.of(f[label], 1000.0)
            how = "c10d, store not shared" if label == "torchrun" else "--standalone"
            nodes, nproc = key.split("x")
            rows.append(
                [
                    f"{nodes} x {nproc}",
                    _cell(ed),
                    f"{_cell(tr)} {how}",
                    f"**{tr.p50 / ed.p50:.1f}×**",
                ]
            )
    head = (
        f"## Restart: crash → every replacement's first statement ({seconds:.0f} s)\n\n"
        f"Machine: {', '.join(f'{k} {v}' for k, v in info.items())}\n\n"
    )
    text = head
    if rows:
        text += md_table(
            ["nodes x workers", "elasticd p50 ms (min–max)", "torchrun p50 ms (min–max)", "ratio"],
            rows,
        )
    for figure, title in (
        ("first_stmt", "crash → every replacement's first statement after `import torch`"),
        ("pg", "crash → every new-round worker has initialised its (gloo) process group"),
    ):
        torch_rows = []
        for key, f in figures.get("torch", {}).items():
            cold, warm, tr = (
                Stats.of(f[k][figure], 1000.0) for k in ("elasticd", "elasticd_prewarm", "torchrun")
            )
            nodes, nproc = key.split("x")
            torch_rows.append(
                [
                    f"{nodes} x {nproc}",
                    _cell(cold),
                    _cell(warm),
                    f"{_cell(tr)} c10d",
                    f"**{tr.p50 / warm.p50:.1f}×**",
                    f"{tr.p50 / cold.p50:.1f}×",
                ]
            )
        if torch_rows:
            text += f"\n\n### {title}\n\n" + md_table(
                [
                    "nodes x workers",
                    "elasticd p50 ms (min–max)",
                    "elasticd prewarm p50 ms",
                    "torchrun p50 ms",
                    "torchrun ÷ prewarm",
                    "torchrun ÷ elasticd",
                ],
                torch_rows,
            )
    return text


def _cell(stats: Stats) -> str:
    return f"{fmt(stats.p50, 1)} ({fmt(stats.min, 1)}–{fmt(stats.max, 1)}, n={stats.n})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="3 crashes per job instead of 5")
    p.add_argument("--crashes", type=int, help="crashes per job")
    p.add_argument("--json", help="write every sample here")
    p.add_argument("--keep", action="store_true", help="keep the scratch folder")
    p.add_argument(
        "--figures",
        default="small,torch",
        help="small (issue 16: a worker without torch), torch (issue 27: after import torch "
        "and after init_process_group, elasticd with and without prewarm); default both",
    )
    p.add_argument(
        "--torch-crash-after",
        type=float,
        default=10.0,
        help="seconds a torch attempt runs before rank 1 crashes: 10 (default) a late crash, "
        "1 an early one (issue 40: a first attempt's standbys start with its workers only "
        "on a node with a spare CPU each, else after their imports; one still importing at "
        "the crash is not waited for)",
    )
    args = p.parse_args(argv)
    which = set(args.figures.split(","))
    crashes = args.crashes or (3 if args.quick else 5)
    started = time.monotonic()
    info = {"loadavg_at_start": " ".join(Path("/proc/loadavg").read_text().split()[:3])}
    with scratch("elasticd-bench-restart-", keep=args.keep) as root:
        if args.keep:
            print(f"[bench_restart] scratch: {root}", flush=True)
        figures = asyncio.run(
            measure(
                root,
                crashes,
                small="small" in which,
                torch_after=args.torch_crash_after if "torch" in which else None,
            )
        )
    info = {**machine_info(), **info}
    info["loadavg_at_end"] = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    print(report(figures, info, time.monotonic() - started))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, "samples_s": figures}, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
