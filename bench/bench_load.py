"""Issue #6's "under load": mixed reads at 200 req/s plus submissions, while a job crash-loops.

One real ``elasticd serve`` (:class:`_common.ElasticdServer`: a fresh state
folder, a free loopback port, ``--allow-root`` when run as root) runs:

* ``crashloop``: 2 workers, each a tiny non-torch Python program that sleeps
  ``--crash-every`` seconds (10) then exits 1; ``max_restarts`` 100,
  ``termination_grace`` 2. Every crash stops the group and restarts it, so
  the daemon's whole restart path (exit detection, stop, rendezvous, spawn,
  events) runs about every 10 s during the load.
* an open-loop load of ``--rate`` GETs per second (200) for ``--seconds`` (60;
  ``--quick``: 15), cycling through seven reads in equal shares: ``/jobs``,
  ``/jobs/crashloop``, ``/jobs/crashloop/workers``,
  ``/jobs/crashloop/events?after=N`` (N one of the last 20 event seqs seen,
  as a follower would ask), ``/nodes``, ``/healthz``, ``/metrics``;
* a job submission every ``--submit-every`` seconds (2): ``python -c pass``,
  1 worker, each with a fresh id. Each must end ``SUCCEEDED``.

The client is one ``httpx.AsyncClient`` with a pool of ``--connections``
(8) keep-alive connections. Requests are issued at their scheduled times
whether or not earlier ones were answered (open loop), and each latency is
measured from the *scheduled* time to the answer, so a stalled daemon delays
nobody's clock (no coordinated omission); the time a request waited for a
free pooled connection is part of it. An error is any non-2xx answer or a
transport error (timeout ``--timeout``, 10 s); requests still unanswered 15 s
after the load ends are errors too.

The daemon's RSS (``VmRSS``) and CPU time are sampled every second. Memory
is "flat" when the RSS at the end of the load is at most 10 % above the RSS
at ``--warmup`` seconds (10; ``--quick``: 5).

Usage::

    .venv/bin/python bench/bench_load.py [--quick] [--seconds 60] [--rate 200]
                                         [--json results.json] [--keep]

Prints markdown tables. Exits 0 when there were no errors, every submitted
job succeeded and the RSS grew at most 10 % after warm-up; 1 otherwise; 2 when
the measurement itself failed (e.g. the daemon did not start).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import sys
import time
import traceback
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from _common import (
    Deadline,
    ElasticdServer,
    Stats,
    fmt,
    machine_info,
    md_table,
    poll_until,
    proc_cpu_seconds,
    proc_rss_mb,
    python_job,
    scratch,
)

CRASH_JOB = "crashloop"
TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")
#: The reads, in the order the load cycles through them (equal shares).
READS = (
    "GET /jobs",
    "GET /jobs/{id}",
    "GET /jobs/{id}/workers",
    "GET /jobs/{id}/events?after=N",
    "GET /nodes",
    "GET /healthz",
    "GET /metrics",
)
SUBMIT = "POST /jobs"
GROWTH_GOAL_PCT = 10.0
#: Unanswered requests are given this long after the last one was issued.
DRAIN_S = 15.0


@dataclass
class Load:
    """What the load saw, in seconds (latencies) and MiB (RSS)."""

    started_wall: float = 0.0
    issued: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    latency: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    errors: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    client_lag: list[float] = field(default_factory=list)
    issue_seconds: float = 0.0
    rss: list[tuple[float, float]] = field(default_factory=list)
    """(seconds since the load started, RSS MiB), one a second."""
    restart_counts: list[tuple[float, int]] = field(default_factory=list)
    """(seconds since the load started, restart_count) from the load's own GET /jobs/{id}."""
    submitted: list[str] = field(default_factory=list)
    daemon_cpu_s: float = 0.0
    elapsed: float = 0.0


class LoadServer(ElasticdServer):
    """:class:`ElasticdServer` with ``--slots``: the crash job holds 2, submissions need 1 each.

    The default is one slot per CPU (2 here), so without this every submission
    would wait, ``PENDING``, behind the crash job.
    """

    def __init__(self, root: Path, slots: int) -> None:
        super().__init__(root, "load")
        self.slots = slots

    def command(self) -> list[str]:
        return [*super().command(), "--slots", str(self.slots)]


