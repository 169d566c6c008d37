"""Issue 39's figures: torchft replica groups on elasticd against torchft's own Lighthouse,
side by side in one run.

Every group runs ``examples/torchft_train.py`` (a stock ``torchft.Manager`` on gloo, a toy
model, one JSON line per committed step with its time). Three groups of one worker:

* **stock**: torchft's ``LighthouseServer`` (``torchft._torchft``) in a process of its own and
  the three groups as plain processes, each with its own store (rank 0 hosts it), as
  torchft's docs run them. Nobody supervises them: the benchmark restarts a killed group at
  once, the best a supervisor could do.
* **elasticd**: one daemon (``--nodes 1``) or three daemons on 127.0.0.1 sharing the first
  one's embedded store, a job of ``replica_groups: 3``: elasticd restarts a group and is its
  Lighthouse.

Figures (seconds; p50 over ``--repeats`` faults):

* **group kill**: ``kill -9`` of one group's worker. *Survivors' stall*: the longest gap
  between two commits of a surviving group from the kill on. *Rejoin*: the kill (elasticd)
  or the restart (stock) → the killed group's first commit again in a full quorum; on
  elasticd cold and with ``prewarm: ["torch", "torchft"]``.
* **Lighthouse loss**: stock: ``kill -9`` of the Lighthouse and a new one on the same port
  at once; elasticd (three daemons): ``kill -9`` of the daemon that leads the job's
  Lighthouse and of its node's workers. The survivors' stall as above.

Usage::

    .venv/bin/python bench/bench_torchft.py                 # both, 3 repeats
    .venv/bin/python bench/bench_torchft.py --only stock --repeats 1
    .venv/bin/python bench/bench_torchft.py --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import (  # noqa: E402
    PYTHON,
    ROOT,
    Deadline,
    fmt,
    free_port,
    md_table,
    new_tag,
    poll_until,
    reap_tagged,
    signal_group,
    stop_process,
    tagged_env,
)

TRAIN = ROOT / "examples" / "torchft_train.py"
GROUPS = 3
#: Torchft's Lighthouse settings on both sides (the stock server's flags, elasticd's spec).
HEARTBEAT_TIMEOUT_MS = 1000
JOIN_TIMEOUT_MS = 1000
STEP_TIME = 0.05
#: Seconds the groups get to commit again after a Lighthouse loss before it counts as lost.
LIGHTHOUSE_WAIT = 90.0


# -- the commit lines -------------------------------------------------------------------


def commits(path: Path) -> list[dict[str, Any]]:
    """The JSON commit lines of a group's stdout (``examples/torchft_train.py``)."""
    out = []
    with contextlib.suppress(OSError):
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                with contextlib.suppress(ValueError):
                    out.append(json.loads(line))
    return out


def longest_gap(times: list[float], since: float) -> float | None:
    """The longest interval between consecutive commits from ``since`` on (the last commit
    before it counts as the start); None with no commit after ``since``."""
    before = [t for t in times if t <= since]
    after = [t for t in times if t > since]
    if not after:
        return None
    points = ([before[-1]] if before else [since]) + after
    return max(b - a for a, b in zip(points, points[1:], strict=False))


def first_full_commit(lines: list[dict[str, Any]], since: float) -> float | None:
    """The time of the first commit after ``since`` in a quorum of every group."""
    for line in lines:
        if line["t"] > since and line["participants"] >= GROUPS:
            return float(line["t"])
    return None


