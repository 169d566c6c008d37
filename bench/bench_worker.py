"""Worker-side costs and recovery times: ping(), hang detection, in-process vs. process restart.

What is measured:

1. ``elasticd.worker.ping()`` per call: mapped (running under elasticd) and
   unmapped (no heartbeat file: the no-op path). Goal: <= 20 us.
2. Hang detection: a real worker pings, then blocks forever; the daemon's
   :class:`~elasticd.agent.progress.ProgressMonitor` reports the hang. The
   figure is how late after the deadline (last ping + progress_timeout) the
   report comes. Goal: the restart starts within progress_timeout + 1 s.
3. Recovery after rank 1 raises at step 3, from the fault (the failing
   rank's wall clock just before it raises) to *every* rank being back in
   the training function with a new process group (the latest rank's wall
   clock after ``init_process_group``):

   * in-process restart (``examples/inprocess_train.py``) under
     ``elasticd run``, 2 and 4 ranks;
   * a full process restart of the same training loop under
     ``elasticd run --max-restarts 1``;
   * the same under ``torchrun --max-restarts 1`` (when torch is installed).

   Everything is gloo on CPU, on this machine; the process restarts include
   starting Python and ``import torch`` again, which is the point.

Usage: ``python bench/bench_worker.py [--runs 3] [--skip-restarts] [--json]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
INPROCESS = ROOT / "examples" / "inprocess_train.py"

#: The same loop as examples/inprocess_train.py, without the wrapper: a plain torchrun script.
PLAIN = """
import os, time, warnings
warnings.filterwarnings("ignore")
import torch, torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
print(f"enter iteration={attempt} rank={rank} world={world} pid={os.getpid()} t={time.time():.6f}", flush=True)
for step in range(6):
    if attempt == 0 and rank == 1 and step == 3:
        print(f"fault raise iteration=0 step={step} t={time.time():.6f}", flush=True)
        raise RuntimeError("rank 1 fails at step 3")
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    time.sleep(0.05)
dist.destroy_process_group()
"""

_T = re.compile(r"\bt=([0-9.]+)")


def stats(values: list[float]) -> str:
    if not values:
        return "n/a"
    ordered = sorted(values)
    return (
        f"median {statistics.median(ordered):.3g}  min {ordered[0]:.3g}  "
        f"max {ordered[-1]:.3g}  (n={len(ordered)})"
    )


# -- 1. ping ---------------------------------------------------------------------------


def bench_ping(calls: int = 1_000_000, repeats: int = 5) -> dict[str, float]:
    """Per-call cost of ping() in nanoseconds, mapped and unmapped (best of ``repeats``)."""
    from elasticd.worker import heartbeat

    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "heartbeat"
        heartbeat.create_heartbeat_file(path)
        for label, env in (("mapped", str(path)), ("no_file", None)):
            if env is None:
                os.environ.pop(heartbeat.ENV_VAR, None)
            else:
                os.environ[heartbeat.ENV_VAR] = env
            heartbeat._reset_for_tests()
            ping = heartbeat.ping
            ping()
            best = float("inf")
            for _ in range(repeats):
                started = time.perf_counter()
                for _ in range(calls):
                    ping()
                best = min(best, (time.perf_counter() - started) / calls)
            results[label] = best * 1e9
        value = heartbeat.read_heartbeat(path)
        if value is None or value.count <= calls:
            raise RuntimeError("the mapped pings did not land in the heartbeat file")
    return results


# -- 2. hang detection --------------------------------------------------------------------

HANGING_WORKER = """
import threading
from elasticd.worker import ping
ping()
print("pinged", flush=True)
threading.Event().wait()
"""


async def _one_hang(tmp: Path, timeout: float) -> float:
    from elasticd.agent.progress import ProgressMonitor, ProgressSettings

    monitor = ProgressMonitor({0: tmp / "hb"}, ProgressSettings(progress_timeout=timeout))
    monitor.prepare()
    env = {**os.environ, "ELASTICD_HEARTBEAT_FILE": str(tmp / "hb"), "PYTHONPATH": str(ROOT)}
    proc = await asyncio.create_subprocess_exec(
        PY, "-c", HANGING_WORKER, env=env, stdout=asyncio.subprocess.PIPE
    )
    try:
        monitor.started(0)
        assert proc.stdout is not None
        await proc.stdout.readline()
        await monitor.wait_for_hang()
        detected = time.monotonic()
        beat = monitor.beat(0)
        if beat is None or beat.last_ping is None:
            raise RuntimeError("the worker never pinged")
        return detected - (beat.last_ping + timeout)
    finally:
        proc.kill()
        await proc.wait()


def bench_hang(runs: int, timeout: float = 0.5) -> list[float]:
    """Seconds from the deadline to the monitor's report, per run."""
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(runs):
            out.append(asyncio.run(_one_hang(Path(tmp), timeout)))
    return out


