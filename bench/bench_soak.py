"""Issue 23 item 7: a daemon that stays small over weeks of restarts.

One real ``elasticd serve`` (:class:`_common.ElasticdServer`: a fresh state
folder, a free loopback port, ``--allow-root`` when run as root) runs
crash-looping jobs back to back: each one worker, a tiny non-torch Python
program that sleeps ``--worker-seconds`` (0.2) then exits 1, with
``max_restarts`` at the model's limit (1,000) and ``termination_grace`` 1.
When one job has spent its budget (``FAILED``), the next is submitted under a
new id, until ``--restarts`` restarts (8,000 for the full figure; ``--quick``:
60) have happened in all. Finished jobs stay, as they would for
``job_retention`` (7 days by default).

Every ``--sample-every`` restarts (and at the start and the end) it samples
the daemon's:

* RSS (``VmRSS``), open descriptors (``/proc/<pid>/fd``), threads;
* database sizes: ``elasticd.sqlite3`` (the node's event log) and
  ``store.sqlite3`` (the embedded store), each with its ``-wal`` file;
* events: the rows of the node's event log and the keys of the store's copy
  (``ev/``), each read from its SQLite file through a read-only connection;
* log folders and bytes under the daemon's log root.

``--concurrent N`` runs N such jobs at once (issue 34: 3), each replaced by a
new one as it fails, so N jobs crash-loop at every moment and the finished
ones pile up behind them.

It prints one markdown table of the samples and one of the per-restart
slopes over the second half of the run (the growth that is left once the
retention policies have reached their bounds), and an extrapolation of each
figure to ``--extrapolate`` restarts (8,000) from those slopes.

The daemon runs with its defaults unless ``--config`` names a TOML file
(e.g. smaller retention bounds).

Usage::

    .venv/bin/python bench/bench_soak.py [--quick] [--restarts 8000]
        [--concurrent 3] [--sample-every 100] [--config elasticd.toml] [--json out.json] [--keep]

Exits 0 when the RSS stayed at or under ``--rss-goal`` MiB (80) at every
sample, 1 otherwise, 2 when the measurement itself failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sqlite3
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from _common import (
    PYTHON,
    ROOT,
    Deadline,
    ElasticdServer,
    fmt,
    machine_info,
    md_table,
    proc_rss_mb,
    scratch,
)

TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")
#: The model's limit on ``max_restarts``: one job restarts at most this often.
JOB_BUDGET = 1000


class SoakServer(ElasticdServer):
    """:class:`ElasticdServer` with an optional ``--config`` file."""

    def __init__(self, root: Path, config: Path | None, slots: int) -> None:
        super().__init__(root, "soak")
        self.config = config
        self.slots = slots

    def command(self) -> list[str]:
        # Slots for every concurrent job: by default a node has one a CPU, and on a
        # 2-core machine the third job would wait in the queue.
        extra = ["--config", str(self.config)] if self.config else []
        return [*super().command(), "--slots", str(self.slots), *extra]


def crash_spec(job_id: str, seconds: float, budget: int) -> dict[str, Any]:
    """One worker that sleeps ``seconds``, then exits 1; restarted ``budget`` times."""
    return {
        "id": job_id,
        "entrypoint": PYTHON,
        "args": ["-c", f"import sys, time; time.sleep({seconds}); sys.exit(1)"],
        "cwd": str(ROOT),
        "nproc_per_node": 1,
        "max_restarts": budget,
        "termination_grace": 1,
    }


@dataclass
class Sample:
    """The daemon's footprint after ``restarts`` restarts, ``t`` seconds into the run."""

    restarts: int
    t: float
    rss_mib: float
    fds: int
    threads: int
    events_db_mb: float
    store_db_mb: float
    local_events: int
    store_events: int
    log_dirs: int
    log_mb: float


def file_mb(path: Path) -> float:
    total = 0
    for suffix in ("", "-wal"):
        with contextlib.suppress(OSError):
            total += os.stat(f"{path}{suffix}").st_size
    return total / 1e6


def count_local_events(db: Path) -> int:
    """Rows of the node's event log, read through a read-only connection."""
    with contextlib.suppress(sqlite3.Error):
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
        try:
            return int(conn.execute("SELECT COUNT(*) FROM events").fetchone()[0])
        finally:
            conn.close()
    return -1