@dataclass
class Figures:
    """What one side measured (seconds)."""

    stall: list[float] = field(default_factory=list)
    rejoin: list[float] = field(default_factory=list)
    rejoin_prewarm: list[float] = field(default_factory=list)
    lighthouse_stall: list[float] = field(default_factory=list)
    #: Lighthouse losses after which the groups did not all commit again within the wait.
    lighthouse_lost: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def p50(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


# -- stock torchft ------------------------------------------------------------------------


LIGHTHOUSE = """
import signal, sys
from torchft._torchft import LighthouseServer
server = LighthouseServer(bind=sys.argv[1], min_replicas=int(sys.argv[2]),
                          join_timeout_ms=int(sys.argv[3]), heartbeat_timeout_ms=int(sys.argv[4]))
print(server.address(), flush=True)
signal.pause()
"""


class Stock:
    """torchft's own Lighthouse and three unsupervised groups."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.tag = new_tag()
        self.port = free_port()
        self.lighthouse: subprocess.Popen[bytes] | None = None
        self.groups: dict[int, subprocess.Popen[bytes]] = {}
        self.runs: dict[int, int] = {}

    def start_lighthouse(self) -> None:
        log = (self.root / "lighthouse.log").open("ab")
        args = [str(GROUPS // 2 + 1), str(JOIN_TIMEOUT_MS), str(HEARTBEAT_TIMEOUT_MS)]
        self.lighthouse = subprocess.Popen(
            [PYTHON, "-c", LIGHTHOUSE, f"127.0.0.1:{self.port}", *args],
            env=tagged_env(self.tag),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def out(self, group: int) -> Path:
        return self.root / f"stock-g{group}-{self.runs.get(group, 0)}.out"

    def start_group(self, group: int) -> float:
        self.runs[group] = self.runs.get(group, -1) + 1
        env = tagged_env(
            self.tag,
            {
                "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{self.port}",
                "REPLICA_GROUP_ID": str(group),
                "NUM_REPLICA_GROUPS": str(GROUPS),
                "RANK": "0",
                "LOCAL_RANK": "0",
                "WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(free_port()),
                "PYTHONPATH": str(ROOT),
            },
        )
        started = time.time()
        self.groups[group] = subprocess.Popen(
            [PYTHON, str(TRAIN), "--steps", "100000", "--step-time", str(STEP_TIME)],
            env=env,
            stdout=self.out(group).open("wb"),
            stderr=(self.root / f"stock-g{group}-{self.runs[group]}.err").open("wb"),
            start_new_session=True,
        )
        return started

    def times(self, group: int) -> list[float]:
        return [float(line["t"]) for line in commits(self.out(group))]

    def all_full(self, since: float) -> bool | None:
        ok = all(first_full_commit(commits(self.out(g)), since) for g in range(GROUPS))
        return True if ok else None

    def close(self) -> None:
        for proc in [*self.groups.values(), *([self.lighthouse] if self.lighthouse else [])]:
            stop_process(proc, grace=2.0)
        reap_tagged(self.tag)


def run_stock(root: Path, repeats: int) -> Figures:
    figures = Figures()
    stock = Stock(root / "stock")
    stock.root.mkdir()
    try:
        stock.start_lighthouse()
        began = time.time()
        for group in range(GROUPS):
            stock.start_group(group)
        poll_until(lambda: stock.all_full(began), 180, "three stock groups committing")
        for _ in range(repeats):
            victim = GROUPS - 1
            time.sleep(1.0)  # a steady state before the fault
            killed = time.time()
            signal_group(stock.groups[victim].pid, signal.SIGKILL)
            stock.groups[victim].wait(timeout=30)
            restarted = stock.start_group(victim)
            back = poll_until(
                lambda v=victim, r=restarted: first_full_commit(commits(stock.out(v)), r),
                180,
                "the killed stock group back in a full quorum",
            )
            figures.rejoin.append(back - restarted)
            time.sleep(1.0)
            for group in range(GROUPS - 1):
                gap = longest_gap(stock.times(group), killed)
                if gap is not None:
                    figures.stall.append(gap)
        for _ in range(repeats):
            time.sleep(1.0)
            assert stock.lighthouse is not None
            killed = time.time()
            signal_group(stock.lighthouse.pid, signal.SIGKILL)
            stock.lighthouse.wait(timeout=30)
            stock.start_lighthouse()  # on the same port, at once
            try:
                poll_until(
                    lambda k=killed: stock.all_full(k),
                    LIGHTHOUSE_WAIT,
                    "stock groups past a Lighthouse restart",
                )
            except TimeoutError:
                # Not back (a group exited past its quorum_timeout, or stale quorum ids):
                # counted as a stall of the whole wait; the dead groups start again.
                figures.lighthouse_lost += 1
                for group, proc in stock.groups.items():
                    if proc.poll() is not None:
                        stock.start_group(group)
                again = time.time()
                poll_until(lambda a=again: stock.all_full(a), 240, "stock groups again")
            time.sleep(1.0)
            for group in range(GROUPS):
                gap = longest_gap(stock.times(group), killed)
                if gap is not None:
                    figures.lighthouse_stall.append(gap)
    finally:
        stock.close()
    return figures


# -- elasticd -------------------------------------------------------------------------------


TOKEN = "bench-torchft-token"


class Daemons:
    """``elasticd serve`` on 127.0.0.1: one daemon with its embedded store, or a store-only
    daemon and ``nodes`` agent daemons of one slot each (a group per node)."""

    def __init__(self, root: Path, nodes: int) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.tag = new_tag()
        self.token_file = root / "token"
        self.token_file.write_text(TOKEN)
        self.token_file.chmod(0o600)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.urls: dict[str, str] = {}
        self.store_url: str | None = None
        if nodes == 1:
            self.names = ["n0"]
            self._start("n0", slots=GROUPS)
        else:
            self._start("store", "--store-only")
            self.names = [f"n{i}" for i in range(1, nodes + 1)]
            for name in self.names:
                self._start(name, slots=1)
        for name in self.names:
            poll_until(lambda name=name: self._ready(name), 60, f"daemon {name}")

    def _start(self, name: str, *extra: str, slots: int = 1) -> None:
        port = free_port()
        env = tagged_env(
            self.tag,
            {
                "ELASTICD_LEASE_TTL": "2",
                "ELASTICD_ALLOW_ROOT": "true",
                "ELASTICD_LIGHTHOUSE_HEARTBEAT_TIMEOUT": str(HEARTBEAT_TIMEOUT_MS / 1000),
                "ELASTICD_LIGHTHOUSE_JOIN_TIMEOUT": str(JOIN_TIMEOUT_MS / 1000),
            },
        )
        args = [PYTHON, "-m", "elasticd", "serve", "--port", str(port), "--node-name", name]
        args += ["--state-dir", str(self.root / name), "--slots", str(slots)]
        args += ["--token-file", str(self.token_file), *extra]
        if self.store_url is not None:
            args += ["--store-url", self.store_url]
        log = (self.root / f"{name}.log").open("ab")
        self.procs[name] = subprocess.Popen(
            args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.urls[name] = f"http://127.0.0.1:{port}"
        if self.store_url is None:
            self.store_url = self.urls[name]
            if extra:
                poll_until(lambda: self._healthy(name), 60, "the store")

    def client(self, name: str | None = None) -> httpx.Client:
        url = self.urls[name or next(n for n in self.names if self.procs[n].poll() is None)]
        return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)

    def _healthy(self, name: str) -> bool | None:
        with contextlib.suppress(httpx.TransportError), self.client(name) as c:
            return True if c.get("/healthz").status_code == 200 else None
        return None

    def _ready(self, name: str) -> bool | None:
        with contextlib.suppress(httpx.TransportError), self.client(name) as c:
            if c.get("/readyz").status_code == 200:
                return True if name in {n["name"] for n in c.get("/nodes").json()} else None
        return None

    def train(self, job_id: str, prewarm: bool) -> Path:
        """Submit a job of three groups; its commit lines' folder, once all three commit."""
        out = self.root / job_id
        out.mkdir()
        with self.client() as c:
            c.post("/jobs", json=job_spec(job_id, out, prewarm)).raise_for_status()
        began = time.time()
        poll_until(lambda: all_full(out, began), 240, "three groups committing")
        return out

    def workers(self, job_id: str) -> dict[int, dict[str, Any]]:
        with self.client() as c:
            view = c.get(f"/jobs/{job_id}/workers").json()
        got = {}
        for group in view["groups"]:
            for w in group["workers"]:
                if w.get("pid") and w["state"] == "HEALTHY":
                    got[group["replica_group"]] = {**w, "node": group["node"]}
        return got

    def leader(self, job_id: str) -> str:
        from elasticd.keys import lighthouse_leader_key
        from elasticd.store.codec import decode_entry

        with self.client() as c:
            r = c.get("/store/kv", params={"key": lighthouse_leader_key(job_id)})
        return decode_entry(r.json()["entry"]).value.decode()

    def close(self) -> None:
        for proc in self.procs.values():
            stop_process(proc, grace=20.0, group=False)
        reap_tagged(self.tag)


def job_spec(job_id: str, out: Path, prewarm: bool) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "id": job_id,
        "entrypoint": PYTHON,
        "args": ["-u", str(TRAIN), "--steps", "100000", "--step-time", str(STEP_TIME)],
        "cwd": str(ROOT),
        "env": {"PYTHONPATH": str(ROOT)},
        "nproc_per_node": 1,
        "max_restarts": 50,
        "termination_grace": 2,
        "replica_groups": GROUPS,
    }
    spec["args"] += ["--out", str(out)]
    if prewarm:
        spec["prewarm"] = ["torch", "torchft"]
    return spec


