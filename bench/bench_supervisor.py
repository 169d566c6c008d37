"""Issue #2's supervisor figures for elasticd, side by side with torchrun, in one run.

Five measurements (``--only`` picks some; ``--quick`` runs reduced counts):

``exit``         exit detection: a worker's exit -> its ``worker.exited`` event;
``respawn``      crash -> the replacement worker process is forked;
                 (``exit`` and ``respawn`` come from the same restart loops)
``idle``         the idle daemon's RSS and CPU, with and without a finished job;
``api``          ``GET /jobs/{id}/workers`` latency at 200 requests/s, open loop;
``reliability``  the crash-once gloo job (examples/train_crash_once.py) recovers.

torchrun runs the same worker scripts in the same run (``torchrun --standalone``
from this interpreter's environment), and its figures are given as ratios
``torchrun / elasticd`` where a comparable observable exists. How each figure
is measured is in the docstring of the function that measures it, and in
docs/benchmarks.md.

Usage::

    .venv/bin/python bench/bench_supervisor.py [--quick] [--only exit,respawn,...]
                                               [--json results.json] [--keep]

Prints a markdown table (goals, elasticd, torchrun, ratio, pass/fail) and, with
``--json``, writes every figure. Exits 0 when every goal was met, 1 when one
was missed, 2 when a measurement itself failed (its traceback is printed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import (
    PYTHON,
    ROOT,
    WORKERS,
    Deadline,
    ElasticdServer,
    ExitRecord,
    HttpError,
    RawHttp,
    StartRecord,
    Stats,
    fmt,
    glog_time,
    machine_info,
    md_table,
    new_tag,
    poll_until,
    proc_cpu_seconds,
    proc_rss_mb,
    proc_wakeups,
    ratio,
    read_records,
    reap_tagged,
    run_bounded,
    scratch,
    tagged_env,
    tick_args,
    torchrun_path,
)

SECTIONS = ("exit", "respawn", "idle", "api", "reliability")
CRASH_ONCE = ROOT / "examples" / "train_crash_once.py"
TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")


@dataclass(frozen=True)
class Plan:
    """How much to measure."""

    loop_runs: int
    """Restart-loop jobs per supervisor (each one a separate job / torchrun invocation)."""
    loop_restarts: int
    """Crashes (and so restarts) per restart-loop job."""
    crash_after: float
    """How long the crashing worker lives, so the supervisor is idle when it exits."""
    idle_settle: float
    idle_seconds: float
    api_seconds: float
    api_rate: float
    reliability_elasticd: int
    reliability_torchrun: int
    reliability_timeout: float
    """Bound of one gloo job (normally 3-6 s); a job still running then counts as hung."""


FULL = Plan(
    loop_runs=3,
    loop_restarts=10,
    crash_after=0.3,
    idle_settle=5.0,
    idle_seconds=30.0,
    api_seconds=10.0,
    api_rate=200.0,
    reliability_elasticd=20,
    reliability_torchrun=5,
    reliability_timeout=30.0,
)
QUICK = Plan(
    loop_runs=1,
    loop_restarts=6,
    crash_after=0.3,
    idle_settle=3.0,
    idle_seconds=10.0,
    api_seconds=5.0,
    api_rate=200.0,
    reliability_elasticd=5,
    reliability_torchrun=2,
    reliability_timeout=20.0,
)


@dataclass
class Results:
    """Everything measured, as plain data (written as JSON with ``--json``)."""

    machine: dict[str, str]
    plan: dict[str, Any]
    figures: dict[str, Any] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


def ms(values: list[float]) -> dict[str, float | int]:
    """Seconds -> summary in milliseconds."""
    return Stats.of(values, 1000.0).as_dict()


# -- 1 + 2: restart loops ---------------------------------------------------------------


@dataclass
class LoopSamples:
    """Per-crash latencies (seconds) from one supervisor's restart loops."""

    exit_to_event: list[float] = field(default_factory=list)
    """elasticd: crash -> ``worker.exited`` event time."""
    any_exit_to_event: list[float] = field(default_factory=list)
    """elasticd: every recorded exit (crash, SIGTERM, success) -> its event time."""
    exit_to_client: list[float] = field(default_factory=list)
    """elasticd: crash -> a long-polling API client has the event."""
    exit_to_log: list[float] = field(default_factory=list)
    """torchrun: crash -> its "Sending process ... closing signal SIGTERM" log line."""
    exit_to_sigterm: list[float] = field(default_factory=list)
    """Both: crash -> the surviving worker's SIGTERM handler runs."""
    crash_to_fork: list[float] = field(default_factory=list)
    """Both: crash -> the replacement of the crashed rank is forked (scheduler accounting)."""
    crash_to_proc_start: list[float] = field(default_factory=list)
    """Both: crash -> replacement's /proc starttime (+ half a tick)."""
    crash_to_first_stmt: list[float] = field(default_factory=list)
    """Both: crash -> replacement's first Python statement (includes interpreter start-up)."""
    milestones: dict[str, list[float]] = field(default_factory=dict)
    """elasticd: crash -> each step of the restart path, from the events' times."""
    runs_ok: int = 0
    runs: int = 0
    wall_s: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"runs": self.runs, "runs_ok": self.runs_ok, "wall_s": self.wall_s}
        if self.milestones:
            out["restart_path"] = {k: ms(v) for k, v in self.milestones.items()}
        for name in (
            "exit_to_event",
            "any_exit_to_event",
            "exit_to_client",
            "exit_to_log",
            "exit_to_sigterm",
            "crash_to_fork",
            "crash_to_proc_start",
            "crash_to_first_stmt",
        ):
            values = getattr(self, name)
            if values:
                out[name] = ms(values)
        return out