def count_store_events(db: Path) -> int:
    """Keys of the store's copy of events (``ev/``), read from the embedded store's file
    through a read-only connection: asking the daemon to list them would make it build the
    whole listing, values and all, and the sample would measure its own request."""
    with contextlib.suppress(sqlite3.Error):
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
        try:
            query = "SELECT COUNT(*) FROM kv WHERE key >= 'ev/' AND key < 'ev0'"
            return int(conn.execute(query).fetchone()[0])
        finally:
            conn.close()
    return -1


def logs_footprint(root: Path) -> tuple[int, float]:
    """Attempt folders and bytes of every file under the log root."""
    dirs, size = 0, 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirs += sum(1 for d in dirnames if d.startswith("attempt_"))
        for name in filenames:
            with contextlib.suppress(OSError):
                size += os.lstat(os.path.join(dirpath, name)).st_size
    return dirs, size / 1e6


def sample(server: SoakServer, restarts: int, t0: float) -> Sample:
    pid = server.pid
    threads = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            threads = int(line.split()[1])
    store_events = count_store_events(server.state_dir / "store.sqlite3")
    dirs, log_mb = logs_footprint(server.state_dir / "logs")
    return Sample(
        restarts=restarts,
        t=time.monotonic() - t0,
        rss_mib=proc_rss_mb(pid),
        fds=len(os.listdir(f"/proc/{pid}/fd")),
        threads=threads,
        events_db_mb=file_mb(server.state_dir / "elasticd.sqlite3"),
        store_db_mb=file_mb(server.state_dir / "store.sqlite3"),
        local_events=count_local_events(server.state_dir / "elasticd.sqlite3"),
        store_events=store_events,
        log_dirs=dirs,
        log_mb=log_mb,
    )


def job_budget(restarts: int, assigned: int, budget: int) -> int:
    """The budget of the next job: ``budget``, or what is left of ``restarts``."""
    return min(budget, restarts - assigned)


def soak(args: argparse.Namespace, root: Path) -> list[Sample]:
    """``args.concurrent`` crash-looping jobs at once, each replaced by a new one (a new
    id) when it ends, until the jobs' budgets add up to ``args.restarts``."""
    samples: list[Sample] = []
    with SoakServer(root, args.config, max(1, args.concurrent)) as server:
        t0 = time.monotonic()
        samples.append(sample(server, 0, t0))
        done = 0  # restarts of the finished jobs
        assigned = 0  # restarts the submitted jobs may make (their budgets)
        running: dict[str, int] = {}  # job id -> its restarts so far
        next_sample = args.sample_every
        index = 0
        deadline = Deadline(args.timeout)
        while True:
            while len(running) < args.concurrent and assigned < args.restarts:
                budget = job_budget(args.restarts, assigned, args.budget)
                job_id = f"soak-{index}"
                server.submit(crash_spec(job_id, args.worker_seconds, budget))
                running[job_id] = 0
                assigned += budget
                index += 1
            if not running:
                break
            for job_id in list(running):
                job = server.job(job_id)
                running[job_id] = int(job.get("restart_count", 0))
                if job["state"] in TERMINAL:
                    done += running.pop(job_id)
            total = done + sum(running.values())
            while total >= next_sample and next_sample < args.restarts:
                samples.append(sample(server, total, t0))
                print(_row(samples[-1]), file=sys.stderr, flush=True)
                next_sample += args.sample_every
            if deadline.expired():
                raise TimeoutError(f"{sorted(running)} still running after {args.timeout} s")
            if len(running) == args.concurrent or assigned >= args.restarts:
                time.sleep(0.5)  # else a finished job is replaced at once
        samples.append(sample(server, done, t0))
    return samples


HEADERS = [
    "restarts",
    "t (s)",
    "RSS (MiB)",
    "fds",
    "threads",
    "elasticd.sqlite3 (MB)",
    "store.sqlite3 (MB)",
    "events (node)",
    "events (store)",
    "attempt folders",
    "log MB",
]