def group_lines(out: Path, group: int) -> list[dict[str, Any]]:
    return commits(out / f"g{group}.jsonl")


def all_full(out: Path, since: float) -> bool | None:
    ok = all(first_full_commit(group_lines(out, g), since) for g in range(GROUPS))
    return True if ok else None


def run_elasticd(root: Path, repeats: int, nodes: int) -> Figures:
    figures = Figures()
    base = root / f"elasticd-{nodes}"
    base.mkdir()
    daemons = Daemons(base, nodes)
    try:
        for prewarm in (False, True):
            job_id = f"tft-{int(prewarm)}"
            out = daemons.train(job_id, prewarm)
            for _ in range(repeats):
                time.sleep(3.0 if prewarm else 1.0)  # standbys ready before the fault
                victim = daemons.workers(job_id)[GROUPS - 1]
                killed = time.time()
                os.kill(victim["pid"], signal.SIGKILL)
                back = poll_until(
                    lambda out=out, k=killed: first_full_commit(group_lines(out, GROUPS - 1), k),
                    240,
                    "the killed group back in a full quorum",
                )
                (figures.rejoin_prewarm if prewarm else figures.rejoin).append(back - killed)
                time.sleep(1.0)
                if not prewarm:
                    for group in range(GROUPS - 1):
                        times = [float(x["t"]) for x in group_lines(out, group)]
                        gap = longest_gap(times, killed)
                        if gap is not None:
                            figures.stall.append(gap)
            with daemons.client() as c:
                c.post(f"/jobs/{job_id}/cancel", json={})
        if nodes >= 3:
            for attempt in range(repeats):
                job_id = f"tft-lh-{attempt}"
                out = daemons.train(job_id, prewarm=False)
                time.sleep(1.0)
                leader = daemons.leader(job_id)
                workers = daemons.workers(job_id)
                victim = next(g for g, w in workers.items() if w["node"] == leader)
                killed = time.time()
                daemons.procs[leader].kill()
                with contextlib.suppress(ProcessLookupError):
                    os.kill(workers[victim]["pid"], signal.SIGKILL)
                survivors = [g for g in range(GROUPS) if g != victim]
                poll_until(
                    lambda out=out, k=killed, alive=survivors: (
                        all(any(x["t"] > k + 2.0 for x in group_lines(out, g)) for g in alive)
                        or None
                    ),
                    120,
                    "the survivors committing after the leader's loss",
                )
                for group in survivors:
                    times = [float(x["t"]) for x in group_lines(out, group)]
                    gap = longest_gap(times, killed)
                    if gap is not None:
                        figures.lighthouse_stall.append(gap)
                with daemons.client() as c:
                    c.post(f"/jobs/{job_id}/cancel", json={})
                if attempt + 1 < repeats:  # the lost node again, for the next sample
                    daemons.close()
                    daemons = Daemons(base / f"again-{attempt}", nodes)
    finally:
        daemons.close()
    return figures