def crash_samples(
    starts: list[StartRecord], exits: list[ExitRecord], restarts: int, into: LoopSamples
) -> dict[int, ExitRecord]:
    """Add the supervisor-independent samples of one loop; returns the crashes by attempt."""
    tick = 0.01  # /proc starttime resolution: 1/CLK_TCK, truncated
    crashes = {e.attempt: e for e in exits if e.why == "crash"}
    survivors = {e.attempt: e for e in exits if e.why == "sigterm" and e.rank != 1}
    replacements = {s.attempt: s for s in starts if s.rank == 1}
    for attempt in range(restarts):
        crash = crashes.get(attempt)
        if crash is None:
            continue
        survivor = survivors.get(attempt)
        if survivor is not None and survivor.signalled_at is not None:
            into.exit_to_sigterm.append(survivor.signalled_at - crash.exit_time)
        new = replacements.get(attempt + 1)
        if new is not None:
            if new.fork_est is not None:
                into.crash_to_fork.append(new.fork_est - crash.exit_time)
            into.crash_to_proc_start.append(new.proc_start + tick / 2 - crash.exit_time)
            into.crash_to_first_stmt.append(new.first_stmt - crash.exit_time)
    return crashes


def follow(server: ElasticdServer, job_id: str, timeout: float) -> dict[int, float]:
    """Long-poll the job's events until it is terminal; each event's seq -> when it arrived."""
    deadline = Deadline(timeout)
    received: dict[int, float] = {}
    after = 0
    while not deadline.expired():
        wait = max(0.1, min(5.0, deadline.remaining()))
        r = server.client.get(
            f"/jobs/{job_id}/events", params={"after": after, "wait": wait}, timeout=wait + 10
        )
        now = time.time()
        r.raise_for_status()
        events = r.json()
        for event in events:
            received[event["seq"]] = now
            after = max(after, event["seq"])
        if any(e["kind"] == "job.state" and e.get("state") in TERMINAL for e in events):
            return received
    raise TimeoutError(
        f"job {job_id} did not end within {timeout:.0f} s\n{server.diagnose(job_id)}"
    )


def elasticd_loops(root: Path, plan: Plan) -> LoopSamples:
    """Restart loops under elasticd: jobs of 2 tick workers whose rank 1 crashes every attempt.

    Each job (``max_restarts = loop_restarts``) runs ``bench/workers/tick.py``
    with ``python -u``, as torchrun would; rank 1 exits with code 1
    ``crash_after`` seconds into each attempt, rank 0 waits for SIGTERM, and the
    last attempt succeeds. The crash time is what the worker wrote just before
    ``os._exit(1)``; the event time is the ``time`` field of the
    ``worker.exited`` event with the crashed pid (the daemon reads the clock
    as it records the event); the client time is when a concurrent
    ``GET /jobs/{id}/events?wait=`` long-poll returned it.
    """
    samples = LoopSamples()
    with ElasticdServer(root, "loops") as server:
        for run in range(plan.loop_runs):
            out = root / f"elasticd-loop-{run}"
            out.mkdir()
            job_id = f"loop-{run}"
            spec = {
                "id": job_id,
                "entrypoint": PYTHON,
                "args": tick_args(
                    out,
                    crash_attempts=plan.loop_restarts,
                    crash_after=plan.crash_after,
                    max_wait=60,
                ),
                "cwd": str(ROOT),
                "nproc_per_node": 2,
                "max_restarts": plan.loop_restarts,
                "termination_grace": 5,
            }
            samples.runs += 1
            started = time.monotonic()
            server.submit(spec)
            try:
                received = follow(server, job_id, 30 + 5 * plan.loop_restarts)
            except TimeoutError:
                server.cancel(job_id)
                raise
            samples.wall_s.append(time.monotonic() - started)
            job = server.job(job_id)
            if job["state"] == "SUCCEEDED" and job["restart_count"] == plan.loop_restarts:
                samples.runs_ok += 1
            events = server.events(job_id)
            starts, exits = read_records(out)
            crashes = crash_samples(starts, exits, plan.loop_restarts, samples)
            exited = {e["pid"]: e for e in events if e["kind"] == "worker.exited"}
            for crash in crashes.values():
                event = exited.get(crash.pid)
                if event is not None:
                    samples.exit_to_event.append(event["time"] - crash.exit_time)
                    if event["seq"] in received:
                        samples.exit_to_client.append(received[event["seq"]] - crash.exit_time)
            for record in exits:
                event = exited.get(record.pid)
                if event is not None:
                    samples.any_exit_to_event.append(event["time"] - record.exit_time)
            restart_path(events, exited, crashes, samples.milestones)
    return samples