def crash_spec(crash_every: float) -> dict[str, Any]:
    """The crash-looping job: 2 plain-Python workers that sleep, then exit 1."""
    code = f"import sys, time; time.sleep({crash_every}); sys.exit(1)"
    return python_job(CRASH_JOB, code, nproc=2, max_restarts=100)


def short_spec(job_id: str) -> dict[str, Any]:
    return python_job(job_id, "pass")


async def drive(server: ElasticdServer, args: argparse.Namespace) -> Load:
    """Run the load for ``args.seconds`` and return what it saw."""
    load = Load()
    loop = asyncio.get_running_loop()
    rng = random.Random(6)
    seqs: list[int] = []  # event seqs of the crash job seen so far (ascending)
    limits = httpx.Limits(
        max_connections=args.connections, max_keepalive_connections=args.connections
    )
    async with httpx.AsyncClient(
        base_url=server.url, limits=limits, timeout=args.timeout, headers=server.client.headers
    ) as client:
        # Open the pooled connections and learn the first event seqs (not recorded).
        warm = await asyncio.gather(
            *(client.get(f"/jobs/{CRASH_JOB}/events") for _ in range(args.connections))
        )
        for r in warm:
            r.raise_for_status()
        seqs = sorted({int(e["seq"]) for e in warm[0].json()})

        start = loop.time() + 0.1

        def url_of(kind: str) -> str:
            if kind == "GET /jobs":
                return "/jobs"
            if kind == "GET /jobs/{id}":
                return f"/jobs/{CRASH_JOB}"
            if kind == "GET /jobs/{id}/workers":
                return f"/jobs/{CRASH_JOB}/workers"
            if kind == "GET /jobs/{id}/events?after=N":
                after = seqs[-rng.randint(1, min(20, len(seqs)))] if seqs else 0
                return f"/jobs/{CRASH_JOB}/events?after={after}"
            return "/" + kind.split(" /", 1)[1]

        def note(kind: str, response: httpx.Response) -> None:
            """Learn from an answer: the crash job's restart count, its newest event seqs."""
            if kind == "GET /jobs/{id}":
                load.restart_counts.append(
                    (loop.time() - start, int(response.json()["restart_count"]))
                )
            elif kind == "GET /jobs/{id}/events?after=N":
                new = [int(e["seq"]) for e in response.json()]
                if new and (not seqs or max(new) > seqs[-1]):
                    seqs.extend(s for s in sorted(new) if not seqs or s > seqs[-1])
                    del seqs[:-100]

        async def one(kind: str, at: float, body: dict[str, Any] | None = None) -> None:
            load.issued[kind] += 1
            load.client_lag.append(loop.time() - at)
            try:
                if body is None:
                    r = await client.get(url_of(kind))
                else:
                    r = await client.post("/jobs", json=body)
            except httpx.HTTPError as exc:
                load.errors[kind].append(f"{type(exc).__name__}: {str(exc)[:80]}")
                return
            done = loop.time()
            if not r.is_success:
                load.errors[kind].append(f"HTTP {r.status_code}: {r.text[:80]}")
                return
            load.latency[kind].append(done - at)
            try:
                note(kind, r)
            except (ValueError, KeyError, TypeError) as exc:
                load.errors[kind].append(f"unreadable answer: {type(exc).__name__}: {exc}")

        async def sample() -> None:
            """RSS every second, from the load's start until cancelled."""
            tick = 0
            while True:
                at = start + tick
                await asyncio.sleep(max(0.0, at - loop.time()))
                with contextlib.suppress(OSError, RuntimeError):
                    load.rss.append((loop.time() - start, proc_rss_mb(server.pid)))
                tick += 1

        async def submissions(tasks: list[asyncio.Task[None]]) -> None:
            n = 0
            while True:
                at = start + n * args.submit_every
                if at - start >= args.seconds:
                    return
                await asyncio.sleep(max(0.0, at - loop.time()))
                job_id = f"short-{n}"
                load.submitted.append(job_id)
                tasks.append(asyncio.create_task(one(SUBMIT, at, short_spec(job_id))))
                n += 1

        tasks: list[asyncio.Task[None]] = []
        sampler = asyncio.create_task(sample())
        submitter = asyncio.create_task(submissions(tasks))
        cpu0 = proc_cpu_seconds(server.pid)
        load.started_wall = time.time()
        interval = 1.0 / args.rate
        count = int(args.seconds * args.rate)
        try:
            for i in range(count):
                at = start + i * interval
                delay = at - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(READS[i % len(READS)], at)))
            load.issue_seconds = loop.time() - start
            await submitter
            load.elapsed = loop.time() - start
            load.daemon_cpu_s = proc_cpu_seconds(server.pid) - cpu0
            with contextlib.suppress(OSError, RuntimeError):
                load.rss.append((loop.time() - start, proc_rss_mb(server.pid)))
            _, pending = await asyncio.wait(tasks, timeout=DRAIN_S) if tasks else (set(), set())
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=5.0)
            # A request cancelled here was issued but never answered: an error.
            answered = sum(len(v) for v in load.latency.values()) + sum(
                len(v) for v in load.errors.values()
            )
            missing = sum(load.issued.values()) - answered
            if missing:
                load.errors["(unanswered)"].extend(["no answer within the drain"] * missing)
        finally:
            sampler.cancel()
            submitter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
            with contextlib.suppress(asyncio.CancelledError):
                await submitter
    return load