def _cells(s: Sample) -> list[str]:
    return [
        str(s.restarts),
        fmt(s.t, 0),
        fmt(s.rss_mib),
        str(s.fds),
        str(s.threads),
        fmt(s.events_db_mb, 2),
        fmt(s.store_db_mb, 2),
        str(s.local_events),
        str(s.store_events),
        str(s.log_dirs),
        fmt(s.log_mb, 2),
    ]


def _row(s: Sample) -> str:
    return " | ".join(_cells(s))


def slopes(samples: list[Sample]) -> dict[str, float]:
    """Growth per restart over the second half of the run (least squares)."""
    half = [s for s in samples if s.restarts >= samples[-1].restarts / 2]
    if len(half) < 2:
        half = samples
    xs = [float(s.restarts) for s in half]
    out: dict[str, float] = {}
    for name in (
        "rss_mib",
        "events_db_mb",
        "store_db_mb",
        "local_events",
        "store_events",
        "log_dirs",
        "log_mb",
        "fds",
        "threads",
    ):
        ys = [float(getattr(s, name)) for s in half]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx) ** 2 for x in xs)
        out[name] = (
            sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
        )
    return out


def report(samples: list[Sample], args: argparse.Namespace) -> tuple[str, bool]:
    peak = max(s.rss_mib for s in samples)
    last = samples[-1]
    per = slopes(samples)
    lines = [md_table(HEADERS, [_cells(s) for s in samples]), ""]
    rows = []
    for name, label in (
        ("rss_mib", "RSS (MiB)"),
        ("events_db_mb", "elasticd.sqlite3 (MB)"),
        ("store_db_mb", "store.sqlite3 (MB)"),
        ("local_events", "events (node)"),
        ("store_events", "events (store)"),
        ("log_dirs", "attempt folders"),
        ("log_mb", "log MB"),
    ):
        now = float(getattr(last, name))
        slope = per[name]
        at = now + slope * max(0, args.extrapolate - last.restarts)
        rows.append([label, fmt(now, 2), f"{slope * 100:.3f}", fmt(at, 2)])
    lines.append(
        md_table(
            [
                "figure",
                f"at {last.restarts} restarts",
                "per 100 restarts (2nd half)",
                f"extrapolated to {args.extrapolate}",
            ],
            rows,
        )
    )
    ok = peak <= args.rss_goal
    lines.append("")
    lines.append(
        f"RSS peak {peak:.1f} MiB (goal <= {args.rss_goal:g}): {'pass' if ok else 'FAIL'}; "
        f"{last.restarts} restarts in {last.t:.0f} s"
    )
    return "\n".join(lines), ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--restarts", type=int, default=2000)
    parser.add_argument("--quick", action="store_true", help="60 restarts, a sample every 20")
    parser.add_argument("--sample-every", type=int, default=0, help="default: restarts / 20")
    parser.add_argument("--worker-seconds", type=float, default=0.2)
    parser.add_argument(
        "--budget", type=int, default=JOB_BUDGET, help="max_restarts of each job (1,000)"
    )
    parser.add_argument(
        "--concurrent", type=int, default=1, help="crash-looping jobs at once (each replaced)"
    )
    parser.add_argument("--config", type=Path, default=None, help="TOML file for the daemon")
    parser.add_argument("--rss-goal", type=float, default=80.0)
    parser.add_argument("--extrapolate", type=int, default=8000)
    parser.add_argument("--timeout", type=float, default=6 * 3600.0)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder")
    args = parser.parse_args(argv)
    # A SIGTERM (``timeout``) unwinds like an error, so the daemon is stopped and reaped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(2))
    if args.quick:
        args.restarts = 60
    if args.sample_every <= 0:
        args.sample_every = max(1, args.restarts // 20)
    print(f"machine: {machine_info()}", file=sys.stderr)
    print(" | ".join(HEADERS), file=sys.stderr)
    try:
        with scratch("elasticd-soak-", keep=args.keep) as root:
            samples = soak(args, root)
    except Exception:
        traceback.print_exc()
        return 2
    text, ok = report(samples, args)
    print(text)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "args": vars(args) | {"config": str(args.config), "json": str(args.json)},
                    "samples": [asdict(s) for s in samples],
                },
                indent=2,
            )
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