#: The steps of elasticd's restart path, as (label, event kind, required state or None).
MILESTONES = (
    ("worker.exited", "worker.exited", None),
    ("workers.stopped", "workers.stopped", None),
    ("job RESTARTING", "job.state", "RESTARTING"),
    ("rendezvous.complete", "rendezvous.complete", None),
    ("workers.started", "workers.started", None),
)


def restart_path(
    events: list[dict[str, Any]],
    exited: dict[int, dict[str, Any]],
    crashes: dict[int, ExitRecord],
    into: dict[str, list[float]],
) -> None:
    """Add crash -> each milestone of the restart that followed (event times), per crash."""
    ordered = sorted(events, key=lambda e: (e["time"], e["seq"]))
    for crash in crashes.values():
        first = exited.get(crash.pid)
        if first is None:
            continue
        later = [e for e in ordered if e["time"] >= first["time"]]
        for label, kind, state in MILESTONES:
            match = next(
                (e for e in later if e["kind"] == kind and (state is None or e["state"] == state)),
                None,
            )
            if match is None:
                break
            into.setdefault(label, []).append(match["time"] - crash.exit_time)
            later = [e for e in later if e["time"] >= match["time"]]


SENDING = re.compile(r"Sending process (\d+) closing signal SIGTERM")


def torchrun_loops(root: Path, plan: Plan) -> LoopSamples:
    """The same restart loops under ``torchrun --standalone --nproc-per-node 2``.

    torchrun records no event, so its exit detection is observed two ways:
    the time stamp of the first log line it writes once it has seen the
    failure (``Sending process <survivor> closing signal SIGTERM``, logged by
    the same poll that found the exit, millisecond resolution), and the time
    the surviving worker's SIGTERM handler runs (also measured for elasticd).
    Its agent looks every ``--monitor-interval`` (default 0.1 s).
    """
    samples = LoopSamples()
    torchrun = torchrun_path()
    for run in range(plan.loop_runs):
        out = root / f"torchrun-loop-{run}"
        out.mkdir()
        script = tick_args(
            out, crash_attempts=plan.loop_restarts, crash_after=plan.crash_after, max_wait=60
        )[1:]  # torchrun adds "python -u" itself
        argv = [
            torchrun,
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            str(plan.loop_restarts),
            *script,
        ]
        samples.runs += 1
        done = run_bounded(
            argv, 60 + 5 * plan.loop_restarts, new_tag(), root / f"torchrun-{run}.log"
        )
        samples.wall_s.append(done.elapsed)
        if done.code == 0:
            samples.runs_ok += 1
        starts, exits = read_records(out)
        crashes = crash_samples(starts, exits, plan.loop_restarts, samples)
        logged: dict[int, float] = {}
        for line in done.output.splitlines():
            match = SENDING.search(line)
            stamp = glog_time(line)
            if match and stamp is not None:
                logged.setdefault(int(match.group(1)), stamp)
        survivors = {e.attempt: e.pid for e in exits if e.why == "sigterm" and e.rank != 1}
        for attempt, crash in crashes.items():
            pid = survivors.get(attempt)
            if pid is not None and pid in logged:
                # The log has whole milliseconds (truncated): add half of one.
                samples.exit_to_log.append(logged[pid] + 0.0005 - crash.exit_time)
    return samples