def wait_running(server: ElasticdServer, timeout: float) -> None:
    """Until the crash job has both workers up."""

    def running() -> bool | None:
        view = server.client.get(f"/jobs/{CRASH_JOB}/workers").json()
        workers = [w for g in view.get("groups", []) for w in g["workers"]]
        return True if len(workers) == 2 and all(w.get("pid") for w in workers) else None

    try:
        poll_until(running, timeout, "the crash job's two workers", 0.1)
    except TimeoutError as exc:
        raise TimeoutError(f"{exc}\n{server.diagnose(CRASH_JOB)}") from None


def settle_jobs(server: ElasticdServer, ids: list[str], timeout: float) -> dict[str, str]:
    """Each submitted job's final state (or its state when ``timeout`` ran out)."""
    deadline = Deadline(timeout)
    states: dict[str, str] = {}
    for job_id in ids:
        while True:
            try:
                state = str(server.job(job_id)["state"])
            except httpx.HTTPError as exc:
                state = f"unreadable ({type(exc).__name__})"
            if state in TERMINAL or deadline.expired():
                states[job_id] = state
                break
            time.sleep(0.1)
    return states


def measure(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """Start the daemon and the crash job, run the load, collect the figures."""
    with LoadServer(root, args.slots) as server:
        server.submit(crash_spec(args.crash_every))
        wait_running(server, 60)
        rss_idle = proc_rss_mb(server.pid)
        restarts_before = int(server.job(CRASH_JOB)["restart_count"])
        load = asyncio.run(drive(server, args))
        job = server.job(CRASH_JOB)
        restarts_after = int(job["restart_count"])
        crash_state = str(job["state"])
        events_total = len(server.events(CRASH_JOB))
        states = settle_jobs(server, load.submitted, 60)
        server.cancel(CRASH_JOB)
        with contextlib.suppress(TimeoutError):
            server.wait_terminal(CRASH_JOB, 30)
        server.stop()
        daemon_exit = server.exit_code
    return {
        "load": load,
        "rss_before_load_mb": rss_idle,
        "restarts_before": restarts_before,
        "restarts_after": restarts_after,
        "crash_job_state_after_load": crash_state,
        "crash_job_events": events_total,
        "submitted_states": states,
        "daemon_exit_code": daemon_exit,
    }


def rss_at(samples: list[tuple[float, float]], t: float) -> float:
    """The first RSS sample taken at or after ``t`` s (the last one if none)."""
    for at, mb in samples:
        if at >= t:
            return mb
    return samples[-1][1] if samples else math.nan


def slope_mb_per_min(samples: list[tuple[float, float]], after: float) -> float:
    """Least-squares RSS slope after ``after`` s, in MiB per minute."""
    pts = [(t, m) for t, m in samples if t >= after]
    if len(pts) < 3:
        return math.nan
    mt = sum(t for t, _ in pts) / len(pts)
    mm = sum(m for _, m in pts) / len(pts)
    den = sum((t - mt) ** 2 for t, _ in pts)
    return 60 * sum((t - mt) * (m - mm) for t, m in pts) / den if den else math.nan


def report(res: dict[str, Any], args: argparse.Namespace) -> tuple[str, dict[str, Any], bool]:
    """(markdown, figures as plain data, every goal met)."""
    load: Load = res["load"]
    every = [v for vs in load.latency.values() for v in vs]
    overall = Stats.of(every, 1000.0)
    errors = sum(len(v) for v in load.errors.values())
    total = sum(load.issued.values())
    reads = sum(n for k, n in load.issued.items() if k != SUBMIT)
    warm = rss_at(load.rss, args.warmup)
    end = load.rss[-1][1] if load.rss else math.nan
    peak = max((m for _, m in load.rss), default=math.nan)
    growth = (end - warm) / warm * 100 if warm and not math.isnan(warm) else math.nan
    slope = slope_mb_per_min(load.rss, args.warmup)
    restarts = res["restarts_after"] - res["restarts_before"]
    states: dict[str, str] = res["submitted_states"]
    succeeded = sum(s == "SUCCEEDED" for s in states.values())
    lag = Stats.of(load.client_lag, 1000.0)
    ok_errors = errors == 0
    ok_growth = not math.isnan(growth) and growth <= GROWTH_GOAL_PCT
    ok_jobs = succeeded == len(states)
    ok_restarts = restarts >= 1

    def verdict(ok: bool) -> str:
        return "✅ pass" if ok else "❌ FAIL"

    rows = [
        ["Requests (reads + submissions)", f"{total} ({reads} + {load.issued[SUBMIT]})", "", ""],
        ["Errors (non-2xx, transport, unanswered)", str(errors), "0", verdict(ok_errors)],
        [
            "Achieved read rate (req/s)",
            f"{reads / max(load.issue_seconds, 1e-9):.1f} of {args.rate:g}",
            "",
            "",
        ],
        [
            "Latency, all requests, p50 / p99 / max (ms)",
            f"{fmt(overall.p50, 2)} / {fmt(overall.p99, 2)} / {fmt(overall.max, 1)}",
            "p99 recorded",
            "",
        ],
        [
            "Client scheduling lag p50 / p99 / max (ms)",
            f"{fmt(lag.p50, 2)} / {fmt(lag.p99, 2)} / {fmt(lag.max, 1)}",
            "",
            "",
        ],
        [
            f"Crash-job restarts during the load (crash every {args.crash_every:g} s)",
            f"{restarts} (restart_count {res['restarts_before']} → {res['restarts_after']}, "
            f"{res['crash_job_state_after_load']})",
            "≥ 1",
            verdict(ok_restarts),
        ],
        [
            "Submitted jobs that ended SUCCEEDED",
            f"{succeeded}/{len(states)}",
            "all",
            verdict(ok_jobs),
        ],
        [
            "Daemon CPU during the load (% of one core)",
            fmt(load.daemon_cpu_s / max(load.elapsed, 1e-9) * 100, 0),
            "",
            "",
        ],
        [
            "Daemon RSS: before load / at warm-up / end / peak (MiB)",
            f"{fmt(res['rss_before_load_mb'])} / {fmt(warm)} (t={args.warmup:g} s) / "
            f"{fmt(end)} / {fmt(peak)}",
            "",
            "",
        ],
        [
            "RSS growth after warm-up (end vs warm-up)",
            f"{fmt(growth, 1)} % (slope {fmt(slope, 2)} MiB/min)",
            f"≤ {GROWTH_GOAL_PCT:g} %",
            verdict(ok_growth),
        ],
        [
            "Crash-job events at the end (what /events?after=0 lists)",
            str(res["crash_job_events"]),
            "",
            "",
        ],
        ["Daemon exit code after SIGTERM", str(res["daemon_exit_code"]), "0", ""],
    ]
    main = md_table(["Figure", "Value", "Goal", "Result"], rows)
    per: list[list[str]] = []
    for kind in (*READS, SUBMIT):
        s = Stats.of(load.latency.get(kind, []), 1000.0)
        per.append(
            [
                f"`{kind}`",
                str(load.issued.get(kind, 0)),
                str(len(load.errors.get(kind, []))),
                fmt(s.p50, 2),
                fmt(s.p99, 2),
                fmt(s.max, 1),
            ]
        )
    if load.errors.get("(unanswered)"):
        per.append(
            ["(unanswered at the end)", "", str(len(load.errors["(unanswered)"])), "", "", ""]
        )
    endpoints = md_table(["Endpoint", "n", "errors", "p50 (ms)", "p99 (ms)", "max (ms)"], per)
    text = main + "\n\n" + endpoints
    samples = {k: sorted(set(v))[:5] for k, v in load.errors.items() if v}
    if samples:
        text += "\n\nErrors (up to 5 distinct per endpoint):\n" + "\n".join(
            f"- {k}: {v}" for k, v in samples.items()
        )
    bad = {k: s for k, s in states.items() if s != "SUCCEEDED"}
    if bad:
        text += f"\n\nSubmitted jobs not SUCCEEDED: {bad}"
    figures = {
        "requests": total,
        "reads": reads,
        "submissions": load.issued[SUBMIT],
        "errors": errors,
        "error_samples": samples,
        "achieved_read_rate": reads / max(load.issue_seconds, 1e-9),
        "latency_ms": overall.as_dict(),
        "latency_ms_by_endpoint": {
            k: Stats.of(v, 1000.0).as_dict() for k, v in load.latency.items()
        },
        "client_lag_ms": lag.as_dict(),
        "restarts_during_load": restarts,
        "restart_counts_seen": load.restart_counts[:: max(1, len(load.restart_counts) // 60)],
        "submitted_states": states,
        "daemon_cpu_pct": load.daemon_cpu_s / max(load.elapsed, 1e-9) * 100,
        "rss_mb": load.rss,
        "rss_before_load_mb": res["rss_before_load_mb"],
        "rss_warm_mb": warm,
        "rss_end_mb": end,
        "rss_peak_mb": peak,
        "rss_growth_pct": growth,
        "rss_slope_mb_per_min": slope,
        "crash_job_events": res["crash_job_events"],
        "daemon_exit_code": res["daemon_exit_code"],
    }
    return text, figures, ok_errors and ok_growth and ok_jobs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="15 s of load, warm-up 5 s")
    parser.add_argument("--seconds", type=float, help="load duration (default 60; --quick 15)")
    parser.add_argument("--rate", type=float, default=200.0, help="reads per second (200)")
    parser.add_argument("--submit-every", type=float, default=2.0, help="seconds (2)")
    parser.add_argument("--crash-every", type=float, default=10.0, help="seconds (10)")
    parser.add_argument("--connections", type=int, default=8, help="keep-alive pool size (8)")
    parser.add_argument("--slots", type=int, default=8, help="the daemon's --slots (8)")
    parser.add_argument("--timeout", type=float, default=10.0, help="per request, seconds (10)")
    parser.add_argument("--warmup", type=float, help="seconds (default 10; --quick 5)")
    parser.add_argument("--json", type=Path, help="write every figure to this JSON file")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder (logs)")
    args = parser.parse_args(argv)
    if args.seconds is None:
        args.seconds = 15.0 if args.quick else 60.0
    if args.warmup is None:
        args.warmup = 5.0 if args.quick else 10.0
    if not (0 < args.warmup < args.seconds) or args.rate <= 0 or args.connections < 1:
        parser.error("need 0 < --warmup < --seconds, --rate > 0, --connections ≥ 1")
    if args.slots < 3:
        parser.error("--slots must be at least 3 (2 for the crash job, 1 for a submission)")
    info = machine_info()
    started = time.monotonic()
    with scratch(prefix="elasticd-load-", keep=args.keep) as root:
        if args.keep:
            print(f"[bench_load] scratch folder: {root}", file=sys.stderr)
        try:
            res = measure(args, root)
        except Exception:
            traceback.print_exc()
            return 2
    text, figures, ok = report(res, args)
    info["loadavg_at_end"] = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    mode = "quick" if args.quick else "full"
    print(
        f"\n## Load: {args.rate:g} req/s of mixed reads + a submission every "
        f"{args.submit_every:g} s for {args.seconds:g} s, a job crashing every "
        f"{args.crash_every:g} s ({mode}, {time.monotonic() - started:.0f} s in all)\n"
    )
    print("Machine: " + ", ".join(f"{k} {v}" for k, v in info.items()) + "\n")
    print(text)
    if args.json:
        args.json.write_text(
            json.dumps({"machine": info, "args": vars(args), "figures": figures}, default=str)
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
