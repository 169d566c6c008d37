"""Issue #4's multi-node figures for elasticd, side by side with torchrun, in one run.

Three measurements (``--only`` picks some; ``--quick`` runs reduced counts):

``rendezvous``  2 and 4 nodes (and 4 launched with the elastic ``2:4``): from
                the job's POST (elasticd: the daemons already run; every agent
                starts from the job watch) or from launching the torchrun
                agents, to the last worker of the round spawned;
``crash``       4 nodes: a worker exits 1 -> the last replacement worker of
                the next round spawned, on all nodes;
``loss``        3 nodes, elastic ``2:3``, default settings (lease TTL 3 s,
                last call 1 s): ``kill -9`` of one node (its daemon or
                torchrun agent, and its worker) -> the survivors' new workers
                spawned; for torchrun, what its survivors do within a bounded
                wait (``--gloo`` adds the same with a real gloo job);

all on 127.0.0.1. elasticd runs as real ``elasticd serve`` daemons sharing
one store (node ``n0`` serves the embedded store; the others use
``--store-url``), started by ``tests/e2e/cluster.py``'s harness, with labels
so that each job runs on exactly the nodes it is meant for. torchrun runs as
N ``torchrun --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:PORT`` processes,
one per simulated node (the c10d backend's TCPStore is hosted by whichever
agent binds the port first).

Both run the same worker: this file with ``--worker`` (no torch; an
interpreter start of a few tens of ms). Each worker records, in a JSON file,
its rank, world, restart count, parent and the time it was **forked**
(``fork_est``: the time of its first statement minus its CPU time and its
run-queue delay, as ``bench/workers/tick.py`` does), which is the "spawned"
instant for both tools. elasticd's own ``workers.started`` events (the
agent's time stamp right after the fork) are given as a cross-check. All
times are ``time.time()`` on this one machine.

Usage::

    .venv/bin/python bench/bench_cluster.py [--quick] [--only rendezvous,crash,loss]
                                            [--gloo] [--json results.json] [--keep]

Prints a markdown table. Exits 0 when every goal was met, 1 when one was
missed, 2 when a measurement failed (its traceback is printed). Every process
started runs in its own session, is bounded in time, and is killed at the
end (daemons: SIGTERM then SIGKILL; torchrun: its process group; workers:
by the benchmark tag they inherit).
"""

from __future__ import annotations

import os
import sys
import time

# -- the worker (runs under both tools; must start fast, so it comes first) ------------------

_FIRST_STMT = time.time()
_CPU_AT_FIRST = time.clock_gettime(time.CLOCK_THREAD_CPUTIME_ID)
try:
    with open("/proc/self/schedstat", "rb") as _fh:
        _SCHEDSTAT = _fh.read()
except OSError:
    _SCHEDSTAT = b""


def _worker(argv: list[str]) -> None:
    """The benchmark worker. Never returns (``os._exit``).

    ``--mode done``: exit 0 after ``--done-after`` s. ``--mode hold``: run
    until ``--hold FILE`` exists (or SIGTERM), then exit 0. ``--mode crash``:
    while fewer than ``--crashes`` crash files exist in ``--out``, the worker
    of global rank ``--crash-rank`` exits 1 after ``--crash-after`` s (having
    just created ``crash-<i>`` holding the time of its exit) and the others
    wait for SIGTERM; once they all exist, every worker exits 0. Counting
    crash files instead of reading ``TORCHELASTIC_RESTART_COUNT`` works under
    torchrun too, where only the failing node's agent counts a restart. No
    worker lives longer than ``--max-wait`` s.
    """
    import argparse
    import json
    import signal

    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--mode", choices=["done", "hold", "crash"], default="done")
    p.add_argument("--done-after", type=float, default=0.05)
    p.add_argument("--hold")
    p.add_argument("--crashes", type=int, default=0)
    p.add_argument("--crash-rank", type=int, default=1)
    p.add_argument("--crash-after", type=float, default=1.0)
    p.add_argument("--max-wait", type=float, default=120.0)
    args = p.parse_args(argv)
    try:
        run_delay = int(_SCHEDSTAT.split()[1]) / 1e9
        fork_est: float | None = _FIRST_STMT - _CPU_AT_FIRST - run_delay
    except (IndexError, ValueError):
        fork_est = None
    env = os.environ
    rank = int(env.get("RANK", "0"))
    crashes = sum(1 for name in os.listdir(args.out) if name.startswith("crash-"))
    record = {
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "rank": rank,
        "group_rank": int(env.get("GROUP_RANK", "0")),
        "world": int(env.get("WORLD_SIZE", "1")),
        "restart": int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
        "master": f"{env.get('MASTER_ADDR')}:{env.get('MASTER_PORT')}",
        "first_stmt": _FIRST_STMT,
        "fork_est": fork_est,
        "crashes_seen": crashes,
    }
    tmp = os.path.join(args.out, f".start-{os.getpid()}.tmp")
    with open(tmp, "w") as fh:
        json.dump(record, fh)
    os.rename(tmp, os.path.join(args.out, f"start-{os.getpid()}-{_FIRST_STMT:.6f}.json"))
    signal.signal(signal.SIGTERM, lambda *_: os._exit(143))
    deadline = time.monotonic() + args.max_wait
    if args.mode == "done":
        time.sleep(args.done_after)
        os._exit(0)
    if args.mode == "hold":
        assert args.hold, "--mode hold needs --hold FILE"
        while time.monotonic() < deadline:
            if os.path.exists(args.hold):
                os._exit(0)
            time.sleep(0.05)
        os._exit(3)
    if crashes >= args.crashes:  # every crash has happened: this round finishes
        time.sleep(args.done_after)
        os._exit(0)
    if rank == args.crash_rank:
        # The file appears only now, when every worker of the round has counted.
        time.sleep(args.crash_after)
        fd = os.open(
            os.path.join(args.out, f"crash-{crashes}"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644
        )
        os.write(fd, repr(time.time()).encode())
        os._exit(1)
    while time.monotonic() < deadline:
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    os._exit(3)


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    _worker(sys.argv[2:])

# -- the benchmark ----------------------------------------------------------------------------

import argparse  # noqa: E402
import asyncio  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import traceback  # noqa: E402
import uuid  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH))