# -- the report -------------------------------------------------------------------------------


def report(results: dict[str, Figures]) -> str:
    rows = []
    for name, figures in results.items():
        rows.append(
            [
                name,
                fmt(p50(figures.stall), 2),
                fmt(p50(figures.rejoin), 2),
                fmt(p50(figures.rejoin_prewarm), 2),
                fmt(p50(figures.lighthouse_stall), 2)
                + (
                    f" ({figures.lighthouse_lost} not back in {LIGHTHOUSE_WAIT:.0f} s)"
                    if figures.lighthouse_lost
                    else ""
                ),
            ]
        )
    return md_table(
        [
            "side",
            "survivors' stall on a group kill (s)",
            "rejoin, cold (s)",
            "rejoin, prewarm (s)",
            "stall on a Lighthouse loss (s)",
        ],
        rows,
    )


@contextlib.contextmanager
def scratch(keep: bool) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="bench-torchft-"))
    try:
        yield path
    finally:
        if not keep:
            subprocess.run(["rm", "-rf", str(path)], check=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", choices=["stock", "elasticd"], default=None)
    parser.add_argument("--nodes", type=int, default=3, help="elasticd's daemons (1 or 3)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    deadline = Deadline(3600)
    results: dict[str, Figures] = {}
    with scratch(args.keep) as root:
        if args.only in (None, "stock"):
            results["torchft stock Lighthouse"] = run_stock(root, args.repeats)
        if args.only in (None, "elasticd") and not deadline.expired():
            results[f"elasticd, {args.nodes} daemon(s)"] = run_elasticd(
                root, args.repeats, args.nodes
            )
    print(report(results))
    if args.json is not None:
        args.json.write_text(json.dumps({k: v.as_dict() for k, v in results.items()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
