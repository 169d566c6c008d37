"""Run every ``bench/bench_*.py`` script, one after another, and summarise.

Each script runs with this interpreter from the repository root, in its own
process group, bounded by ``--timeout`` seconds (then SIGTERM, then SIGKILL
to the group). A script that fails or times out is reported and the next
one runs. ``--quick`` is passed to the scripts that accept it (their source
mentions ``--quick``); the others run with their defaults, which is noted.

Usage::

    .venv/bin/python bench/run_all.py [--quick] [--only supervisor,store] [--out DIR]

``--out DIR`` also saves each script's output as ``DIR/<script>.txt``.
Exits 0 when every script exited 0, else 1.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent


def scripts(only: list[str] | None) -> list[Path]:
    """The benchmark scripts, sorted; ``only`` filters on the part after ``bench_``."""
    found = sorted(BENCH.glob("bench_*.py"))
    if only:
        found = [p for p in found if p.stem.removeprefix("bench_") in only]
    return found


def accepts_quick(script: Path) -> bool:
    """Whether the script has a ``--quick`` flag (judged from its source)."""
    try:
        return "--quick" in script.read_text(errors="replace")
    except OSError:
        return False


def pump(source: IO[bytes], sinks: list[IO[bytes]]) -> None:
    """Copy ``source`` to every sink, line by line, until EOF."""
    for line in iter(source.readline, b""):
        for sink in sinks:
            sink.write(line)
            sink.flush()


def run_one(script: Path, args: list[str], timeout: float, log: Path | None) -> tuple[str, float]:
    """Run one script with its output shown live; returns (status, seconds)."""
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        sinks: list[IO[bytes]] = [sys.stdout.buffer]
        if log is not None:
            sinks.append(stack.enter_context(log.open("wb")))
        proc = subprocess.Popen(
            [sys.executable, str(script), *args],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        assert proc.stdout is not None
        reader = threading.Thread(target=pump, args=(proc.stdout, sinks), daemon=True)
        reader.start()
        try:
            code = proc.wait(timeout=timeout)
            status = "ok" if code == 0 else f"exit {code}"
        except subprocess.TimeoutExpired:
            status = f"timed out after {timeout:.0f} s"
        finally:
            for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
                if proc.poll() is not None:
                    break
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=grace)
            # Leftovers of the group (a script's children), then the output.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            reader.join(timeout=10)
            proc.stdout.close()
    return status, time.monotonic() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run every bench/bench_*.py script.")
    parser.add_argument("--quick", action="store_true", help="pass --quick where supported")
    parser.add_argument("--only", help="comma-separated names, e.g. supervisor,store")
    parser.add_argument(
        "--timeout",
        type=float,
        help="seconds per script (default 900, or 300 with --quick)",
    )
    parser.add_argument("--out", type=Path, help="also save each script's output here")
    args = parser.parse_args(argv)
    timeout = args.timeout or (300.0 if args.quick else 900.0)
    only = [s.strip() for s in args.only.split(",")] if args.only else None
    todo = scripts(only)
    if not todo:
        print("no benchmark scripts found", file=sys.stderr)
        return 1
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    results: list[tuple[str, str, float, str]] = []
    started = time.monotonic()
    for script in todo:
        extra: list[str] = []
        note = ""
        if args.quick:
            if accepts_quick(script):
                extra.append("--quick")
            else:
                note = "no --quick flag: ran its defaults"
        print(f"\n=== {script.name} {' '.join(extra)}".rstrip() + " ===\n", flush=True)
        log = args.out / f"{script.stem}.txt" if args.out is not None else None
        try:
            status, seconds = run_one(script, extra, timeout, log)
        except OSError as exc:
            status, seconds = f"could not start: {exc}", 0.0
        results.append((script.name, status, seconds, note))
    print(f"\n=== summary ({time.monotonic() - started:.0f} s) ===\n")
    print("| Script | Result | Seconds | Note |")
    print("|---|---|---|---|")
    for name, status, seconds, note in results:
        print(f"| {name} | {status} | {seconds:.0f} | {note} |")
    return 0 if all(status == "ok" for _, status, _, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