import httpx  # noqa: E402
from _common import (  # noqa: E402
    PYTHON,
    TAG_VAR,
    Deadline,
    Stats,
    fmt,
    free_port,
    glog_time,
    machine_info,
    md_table,
    new_tag,
    reap_tagged,
    scratch,
    signal_group,
    tagged_env,
    torchrun_path,
)

from tests.e2e.cluster import LocalCluster, job_ended  # noqa: E402

SELF = str(Path(__file__).resolve())
TRAIN = str(ROOT / "examples" / "train_elastic.py")
SECTIONS = ("rendezvous", "crash", "loss")
#: elasticd's default lease TTL (elasticd.node.cluster.DEFAULT_LEASE_TTL); the harness uses 2 s.
LEASE_TTL = 3.0
#: Labels of the four daemons: a job's node_selector picks exactly 2, 3 or 4 of them.
LABELS = {
    "n0": "g2=1,g3=1,g4=1",
    "n1": "g2=1,g3=1,g4=1",
    "n2": "g3=1,g4=1",
    "n3": "g4=1",
}


@dataclass(frozen=True)
class Plan:
    runs: int
    """Rendezvous rounds per configuration and tool."""
    crashes: int
    """Crashes per crash-recovery job (each one a sample)."""
    crash_jobs: int
    """Crash-recovery jobs per tool."""
    loss_runs: int
    """Node-loss runs under elasticd."""
    torchrun_loss_wait: float
    """How long torchrun's survivors are watched after the kill."""
    gloo: bool
    """Also lose a node of a real gloo job (torchrun and elasticd, one run each)."""


FULL = Plan(runs=5, crashes=5, crash_jobs=2, loss_runs=5, torchrun_loss_wait=45.0, gloo=True)
QUICK = Plan(runs=3, crashes=3, crash_jobs=1, loss_runs=2, torchrun_loss_wait=20.0, gloo=False)


@dataclass
class Results:
    machine: dict[str, str]
    plan: dict[str, Any]
    figures: dict[str, Any] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


def ms(values: list[float]) -> dict[str, float | int]:
    return Stats.of(values, 1000.0).as_dict()


# -- worker records -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Start:
    pid: int
    ppid: int
    rank: int
    group_rank: int
    world: int
    restart: int
    fork: float
    """fork_est, or first_stmt when the estimate is unavailable."""


def starts(folder: Path) -> list[Start]:
    out = []
    for path in folder.glob("start-*.json"):
        doc = json.loads(path.read_text())
        out.append(
            Start(
                pid=doc["pid"],
                ppid=doc["ppid"],
                rank=doc["rank"],
                group_rank=doc["group_rank"],
                world=doc["world"],
                restart=doc["restart"],
                fork=doc["fork_est"] if doc.get("fork_est") else doc["first_stmt"],
            )
        )
    return sorted(out, key=lambda s: s.fork)


def crash_times(folder: Path) -> list[float]:
    times = []
    for path in sorted(folder.glob("crash-*"), key=lambda p: int(p.name.split("-")[1])):
        text = path.read_text().strip()
        if text:
            times.append(float(text))
    return times


def recovery_samples(folder: Path, nodes: int) -> list[float]:
    """Per crash: crash time -> the last of the next ``nodes`` worker forks after it."""
    crashes = crash_times(folder)
    all_starts = starts(folder)
    samples = []
    for i, crashed in enumerate(crashes):
        upper = crashes[i + 1] if i + 1 < len(crashes) else float("inf")
        after = [s.fork for s in all_starts if crashed < s.fork < upper]
        if len(after) >= nodes:
            samples.append(after[nodes - 1] - crashed)
    return samples


def worker_cmd(out: Path, mode: str, **options: object) -> list[str]:
    """``-u bench_cluster.py --worker --out OUT --mode MODE ...`` (the interpreter is added)."""
    argv = ["-u", SELF, "--worker", "--out", str(out), "--mode", mode]
    for name, value in options.items():
        argv += ["--" + name.replace("_", "-"), str(value)]
    return argv