def fork_estimate_check(root: Path, count: int) -> dict[str, Any]:
    """How well the worker's fork-time estimate matches a known spawn.

    Starts ``count`` tick workers (``--calibrate``) with ``subprocess.Popen``
    and compares each worker's ``fork_est`` with the clock read just before
    and just after the ``Popen`` call: a good estimate lies between the two.
    """
    out = root / "calibrate"
    out.mkdir()
    before_after: dict[int, tuple[float, float]] = {}
    tag = new_tag()
    try:
        for _ in range(count):
            before = time.time()
            proc = subprocess.Popen(
                [PYTHON, *tick_args(out, calibrate=True)],
                env=tagged_env(tag),
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
            after = time.time()
            before_after[proc.pid] = (before, after)
            proc.wait(timeout=30)
    finally:
        reap_tagged(tag)
    starts, _ = read_records(out)
    offsets, inside, startup = [], 0, []
    for s in starts:
        before, after = before_after[s.pid]
        if s.fork_est is None:
            continue
        offsets.append(s.fork_est - before)
        inside += before - 0.0005 <= s.fork_est <= after + 0.0005
        startup.append(s.first_stmt - s.fork_est)
    return {
        "spawns": len(offsets),
        "fork_est_minus_popen_call": ms(offsets),
        "within_popen_call_pm_0_5ms": inside,
        "interpreter_startup": ms(startup),
    }


# -- 3: idle cost -----------------------------------------------------------------------------


def settle(daemons: dict[str, ElasticdServer], minimum: float, bound: float = 15.0) -> bool:
    """Wait ``minimum`` s, then until a 1 s window in which no daemon used a CPU tick.

    Gives up after ``minimum + bound`` s; returns whether the daemons went quiet.
    """
    time.sleep(minimum)  # the settling period itself, not a wait for a condition
    deadline = Deadline(bound)
    while not deadline.expired():
        before = {name: proc_cpu_seconds(d.pid) for name, d in daemons.items()}
        time.sleep(1.0)
        if all(proc_cpu_seconds(d.pid) == before[name] for name, d in daemons.items()):
            return True
    return False


def idle_cost(root: Path, plan: Plan) -> dict[str, Any]:
    """RSS and CPU of two idle daemons sampled side by side over ``idle_seconds``.

    One daemon is fresh; the other first runs one small job to the end (two
    tick workers, one crash and one restart). Both are then left alone for
    ``idle_settle`` seconds, after which ``VmRSS`` (``/proc/PID/status``) is
    read every second and ``utime + stime`` (``/proc/PID/stat``) at both ends
    of the window: CPU % = CPU seconds / wall seconds * 100 (of one core).
    Context switches of all the daemon's threads give its wake-ups per second.
    """
    with ElasticdServer(root, "idle-empty") as empty, ElasticdServer(root, "idle-history") as used:
        out = root / "idle-job"
        out.mkdir()
        spec = {
            "id": "history",
            "entrypoint": PYTHON,
            "args": tick_args(out, crash_attempts=1, crash_after=0.2, max_wait=60),
            "cwd": str(ROOT),
            "nproc_per_node": 2,
            "max_restarts": 1,
            "termination_grace": 5,
        }
        used.submit(spec)
        job = used.wait_terminal("history", 60)
        daemons = {"fresh": empty, "one_finished_job": used}
        settled = settle(daemons, plan.idle_settle)
        rss: dict[str, list[float]] = {name: [] for name in daemons}
        cpu0 = {name: proc_cpu_seconds(d.pid) for name, d in daemons.items()}
        wake0 = {name: proc_wakeups(d.pid) for name, d in daemons.items()}
        t0 = time.monotonic()
        window = Deadline(plan.idle_seconds)
        next_sample = time.monotonic()
        while True:
            for name, d in daemons.items():
                rss[name].append(proc_rss_mb(d.pid))
            if window.expired():
                break
            next_sample += 1.0
            # The sampling period itself: nothing is awaited here.
            time.sleep(max(0.0, min(next_sample, window.at) - time.monotonic()))
        elapsed = time.monotonic() - t0
        result: dict[str, Any] = {
            "history_job_state": job["state"],
            "window_s": elapsed,
            "settled": settled,
        }
        for name, d in daemons.items():
            cpu = proc_cpu_seconds(d.pid) - cpu0[name]
            wakeups = proc_wakeups(d.pid) - wake0[name]
            result[name] = {
                "wakeups_per_s": wakeups / elapsed,
                "threads": len(list(Path(f"/proc/{d.pid}/task").iterdir())),
                "rss_mb_max": max(rss[name]),
                "rss_mb_last": rss[name][-1],
                "samples": len(rss[name]),
                "cpu_s": cpu,
                "cpu_pct": cpu / elapsed * 100,
            }
        return result


# -- 4: API latency --------------------------------------------------------------------------------


async def open_loop(
    host: str, port: int, path: str, rate: float, seconds: float, keepalive: bool
) -> dict[str, Any]:
    """Issue GET ``path`` every 1/``rate`` s for ``seconds`` s, not waiting for answers.

    Each latency is measured from the request's *scheduled* time to its
    answer (so a slow answer delays nobody's clock: no coordinated omission),
    and also from the moment the request was actually written. With
    ``keepalive`` the client reuses its connections (as HTTP client libraries
    do; 50 warm-up requests open the first); without, every request opens and
    closes its own. The client is :class:`RawHttp`, lean enough that its own
    scheduling lag (reported) stays well under a millisecond on an idle machine.
    """
    interval = 1.0 / rate
    count = int(seconds * rate)
    client = RawHttp(host, port, keepalive)
    loop = asyncio.get_running_loop()
    scheduled_lat: list[float] = []
    service_lat: list[float] = []
    lag: list[float] = []
    failures: list[str] = []
    try:
        for _ in range(50):
            status, _ = await client.get(path)
            if status != 200:
                raise RuntimeError(f"warm-up GET {path} answered {status}")

        async def one(at: float) -> None:
            sent = loop.time()
            lag.append(sent - at)
            try:
                status, _ = await client.get(path)
            except (HttpError, TimeoutError) as exc:
                failures.append(str(exc)[:80] or type(exc).__name__)
                return
            done = loop.time()
            if status != 200:
                failures.append(f"HTTP {status}")
                return
            scheduled_lat.append(done - at)
            service_lat.append(done - sent)

        tasks: list[asyncio.Task[None]] = []
        start = loop.time() + 0.05
        for i in range(count):
            at = start + i * interval
            delay = at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(at)))
        issued = loop.time() - start
        _, pending = await asyncio.wait(tasks, timeout=10.0)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=5.0)
    finally:
        await client.aclose()
    return {
        "requests": count,
        "ok": len(scheduled_lat),
        "failed": len(failures) + len(pending),
        "failures": sorted(set(failures))[:5],
        "connections_opened": client.opened,
        "target_rate": rate,
        "achieved_rate": count / max(issued, 1e-9),
        "latency_from_schedule": ms(scheduled_lat),
        "latency_from_send": ms(service_lat),
        "client_lag": ms(lag),
    }