# -- 3. recovery ------------------------------------------------------------------------------


def _recovery(lines: list[str], world: int) -> float | None:
    """From the fault line to the last rank's ``enter`` of the next iteration (seconds)."""
    fault = [float(m.group(1)) for line in lines if "fault raise" in line if (m := _T.search(line))]
    back = [
        float(m.group(1)) for line in lines if "enter iteration=1" in line if (m := _T.search(line))
    ]
    if not fault or len(back) < world:
        return None
    return max(back) - fault[0]


def _run(argv: list[str], env: dict[str, str], timeout: float = 240) -> list[str]:
    proc = subprocess.run(
        argv,
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
        check=False,
    )
    lines = proc.stdout.splitlines()
    if proc.returncode != 0:
        # The last error a worker printed says why (the first ones are the injected fault).
        errors = [line for line in lines if "RuntimeError: " in line]
        why = errors[-1].strip() if errors else "\n".join(lines[-30:])
        raise RuntimeError(f"exited {proc.returncode}: {why}")
    return lines


def bench_recovery(kind: str, world: int, runs: int) -> tuple[list[float], list[str]]:
    """Recovery seconds per run for ``kind`` in inprocess | elasticd | torchrun, and failures.

    A run whose supervisor fails is reported, not retried: that is a result too.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTICD_", "TORCHELASTIC_"))}
    env["PYTHONPATH"] = str(ROOT)
    env["PYTHONWARNINGS"] = "ignore"
    results: list[float] = []
    failures: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        plain = Path(tmp) / "plain_train.py"
        plain.write_text(textwrap.dedent(PLAIN))
        for _ in range(runs):
            run_env = env
            if kind == "inprocess":
                argv = [PY, "-m", "elasticd", "run", "--nproc-per-node", str(world)]
                argv += ["--max-restarts", "0", "--log-dir", tmp, "--", PY, str(INPROCESS)]
                run_env = {**env, "FAULT": "raise"}
            elif kind == "elasticd":
                argv = [PY, "-m", "elasticd", "run", "--nproc-per-node", str(world)]
                argv += ["--max-restarts", "1", "--log-dir", tmp, "--", PY, str(plain)]
            else:
                argv = [PY, "-m", "torch.distributed.run", "--standalone"]
                argv += ["--nproc-per-node", str(world), "--max-restarts", "1", str(plain)]
            try:
                # A supervisor whose restart hangs is a failed run, not a stuck benchmark.
                lines = _run(argv, run_env, timeout=90)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                failures.append(_first_error(str(exc)))
                continue
            value = _recovery(lines, world)
            if value is None:
                failures.append("no fault/enter lines in the output")
                continue
            results.append(value)
    return results, failures


def _first_error(text: str) -> str:
    """The first line of a failed run's error, shortened."""
    return text.splitlines()[0][:240] if text else "failed"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--skip-restarts", action="store_true", help="only ping and hang detection")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    report: dict[str, object] = {}
    ping = bench_ping()
    report["ping_ns"] = ping
    hang = bench_hang(max(args.runs, 5))
    report["hang_detection_late_s"] = hang
    if not args.json:
        print(f"ping(), mapped:           {ping['mapped']:.0f} ns per call (goal <= 20000 ns)")
        print(f"ping(), no heartbeat file: {ping['no_file']:.0f} ns per call")
        print(f"hang detection, seconds after the deadline: {stats(hang)}")
    if not args.skip_restarts:
        try:
            import torch  # noqa: F401
        except ImportError:
            print("torch is not installed: restart benchmarks skipped")
            return 0
        recovery: dict[str, list[float]] = {}
        failed: dict[str, list[str]] = {}
        report["failed_runs"] = failed
        for kind, world in (
            ("inprocess", 2),
            ("inprocess", 4),
            ("elasticd", 2),
            ("torchrun", 2),
        ):
            values, failures = bench_recovery(kind, world, args.runs)
            recovery[f"{kind}_{world}"] = values
            failed[f"{kind}_{world}"] = failures
            if not args.json:
                print(
                    f"fault -> every rank back with a new group, {kind}, {world} ranks: "
                    f"{stats(values)} s" + (f"; {len(failures)} run(s) failed" if failures else "")
                )
                for failure in failures:
                    print(f"    failed run: {failure}")
        report["recovery_s"] = recovery
    if args.json:
        print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