def wait_for(check: Callable[[], Any], timeout: float, what: str, interval: float = 0.01) -> Any:
    deadline = Deadline(timeout)
    while True:
        got = check()
        if got:
            return got
        if deadline.expired():
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


async def await_for(
    check: Callable[[], Any], timeout: float, what: str, interval: float = 0.01
) -> Any:
    deadline = Deadline(timeout)
    while True:
        got = check()
        if got:
            return got
        if deadline.expired():
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(interval)


# -- elasticd -------------------------------------------------------------------------------------


class Elasticd:
    """Four daemons on 127.0.0.1 sharing n0's embedded store (the e2e harness)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.tag = new_tag()
        (root / "cluster").mkdir(parents=True, exist_ok=True)
        self.cluster = LocalCluster(root / "cluster", lease_ttl=LEASE_TTL)
        self.spawned = 0

    async def __aenter__(self) -> Elasticd:
        (self.root / "cluster").mkdir(parents=True, exist_ok=True)
        try:
            for name in LABELS:
                self.start(name, LABELS[name])
                if name == "n0":
                    await self.cluster.wait_ready("n0")
            await asyncio.gather(*(self.cluster.wait_ready(n) for n in list(LABELS)[1:]))
        except BaseException:
            self.stop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.stop()

    def start(self, name: str, labels: str) -> None:
        self.cluster.start(name, "--labels", labels, env={TAG_VAR: self.tag})

    def stop(self) -> None:
        try:
            self.cluster.stop_all()
        finally:
            reap_tagged(self.tag)

    def client(self, name: str = "n0") -> httpx.AsyncClient:
        return self.cluster.client(name)

    async def submit(self, c: httpx.AsyncClient, spec: dict[str, Any]) -> float:
        """POST the job; returns the time just before the request was sent."""
        t0 = time.time()
        r = await c.post("/jobs", json=spec)
        if r.status_code != 201:
            raise RuntimeError(f"POST /jobs: {r.status_code} {r.text}")
        return t0

    async def events(self, c: httpx.AsyncClient, job: str) -> list[dict[str, Any]]:
        r = await c.get(f"/jobs/{job}/events", params={"after": 0, "limit": 10000})
        return list(r.json())

    async def until_ended(self, c: httpx.AsyncClient, job: str, timeout: float) -> str:
        deadline = Deadline(timeout)
        after = 0
        seen: list[dict[str, Any]] = []
        while not job_ended(seen):
            if deadline.expired():
                raise TimeoutError(f"job {job} did not end within {timeout:.0f} s")
            wait = max(0.1, min(10.0, deadline.remaining()))
            r = await c.get(f"/jobs/{job}/events", params={"after": after, "wait": wait})
            batch = r.json()
            if batch:
                after = batch[-1]["seq"]
                seen.extend(batch)
        return str((await c.get(f"/jobs/{job}")).json()["state"])

    def spec(
        self,
        job: str,
        argv: list[str],
        *,
        min_nodes: int,
        max_nodes: int,
        group: str,
        **fields: Any,
    ) -> dict[str, Any]:
        return {
            "id": job,
            "entrypoint": PYTHON,
            "args": argv,
            "nproc_per_node": 1,
            "min_nodes": min_nodes,
            "max_nodes": max_nodes,
            "node_selector": {group: "1"},
            "termination_grace": 3,
            "exit_barrier_timeout": 30,
            **fields,
        }


def started_events(events: list[dict[str, Any]], after: float = 0.0) -> list[dict[str, Any]]:
    return [e for e in events if e["kind"] == "workers.started" and e["time"] > after]


async def elasticd_rendezvous(ed: Elasticd, root: Path, plan: Plan) -> dict[str, Any]:
    """POST -> the last worker of the round forked (and -> the last ``workers.started`` event).

    The daemons run already; the POST writes the job document, every
    matching daemon's job watch starts an agent, the agents rendezvous through
    the store and spawn. Configurations: 2 nodes ``2:2``, 4 nodes ``4:4``, 4
    nodes ``2:4`` (four matching daemons); ``runs`` jobs each, one at a time,
    each POSTed to a different daemon. Workers exit 0 at once.
    """
    configs = {"2:2": (2, 2, "g2"), "4:4": (4, 4, "g4"), "2:4 (4 nodes)": (2, 4, "g4")}
    out: dict[str, Any] = {}
    for label, (mn, mx, group) in configs.items():
        forks, events_ = [], []
        n = mx
        for i in range(plan.runs):
            job = f"rdzv-{mn}-{mx}-{i}-{uuid.uuid4().hex[:6]}"
            folder = root / job
            folder.mkdir()
            argv = worker_cmd(folder, "done")
            via = f"n{i % n}"
            async with ed.client(via) as c:
                spec = ed.spec(job, argv, min_nodes=mn, max_nodes=mx, group=group, max_restarts=0)
                t0 = await ed.submit(c, spec)
                state = await ed.until_ended(c, job, 60)
                if state != "SUCCEEDED":
                    raise RuntimeError(f"{job} ended {state}")
                ev = started_events(await ed.events(c, job))
            recs = starts(folder)
            if len(recs) != n or len(ev) != n or {r.world for r in recs} != {n}:
                raise RuntimeError(f"{job}: {len(recs)} workers, {len(ev)} started events")
            forks.append(max(r.fork for r in recs) - t0)
            events_.append(max(e["time"] for e in ev) - t0)
        out[label] = {"fork": ms(forks), "event": ms(events_), "raw_fork_s": forks}
    return out


async def elasticd_crash(ed: Elasticd, root: Path, plan: Plan) -> dict[str, Any]:
    """4 nodes ``4:4``: the crashing worker's exit time -> the 4th replacement worker forked.

    Global rank 1 exits 1, 1 s after it started, ``crashes`` times per job
    (max_restarts = crashes); the crash time is written by the worker just
    before ``os._exit``. The replacements are the first 4 forks after it;
    each is checked to carry the job-wide restart count. Cross-check: the
    last ``workers.started`` event after the crash.
    """
    forks: list[float] = []
    events_: list[float] = []
    for j in range(plan.crash_jobs):
        job = f"crash-{j}-{uuid.uuid4().hex[:6]}"
        folder = root / job
        folder.mkdir()
        argv = worker_cmd(folder, "crash", crashes=plan.crashes, crash_rank=1, crash_after=1.0)
        async with ed.client("n1") as c:
            spec = ed.spec(
                job, argv, min_nodes=4, max_nodes=4, group="g4", max_restarts=plan.crashes
            )
            await ed.submit(c, spec)
            state = await ed.until_ended(c, job, 30 + 6 * plan.crashes)
            if state != "SUCCEEDED":
                raise RuntimeError(f"{job} ended {state}")
            events = await ed.events(c, job)
        crashes = crash_times(folder)
        recs = starts(folder)
        for i, crashed in enumerate(crashes):
            nxt = [r for r in recs if r.fork > crashed][:4]
            if len(nxt) < 4 or {r.restart for r in nxt} != {i + 1}:
                raise RuntimeError(f"{job}: crash {i}: replacements {nxt}")
            forks.append(max(r.fork for r in nxt) - crashed)
            ev = started_events(events, crashed)[:4]
            if len(ev) == 4:
                events_.append(max(e["time"] for e in ev) - crashed)
    return {"fork": ms(forks), "event": ms(events_), "raw_fork_s": forks}


async def elasticd_loss(ed: Elasticd, root: Path, plan: Plan, gloo: bool = False) -> dict[str, Any]:
    """3 nodes ``2:3``: ``kill -9`` of a non-store daemon and its worker -> both survivors' new
    workers forked.

    Default settings: lease TTL 3 s (keep-alive every 1 s), last call 1 s.
    The job (nodes n0 + two more with label g3) holds its workers until a
    file appears. Once all three workers run, one non-store node's daemon and
    its worker get SIGKILL; the figure ends at the later of the survivors'
    two forks of world size 2. Then the job is let finish, and a fresh daemon
    (new name, label g3) replaces the lost one for the next run. With
    ``gloo``, the job is ``examples/train_elastic.py --hold`` (gloo
    all-reduces across the nodes) and the new workers are seen through its
    notes file.
    """
    samples: list[float] = []
    events_: list[float] = []
    runs = 1 if gloo else plan.loss_runs
    for i in range(runs):
        job = f"loss-{'gloo-' if gloo else ''}{i}-{uuid.uuid4().hex[:6]}"
        folder = root / job
        folder.mkdir()
        hold = folder / "hold"
        notes = folder / "notes.jsonl"
        if gloo:
            argv = [TRAIN, "--out", str(notes), "--hold", str(hold), "--hold-limit", "120"]
        else:
            argv = worker_cmd(folder, "hold", hold=hold)
        async with ed.client("n0") as c:
            spec = ed.spec(job, argv, min_nodes=2, max_nodes=3, group="g3", max_restarts=0)
            await ed.submit(c, spec)

            def running(notes: Path = notes, folder: Path = folder) -> bool:
                if gloo:
                    return sum(1 for n in _notes(notes) if n["world"] == 3) >= 3
                return len([r for r in starts(folder) if r.world == 3]) >= 3

            await await_for(running, 90 if gloo else 30, f"{job}: 3 workers running", 0.02)
            view = (await c.get(f"/jobs/{job}/workers")).json()
            groups = [g for g in view["groups"] if g["node"] != "n0"]
            victim = groups[i % len(groups)]
            pids = [w["pid"] for w in victim["workers"] if w.get("pid")]
            await asyncio.sleep(0.5)
            t_kill = time.time()
            ed.cluster.kill9(victim["node"], pids)

            def reformed(
                notes: Path = notes, folder: Path = folder, t_kill: float = t_kill
            ) -> list[float] | None:
                if gloo:
                    # notes are written after init + the first all-reduce; the forks
                    # come from the events (below)
                    new = [n for n in _notes(notes) if n["world"] == 2]
                    return [time.time()] if len(new) >= 2 else None
                new = [r.fork for r in starts(folder) if r.world == 2 and r.fork > t_kill]
                return new if len(new) >= 2 else None

            new = await await_for(reformed, 60, f"{job}: the survivors' new workers", 0.02)
            ev = started_events(await ed.events(c, job), t_kill)
            if len(ev) >= 2:
                events_.append(max(e["time"] for e in ev[:2]) - t_kill)
            samples.append((new[0] if gloo else max(new[:2])) - t_kill)
            hold.touch()
            state = await ed.until_ended(c, job, 60)
            if state != "SUCCEEDED":
                raise RuntimeError(f"{job} ended {state}")
        if i + 1 < runs or not gloo:
            name = f"r{ed.spawned}"
            ed.spawned += 1
            ed.start(name, "g3=1")
            await ed.cluster.wait_ready(name)
    if gloo:
        return {"event": ms(events_), "first_allreduce": ms(samples)}
    return {"fork": ms(samples), "event": ms(events_), "raw_fork_s": samples}


def _notes(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


# -- torchrun ----------------------------------------------------------------------------------------


class Torchruns:
    """N torchrun agents launched together, each in its own session, with INFO logs."""

    def __init__(self, root: Path, name: str, nnodes: str, count: int, argv: list[str], **kw: Any):
        self.root = root
        self.name = name
        self.tag = new_tag()
        self.port = free_port()
        self.count = count
        self.logs = [root / f"{name}-agent{k}.log" for k in range(count)]
        self.argv = [
            torchrun_path(),
            f"--nnodes={nnodes}",
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{self.port}",
            f"--rdzv-id={name}-{uuid.uuid4().hex[:6]}",
            f"--max-restarts={kw.get('max_restarts', 0)}",
            *argv,
        ]
        self.procs: list[subprocess.Popen[bytes]] = []
        self.launched = 0.0

    def __enter__(self) -> Torchruns:
        env = tagged_env(self.tag, {"LOGLEVEL": "INFO", "PYTHONUNBUFFERED": "1"})
        self.launched = time.time()
        try:
            for log in self.logs:
                with log.open("wb") as fh:
                    self.procs.append(
                        subprocess.Popen(
                            self.argv,
                            cwd=ROOT,
                            env=env,
                            stdin=subprocess.DEVNULL,
                            stdout=fh,
                            stderr=subprocess.STDOUT,
                            start_new_session=True,
                        )
                    )
        except BaseException:
            self.kill()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()

    def wait(self, timeout: float) -> list[int | None]:
        deadline = Deadline(timeout)
        codes: list[int | None] = []
        for p in self.procs:
            try:
                codes.append(p.wait(timeout=deadline.remaining()))
            except subprocess.TimeoutExpired:
                codes.append(None)
        return codes

    def kill(self) -> None:
        for p in self.procs:
            signal_group(p.pid, signal.SIGKILL)
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)
        reap_tagged(self.tag)

    def log_times(self, needle: str) -> list[float | None]:
        """Per agent: the time of its first log line containing ``needle``."""
        out: list[float | None] = []
        for log in self.logs:
            found = None
            for line in log.read_text(errors="replace").splitlines():
                if needle in line:
                    found = glog_time(line)
                    break
            out.append(found)
        return out

    def host(self) -> int | None:
        """The pid of the agent that hosts the c10d TCPStore (listens on the port)."""
        inodes = set()
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with contextlib.suppress(OSError):
                for line in Path(table).read_text().splitlines()[1:]:
                    cols = line.split()
                    if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == self.port:
                        inodes.add(cols[9])
        for p in self.procs:
            with contextlib.suppress(OSError):
                for fd in Path(f"/proc/{p.pid}/fd").iterdir():
                    with contextlib.suppress(OSError):
                        target = os.readlink(fd)
                        if target.startswith("socket:[") and target[8:-1] in inodes:
                            return p.pid
        return None


def torchrun_rendezvous(root: Path, plan: Plan) -> dict[str, Any]:
    """N agents launched together -> the last worker forked; also from the last agent's
    "Rendezvous'ing worker group" log line (i.e. after its ``import torch``).

    ``torchrun --nnodes=N:N --nproc-per-node=1 --rdzv-backend=c10d
    --rdzv-endpoint=127.0.0.1:PORT --rdzv-id=ID``, N = 2 and 4, and
    ``--nnodes=2:4`` with 4 launched; a fresh port and id per run.
    """
    configs = {"2:2": ("2:2", 2), "4:4": ("4:4", 4), "2:4 (4 nodes)": ("2:4", 4)}
    out: dict[str, Any] = {}
    for label, (nnodes, count) in configs.items():
        from_launch, from_ready, imports = [], [], []
        for i in range(plan.runs):
            name = f"tr-rdzv-{nnodes.replace(':', '-')}-{i}"
            folder = root / name
            folder.mkdir()
            with Torchruns(root, name, nnodes, count, worker_cmd(folder, "done")[1:]) as tr:
                codes = tr.wait(90)
                if codes != [0] * count:
                    raise RuntimeError(f"{name}: agents exited {codes}; see {tr.logs[0]}")
                recs = starts(folder)
                if len(recs) != count or {r.world for r in recs} != {count}:
                    raise RuntimeError(f"{name}: {len(recs)} workers")
                last = max(r.fork for r in recs)
                ready = tr.log_times("Rendezvous'ing worker group")
                from_launch.append(last - tr.launched)
                if all(t is not None for t in ready):
                    from_ready.append(last - max(t for t in ready if t is not None))
                    imports.append(max(t for t in ready if t is not None) - tr.launched)
        out[label] = {
            "launch": ms(from_launch),
            "ready": ms(from_ready),
            "agent_start": ms(imports),
            "raw_launch_s": from_launch,
        }
    return out


def torchrun_crash(root: Path, plan: Plan) -> dict[str, Any]:
    """4 agents ``4:4 --max-restarts K``: crash -> the 4th replacement worker forked.

    The same worker and crash schedule as elasticd's. A crashing node's agent
    restarts its group and re-rendezvous; the other agents notice
    ``num_nodes_waiting > 0`` in their monitor loop (every 0.1 s) and follow.
    """
    samples: list[float] = []
    for j in range(plan.crash_jobs):
        name = f"tr-crash-{j}"
        folder = root / name
        folder.mkdir()
        argv = worker_cmd(folder, "crash", crashes=plan.crashes, crash_rank=1, crash_after=1.0)
        with Torchruns(root, name, "4:4", 4, argv[1:], max_restarts=plan.crashes) as tr:
            codes = tr.wait(60 + 8 * plan.crashes)
            if codes != [0] * 4:
                raise RuntimeError(f"{name}: agents exited {codes}; see {tr.logs[0]}")
        samples += recovery_samples(folder, 4)
    return {"fork": ms(samples), "raw_fork_s": samples}


def torchrun_loss(root: Path, plan: Plan, gloo: bool = False) -> dict[str, Any]:
    """3 agents ``2:3 --max-restarts 3``; ``kill -9`` of a non-host agent and its worker.

    The TCPStore of the c10d backend lives in one agent (the one listening on
    the endpoint's port); the victim is another one, so the rendezvous
    itself survives. Then the survivors are watched for
    ``torchrun_loss_wait`` seconds (gloo: at least 90): when do their
    workers fail (their log), when does a rendezvous complete again and with
    what world size (their log), when are new workers forked (new child
    processes of the surviving agents), and (gloo) when does a new worker
    finish its first all-reduce (its notes). Then everything is killed.
    """
    name = f"tr-loss{'-gloo' if gloo else ''}"
    folder = root / name
    folder.mkdir()
    hold = folder / "hold"
    notes = folder / "notes.jsonl"
    wait = max(plan.torchrun_loss_wait, 90.0) if gloo else plan.torchrun_loss_wait
    if gloo:
        argv = [TRAIN, "--out", str(notes), "--hold", str(hold), "--hold-limit", "240"]
    else:
        argv = worker_cmd(folder, "hold", hold=hold)[1:]
    with Torchruns(root, name, "2:3", 3, argv, max_restarts=3) as tr:

        def running() -> bool:
            if gloo:
                return len([n for n in _notes(notes) if n["world"] == 3]) >= 3
            return len(starts(folder)) >= 3

        wait_for(running, 120 if gloo else 60, f"{name}: 3 workers", 0.05)
        time.sleep(1.0)
        host = tr.host()
        victim = next(p for p in tr.procs if p.pid != host)
        survivors = [p for p in tr.procs if p is not victim]
        agent_pids = {p.pid for p in survivors}
        before = _children(agent_pids)
        victim_workers = _children({victim.pid})
        t_kill = time.time()
        signal_group(victim.pid, signal.SIGKILL)
        for pid in victim_workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = Deadline(wait)
        spawned: dict[int, float] = {}
        first_note: float | None = None
        while not deadline.expired():
            for pid in _children(agent_pids) - before:
                if pid not in spawned:
                    spawned[pid] = _proc_start(pid) or time.time()
            if gloo:
                fresh = [n for n in _notes(notes) if n["restart"] > 0 or n["world"] != 3]
                if len(fresh) >= 2:
                    first_note = time.time()
                    break
            elif len(spawned) >= 2:
                break
            if all(p.poll() is not None for p in survivors):
                break
            time.sleep(0.05)
        observed = time.time() - t_kill
        failures: list[float] = []
        rounds: dict[float, int | None] = {}  # rendezvous completions after the kill -> world
        for k, p in enumerate(tr.procs):
            if p is victim:
                continue
            lines = tr.logs[k].read_text(errors="replace").splitlines()
            for n, line in enumerate(lines):
                at = glog_time(line)
                if at is None or at <= t_kill:
                    continue
                if "failed (exitcode" in line:
                    failures.append(at - t_kill)
                if "Rendezvous complete" in line:
                    world = None
                    for follow in lines[n + 1 : n + 12]:
                        if "group_world_size=" in follow:
                            world = int(follow.rsplit("=", 1)[1])
                            break
                    rounds[round(at - t_kill, 1)] = world
        new_forks = sorted(spawned.values())
        alive = [pid for pid in before if _alive(pid)]
        agents_alive = sum(1 for p in survivors if p.poll() is None)
        hold.touch()
    return {
        "gloo": gloo,
        "watched_s": observed,
        "survivor_workers_failed_after_s": sorted(round(f, 1) for f in failures),
        "rendezvous_complete_after_s": sorted(rounds),
        "new_world": rounds[min(rounds)] if rounds else None,
        "new_workers_after_s": new_forks[1] - t_kill if len(new_forks) >= 2 else None,
        "first_allreduce_after_s": None if first_note is None else first_note - t_kill,
        "old_survivor_workers_alive": f"{len(alive)}/{len(before)}",
        "survivor_agents_alive": agents_alive,
    }


def _children(parents: set[int]) -> set[int]:
    """Live processes whose parent is one of ``parents``."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            ppid = _ppid(int(entry.name))
            if ppid in parents and _alive(int(entry.name)):
                found.add(int(entry.name))
    return found


def _proc_start(pid: int) -> float | None:
    """A process's creation time as wall-clock seconds (1/CLK_TCK resolution)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    ticks = int(stat[stat.rindex(")") + 2 :].split()[19])
    boot = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def _ppid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat[stat.rindex(")") + 2 :].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


# -- the table ----------------------------------------------------------------------------------------


def p50(d: dict[str, Any] | None, key: str, q: str = "p50") -> float | None:
    if not d or key not in d or not d[key].get("n"):
        return None
    value = d[key][q]
    return float(value)


def span(d: dict[str, Any] | None, key: str) -> str:
    if not d or key not in d or not d[key].get("n"):
        return "—"
    s = d[key]
    return f"{fmt(s['p50'], 0)} ({fmt(s['min'], 0)}–{fmt(s['max'], 0)}, n={s['n']})"


def verdict(ok: bool | None) -> str:
    return "—" if ok is None else ("pass" if ok else "**MISS**")


def build_table(res: Results) -> tuple[str, bool]:
    f = res.figures
    rows: list[list[str]] = []
    all_ok = True
    ed_r, tr_r = f.get("rendezvous", {}).get("elasticd"), f.get("rendezvous", {}).get("torchrun")
    for label in ("2:2", "4:4", "2:4 (4 nodes)"):
        e = (ed_r or {}).get(label)
        t = (tr_r or {}).get(label)
        ours, theirs = p50(e, "fork"), p50(t, "launch")
        ok = None if ours is None or theirs is None else ours * 5 <= theirs
        all_ok &= ok is not False
        rows.append(
            [
                f"Rendezvous, {label}: POST / launch → last worker forked (ms)",
                "≤ 1/5 of torchrun",
                span(e, "fork"),
                span(t, "launch"),
                "—" if ok is None else f"{theirs / ours:.1f}×",  # type: ignore[operator]
                verdict(ok),
            ]
        )
        if t and t.get("ready", {}).get("n"):
            r_ready = p50(t, "ready")
            rows.append(
                [
                    "  same, torchrun from its last agent's first rendezvous log line (ms)",
                    "(supporting)",
                    span(e, "fork"),
                    span(t, "ready"),
                    "—" if not ours or r_ready is None else f"{r_ready / ours:.1f}×",
                    "",
                ]
            )
    cr = f.get("crash", {})
    e, t = cr.get("elasticd"), cr.get("torchrun")
    ours = p50(e, "fork")
    ok = None if ours is None else ours <= 250
    all_ok &= ok is not False
    theirs = p50(t, "fork")
    rows.append(
        [
            "Crash recovery, 4 nodes: crash → 4th replacement forked (ms)",
            "p50 ≤ 250 ms",
            span(e, "fork"),
            span(t, "fork"),
            "—" if ours is None or theirs is None else f"{theirs / ours:.1f}×",
            verdict(ok),
        ]
    )
    lo = f.get("loss", {})
    e = lo.get("elasticd")
    ours = p50(e, "fork")
    ok = None if ours is None else ours <= 5000
    all_ok &= ok is not False
    t = lo.get("torchrun")
    rows.append(
        [
            "Node loss, 3 nodes 2:3: kill -9 → survivors' new workers forked (ms)",
            "≤ 5 s",
            span(e, "fork"),
            torchrun_loss_cell(t),
            "—",
            verdict(ok),
        ]
    )
    if lo.get("elasticd_gloo") or lo.get("torchrun_gloo"):
        rows.append(
            [
                "  same with a gloo job (train_elastic.py --hold), 1 run",
                "(supporting)",
                elasticd_gloo_cell(lo.get("elasticd_gloo")),
                torchrun_loss_cell(lo.get("torchrun_gloo")),
                "—",
                "",
            ]
        )
    headers = ["Figure", "Goal", "elasticd p50 (min–max, n)", "torchrun", "torchrun ÷ elasticd", ""]
    table = md_table(headers, rows)
    checks = []
    for sec, label in (
        ("rendezvous", "2:2"),
        ("rendezvous", "4:4"),
        ("crash", None),
        ("loss", None),
    ):
        d = f.get(sec, {}).get("elasticd")
        if d and label:
            d = d.get(label)
        if d and d.get("event", {}).get("n"):
            checks.append(
                f"{sec}{' ' + label if label else ''}: {span(d, 'event')} ms to the last "
                "`workers.started` event"
            )
    if checks:
        table += "\n\nelasticd cross-check (event time stamps): " + "; ".join(checks) + "."
    return table, all_ok


def elasticd_gloo_cell(e: dict[str, Any] | None) -> str:
    if not e:
        return "—"
    fork, first = p50(e, "event"), p50(e, "first_allreduce")
    return (
        f"new workers forked at +{fmt((fork or 0) / 1000, 1)} s (events); "
        f"first all-reduce at +{fmt((first or 0) / 1000, 1)} s"
    )


def torchrun_loss_cell(t: dict[str, Any] | None) -> str:
    if not t:
        return "—"
    parts = []
    failed = t.get("survivor_workers_failed_after_s")
    if failed:
        parts.append(f"survivors' workers failed at +{', +'.join(f'{f:g}' for f in failed)} s")
    else:
        parts.append(f"survivors' workers untouched ({t['old_survivor_workers_alive']} running)")
    if t.get("new_workers_after_s") is not None:
        rounds = t.get("rendezvous_complete_after_s") or []
        parts.append(
            f"rendezvous completed (world {t['new_world']}) at +{', +'.join(f'{r:g}' for r in rounds)}"
            f" s, new workers forked at +{t['new_workers_after_s']:.1f} s"
        )
    else:
        parts.append(f"no new worker within {t['watched_s']:.0f} s")
    if t.get("gloo"):
        first = t.get("first_allreduce_after_s")
        parts.append(
            f"first all-reduce at +{first:.1f} s"
            if first
            else f"no all-reduce completed within {t['watched_s']:.0f} s"
        )
    parts.append(f"{t['survivor_agents_alive']}/2 agents still running")
    return "; ".join(parts)


# -- main ---------------------------------------------------------------------------------------------------


def run_section(res: Results, key: str, measure: Callable[[], Any]) -> None:
    started = time.monotonic()
    print(f"... {key}", flush=True)
    try:
        value = measure()
    except Exception:
        res.errors[key] = traceback.format_exc()
        print(f"{key}: measurement failed:\n{res.errors[key]}", flush=True)
        return
    section, _, tool = key.partition("/")
    res.figures.setdefault(section, {})[tool] = value
    print(f"    {key} done in {time.monotonic() - started:.0f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="reduced counts (under 3 minutes)")
    parser.add_argument("--only", help=f"comma-separated sections: {','.join(SECTIONS)}")
    parser.add_argument("--gloo", action="store_true", help="node loss with gloo too (full: on)")
    parser.add_argument("--no-gloo", action="store_true", help="no gloo node-loss run")
    parser.add_argument("--json", help="write every figure here")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder (logs)")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    gloo = (plan.gloo or args.gloo) and not args.no_gloo
    only = set(args.only.split(",")) if args.only else set(SECTIONS)
    if only - set(SECTIONS):
        parser.error(f"unknown sections {only - set(SECTIONS)}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks
    res = Results(machine=machine_info(), plan=dict(plan.__dict__, gloo=gloo))
    started = time.monotonic()
    print(f"# multi-node benchmark ({'quick' if args.quick else 'full'})", flush=True)
    with scratch("elasticd-cluster-bench-", keep=args.keep) as root:
        if args.keep:
            print(f"scratch: {root}", flush=True)

        async def elasticd_part() -> None:
            async with Elasticd(root) as ed:
                for key, fn in (
                    ("rendezvous", elasticd_rendezvous),
                    ("crash", elasticd_crash),
                    ("loss", elasticd_loss),
                ):
                    if key in only:
                        await run_async(res, f"{key}/elasticd", fn(ed, root, plan))
                if "loss" in only and gloo:
                    await run_async(res, "loss/elasticd_gloo", elasticd_loss(ed, root, plan, True))

        asyncio.run(elasticd_part())
        if "rendezvous" in only:
            run_section(res, "rendezvous/torchrun", lambda: torchrun_rendezvous(root, plan))
        if "crash" in only:
            run_section(res, "crash/torchrun", lambda: torchrun_crash(root, plan))
        if "loss" in only:
            run_section(res, "loss/torchrun", lambda: torchrun_loss(root, plan))
            if gloo:
                run_section(res, "loss/torchrun_gloo", lambda: torchrun_loss(root, plan, True))
    table, ok = build_table(res)
    print()
    print(f"Machine: {json.dumps(res.machine)}")
    print(f"Total time: {time.monotonic() - started:.0f} s")
    print()
    print(table)
    for key in ("torchrun", "torchrun_gloo"):
        t = res.figures.get("loss", {}).get(key)
        if t:
            print(
                f"\ntorchrun node loss ({'gloo' if t['gloo'] else 'same worker'}): {json.dumps(t)}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(res.__dict__, indent=2, default=str))
    if res.errors:
        return 2
    return 0 if ok else 1


async def run_async(res: Results, key: str, coro: Any) -> None:
    started = time.monotonic()
    print(f"... {key}", flush=True)
    try:
        value = await coro
    except Exception:
        res.errors[key] = traceback.format_exc()
        print(f"{key}: measurement failed:\n{res.errors[key]}", flush=True)
        return
    section, _, tool = key.partition("/")
    res.figures.setdefault(section, {})[tool] = value
    print(f"    {key} done in {time.monotonic() - started:.0f} s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