def api_latency(root: Path, plan: Plan) -> dict[str, Any]:
    """``GET /jobs/{id}/workers`` under an open-loop load while a 2-worker sleeper job runs.

    The load is ``api_rate`` requests/s for ``api_seconds`` s from one asyncio
    client in this process (:func:`open_loop`), twice: with keep-alive
    connections (the headline figure: what HTTP client libraries do), then
    with a new connection per request. The daemon's CPU and RSS over each window are
    recorded too.
    """
    with ElasticdServer(root, "api") as server:
        out = root / "sleeper"
        out.mkdir()
        server.submit(
            {
                "id": "sleeper",
                "entrypoint": PYTHON,
                "args": tick_args(out, sleep=True, max_wait=plan.api_seconds + 120),
                "cwd": str(ROOT),
                "nproc_per_node": 2,
                "max_restarts": 0,
                "termination_grace": 5,
            }
        )

        def running() -> dict[str, Any] | None:
            view = server.client.get("/jobs/sleeper/workers").json()
            workers = [w for g in view.get("groups", []) for w in g["workers"]]
            if len(workers) == 2 and all(w.get("pid") for w in workers):
                return dict(view)
            return None

        try:
            view = poll_until(running, 30, "the sleeper's two workers")
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}\n{server.diagnose('sleeper')}") from None
        body_bytes = len(json.dumps(view))
        result: dict[str, Any] = {"response_bytes": body_bytes}
        for mode, keepalive in (("keepalive", True), ("fresh_connections", False)):
            cpu0, t0 = proc_cpu_seconds(server.pid), time.monotonic()
            load = asyncio.run(
                open_loop(
                    "127.0.0.1",
                    server.port,
                    "/jobs/sleeper/workers",
                    plan.api_rate,
                    plan.api_seconds,
                    keepalive,
                )
            )
            cpu = proc_cpu_seconds(server.pid) - cpu0
            load["daemon_cpu_pct_under_load"] = cpu / (time.monotonic() - t0) * 100
            load["daemon_rss_mb_after"] = proc_rss_mb(server.pid)
            result[mode] = load
        result["job_state_during"] = server.job("sleeper")["state"]
        server.cancel("sleeper")
        server.wait_terminal("sleeper", 30)
    return result


# -- 5: restart reliability -----------------------------------------------------------------------


GLOO_ERROR = re.compile(r"connectFullMesh|Connection refused")
TORCH_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank")


def reliability(root: Path, plan: Plan) -> dict[str, Any]:
    """The crash-once gloo job, repeatedly: under one elasticd daemon, then under torchrun.

    elasticd: ``reliability_elasticd`` jobs submitted one after another
    (2 workers, ``max_restarts`` 3, ``termination_grace`` 5), each followed to
    its end; success = ``SUCCEEDED``. torchrun:
    ``torchrun --standalone --nproc-per-node 2 --max-restarts 3
    examples/train_crash_once.py``, ``reliability_torchrun`` times; success =
    exit code 0. Either kind of run still going after ``reliability_timeout``
    seconds (a healthy one takes 3-6 s here) counts as hung: it is cancelled
    (elasticd) or killed with its process group (torchrun) and is a failure.
    Runs whose output mentions ``connectFullMesh`` or ``Connection refused``
    are counted, and so are the attempts each run needed.
    """
    ed: dict[str, Any] = {
        "runs": 0,
        "succeeded": 0,
        "hung": 0,
        "restarts": [],
        "wall_s": [],
        "failures": [],
    }
    with ElasticdServer(root, "reliability") as server:
        for i in range(plan.reliability_elasticd):
            job_id = f"gloo-{i}"
            ed["runs"] += 1
            started = time.monotonic()
            server.submit(
                {
                    "id": job_id,
                    "entrypoint": PYTHON,
                    "args": [str(CRASH_ONCE)],
                    "cwd": str(ROOT),
                    "nproc_per_node": 2,
                    "max_restarts": 3,
                    "termination_grace": 5,
                }
            )
            try:
                job = server.wait_terminal(job_id, plan.reliability_timeout)
            except TimeoutError as exc:
                ed["hung"] += 1
                ed["failures"].append(f"{job_id}: {exc}")
                server.cancel(job_id)
                server.wait_terminal(job_id, 60)
                continue
            ed["wall_s"].append(time.monotonic() - started)
            ed["restarts"].append(job["restart_count"])
            if job["state"] == "SUCCEEDED":
                ed["succeeded"] += 1
            else:
                ed["failures"].append(f"{job_id}: {job['state']}: {job.get('reason')}")
    tr: dict[str, Any] = {
        "runs": 0,
        "succeeded": 0,
        "hung": 0,
        "gloo_errors": 0,
        "restarts": [],
        "wall_s": [],
        "codes": [],
    }
    torchrun = torchrun_path()
    for i in range(plan.reliability_torchrun):
        tr["runs"] += 1
        done = run_bounded(
            [
                torchrun,
                "--standalone",
                "--nproc-per-node",
                "2",
                "--max-restarts",
                "3",
                str(CRASH_ONCE),
            ],
            plan.reliability_timeout,
            new_tag(),
            root / f"torchrun-gloo-{i}.log",
        )
        tr["wall_s"].append(done.elapsed)
        tr["codes"].append(done.code)
        tr["succeeded"] += done.code == 0
        tr["hung"] += done.code is None
        tr["gloo_errors"] += bool(GLOO_ERROR.search(done.output))
        tr["restarts"].append(len(TORCH_FAILED.findall(done.output)))
    return {"elasticd": ed, "torchrun": tr}


# -- report ------------------------------------------------------------------------------------


def passed(ok: bool | None) -> str:
    return "—" if ok is None else ("✅ pass" if ok else "❌ FAIL")


def build_table(res: Results) -> tuple[str, str, bool]:
    """(main table, details table, every goal met) from the figures."""
    f = res.figures
    rows: list[list[str]] = []
    details: list[list[str]] = []
    all_ok = True

    def p(d: dict[str, Any] | None, key: str, q: str = "p50") -> float | None:
        if not d or key not in d:
            return None
        return float(d[key][q])

    ed = f.get("loops", {}).get("elasticd")
    tr = f.get("loops", {}).get("torchrun")
    if ed is not None:
        v = p(ed, "exit_to_event")
        ok = v is not None and v <= 5.0
        all_ok &= ok
        rows.append(
            [
                "1. Exit detection: worker exit → `worker.exited` event (ms)",
                "p50 ≤ 5",
                f"{fmt(v, 2)} / {fmt(p(ed, 'exit_to_event', 'p99'), 2)}",
                f"{fmt(p(tr, 'exit_to_log'))} / {fmt(p(tr, 'exit_to_log', 'p99'))} ¹",
                ratio(p(tr, "exit_to_log"), v),
                passed(ok),
            ]
        )
        v2 = p(ed, "crash_to_fork")
        ok2 = v2 is not None and v2 <= 50.0
        all_ok &= ok2
        rows.append(
            [
                "2. Crash → replacement process forked (ms)",
                "p50 ≤ 50",
                f"{fmt(v2)} / {fmt(p(ed, 'crash_to_fork', 'p99'))}",
                f"{fmt(p(tr, 'crash_to_fork'))} / {fmt(p(tr, 'crash_to_fork', 'p99'))}",
                ratio(p(tr, "crash_to_fork"), v2),
                passed(ok2),
            ]
        )
        for key, label in (
            ("exit_to_sigterm", "Crash → survivors' SIGTERM handler runs (ms)"),
            ("exit_to_client", "Crash → `worker.exited` returned to a long-polling client (ms)"),
            ("any_exit_to_event", "Any exit (crash, SIGTERM, success) → its event (ms)"),
            ("crash_to_proc_start", "Crash → replacement /proc starttime + 5 ms (10 ms ticks)"),
            ("crash_to_first_stmt", "Crash → replacement's first statement (ms)"),
        ):
            details.append(
                [
                    label,
                    f"{fmt(p(ed, key))} / {fmt(p(ed, key, 'p99'))} (n={(ed.get(key) or {}).get('n', 0)})",
                    f"{fmt(p(tr, key))} / {fmt(p(tr, key, 'p99'))} (n={((tr or {}).get(key) or {}).get('n', 0)})",
                    ratio(p(tr, key), p(ed, key)),
                ]
            )
        details.append(
            [
                "Restart-loop runs that ended as planned",
                f"{ed['runs_ok']}/{ed['runs']} (n={(ed.get('exit_to_event') or {}).get('n', 0)} crashes)",
                f"{(tr or {}).get('runs_ok', 0)}/{(tr or {}).get('runs', 0)} (n={((tr or {}).get('exit_to_sigterm') or {}).get('n', 0)} crashes)",
                "",
            ]
        )
        if ed["runs_ok"] != ed["runs"]:
            all_ok = False
    for label, stats in ((ed or {}).get("restart_path") or {}).items():
        details.append(
            [
                f"elasticd restart path: crash → `{label}` event (ms)",
                f"{fmt(stats['p50'])} / {fmt(stats['p99'])} (n={stats['n']})",
                "",
                "",
            ]
        )
    cal = f.get("loops", {}).get("fork_estimate_check")
    if cal:
        details.append(
            [
                "Fork-time estimator check: estimate − time before Popen (ms)",
                f"{fmt(cal['fork_est_minus_popen_call']['p50'], 2)} / "
                f"{fmt(cal['fork_est_minus_popen_call']['p99'], 2)} "
                f"({cal['within_popen_call_pm_0_5ms']}/{cal['spawns']} within the call ±0.5 ms)",
                "",
                "",
            ]
        )
    idle = f.get("idle")
    if idle is not None:
        for name, label in (("fresh", "fresh"), ("one_finished_job", "after one finished job")):
            d = idle[name]
            ok_rss = d["rss_mb_max"] <= 80.0
            ok_cpu = d["cpu_pct"] <= 0.5
            all_ok &= ok_rss and ok_cpu
            rows.append(
                [
                    f"3. Idle RSS, {label} (MiB, max)",
                    "≤ 80",
                    fmt(d["rss_mb_max"]),
                    "—",
                    "—",
                    passed(ok_rss),
                ]
            )
            rows.append(
                [
                    f"3. Idle CPU, {label} (% of a core, {idle['window_s']:.0f} s)",
                    "≤ 0.5",
                    fmt(d["cpu_pct"], 3),
                    "—",
                    "—",
                    passed(ok_cpu),
                ]
            )
    api = f.get("api")
    if api is not None:
        for mode, label in (
            ("keepalive", "keep-alive client"),
            ("fresh_connections", "new connection per request"),
        ):
            load = api[mode]
            lat = load["latency_from_schedule"]
            line = [
                f"4. `GET /jobs/{{id}}/workers` at {load['target_rate']:.0f} req/s, {label} (ms)",
                "p99 ≤ 20",
                f"{fmt(lat['p50'], 2)} / {fmt(lat['p99'], 2)}",
                "—",
                "—",
            ]
            if mode == "keepalive":
                ok = lat["p99"] <= 20.0 and load["failed"] == 0
                all_ok &= ok
                rows.append([*line, passed(ok)])
            else:
                rows.append([*line, f"({passed(lat['p99'] <= 20.0 and load['failed'] == 0)})"])
            send, lag = load["latency_from_send"], load["client_lag"]
            details.append(
                [
                    f"API, {label}: latency from send; client scheduling lag (ms)",
                    f"{fmt(send['p50'], 2)} / {fmt(send['p99'], 2)}; "
                    f"lag {fmt(lag['p50'], 2)} / {fmt(lag['p99'], 2)}",
                    "",
                    "",
                ]
            )
            details.append(
                [
                    f"API, {label}: ok / failed, achieved rate, daemon CPU, RSS",
                    f"{load['ok']} / {load['failed']}, {load['achieved_rate']:.0f} req/s, "
                    f"{load['daemon_cpu_pct_under_load']:.0f}% of a core, "
                    f"{load['daemon_rss_mb_after']:.0f} MiB",
                    "",
                    "",
                ]
            )
    rel = f.get("reliability")
    if rel is not None:
        e, t = rel["elasticd"], rel["torchrun"]
        ok = e["runs"] > 0 and e["succeeded"] == e["runs"]
        all_ok &= ok
        rows.append(
            [
                "5. Crash-once gloo job recovers (successes / runs)",
                "all",
                f"{e['succeeded']}/{e['runs']}",
                f"{t['succeeded']}/{t['runs']}",
                "—",
                passed(ok),
            ]
        )
        details.append(
            [
                "Gloo job: hung (killed) / runs with gloo connect errors / restarts used",
                f"{e['hung']} / — / {e['restarts']}",
                f"{t['hung']} / {t['gloo_errors']} / {t['restarts']}",
                "",
            ]
        )
        finished_torchrun = [
            w for w, c in zip(t["wall_s"], t["codes"], strict=True) if c is not None
        ]
        details.append(
            [
                "Gloo job wall time of finished runs, p50 (s)",
                fmt(Stats.of(e["wall_s"]).p50, 2),
                fmt(Stats.of(finished_torchrun).p50, 2),
                "",
            ]
        )
    for section, message in res.errors.items():
        all_ok = False
        rows.append(
            [f"{section}: measurement failed", "", message.splitlines()[0][:100], "", "", "❌ FAIL"]
        )
    main = md_table(
        [
            "Figure",
            "Goal",
            "elasticd p50 / p99",
            "torchrun p50 / p99",
            "torchrun ÷ elasticd",
            "Result",
        ],
        rows,
    )
    detail = md_table(
        ["Supporting figure", "elasticd p50 / p99", "torchrun p50 / p99", "torchrun ÷ elasticd"],
        details,
    )
    return main, detail, all_ok


# -- main ----------------------------------------------------------------------------------------


def run_section(res: Results, name: str, measure: Callable[[], Any]) -> None:
    """Run one measurement, keeping its failure (with traceback) instead of stopping."""
    started = time.monotonic()
    print(f"[bench_supervisor] {name} ...", file=sys.stderr, flush=True)
    try:
        res.figures[name] = measure()
    except Exception as exc:
        res.errors[name] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    print(
        f"[bench_supervisor] {name} done in {time.monotonic() - started:.1f} s",
        file=sys.stderr,
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="reduced counts (under ~2 minutes)")
    parser.add_argument(
        "--only",
        default=",".join(SECTIONS),
        help=f"comma-separated subset of {','.join(SECTIONS)} (default: all)",
    )
    parser.add_argument("--json", type=Path, help="write every figure to this JSON file")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder (logs)")
    args = parser.parse_args(argv)
    wanted = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(wanted) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown section(s) {unknown}; choose from {SECTIONS}")
    plan = QUICK if args.quick else FULL
    res = Results(machine=machine_info(), plan={**plan.__dict__, "quick": args.quick})
    started = time.monotonic()
    with scratch(keep=args.keep) as root:
        if args.keep:
            print(f"[bench_supervisor] scratch folder: {root}", file=sys.stderr)
        if "exit" in wanted or "respawn" in wanted:

            def loops() -> dict[str, Any]:
                return {
                    "fork_estimate_check": fork_estimate_check(root, 10),
                    "elasticd": elasticd_loops(root, plan).summary(),
                    "torchrun": torchrun_loops(root, plan).summary(),
                }

            run_section(res, "loops", loops)
        if "idle" in wanted:
            run_section(res, "idle", lambda: idle_cost(root, plan))
        if "api" in wanted:
            run_section(res, "api", lambda: api_latency(root, plan))
        if "reliability" in wanted:
            run_section(res, "reliability", lambda: reliability(root, plan))
    res.figures["total_wall_s"] = time.monotonic() - started
    res.machine["loadavg_at_end"] = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    main_table, detail_table, all_ok = build_table(res)
    mode = "quick" if args.quick else "full"
    print(f"\n## Supervisor benchmark ({mode}, {res.figures['total_wall_s']:.0f} s)\n")
    print(
        "Machine: "
        + ", ".join(f"{k} {v}" for k, v in res.machine.items())
        + f"; worker script {WORKERS.relative_to(ROOT) / 'tick.py'}\n"
    )
    print(main_table)
    print(
        "\n¹ torchrun records no event: its figure is the time stamp of its first log line "
        "after it saw the exit (`Sending process … closing signal SIGTERM`, 1 ms resolution); "
        "its agent polls every `--monitor-interval` (0.1 s by default).\n"
    )
    print(detail_table)
    if args.json:
        args.json.write_text(json.dumps(res.__dict__, indent=2, default=str))
    if res.errors:
        return 2
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
