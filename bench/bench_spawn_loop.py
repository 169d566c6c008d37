"""What a worker start costs the daemon's event loop (issue 27, point 6), as the job's user.

``start_process`` runs on the event loop's thread, and everything
``subprocess.Popen`` does before it returns holds the loop: the fork, and,
when CPython ``fork()``s rather than ``vfork()``s, the wait until the child
has exec'd. This process first grows a heap of ``--heap-mib`` (200: a busy
daemon's size; a ``fork()`` copies its page tables), then starts
``/bin/true`` ``--starts`` times (60) through ``start_process`` as
``--user`` (nobody; needs root, else the daemon's own user) with no cgroup,
and reports (p50 / p90 / max, ms):

* **on the loop**: ``Popen._execute_child``, timed around the real one;
* **until it runs**: ``start_process`` until it returns (the program has been
  exec'd: the resolver's verdict).

Usage::

    .venv/bin/python bench/bench_spawn_loop.py [--user nobody] [--heap-mib 200] [--starts 60]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from elasticd.security import Identity, lookup_user  # noqa: E402
from elasticd.supervise.spawn import DEFAULT_POLICY, start_process  # noqa: E402


def timed(real: Callable[..., Any], into: list[float]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            into.append((time.perf_counter() - started) * 1000)

    return wrapper


def spread(values: list[float]) -> str:
    ordered = sorted(values)
    return (
        f"{ordered[len(ordered) // 2]:.2f} / {ordered[int(len(ordered) * 0.9)]:.2f} / "
        f"{ordered[-1]:.2f}"
    )


async def measure(identity: Identity | None, starts: int) -> tuple[list[float], list[float]]:
    DEFAULT_POLICY.warm()  # probe setpriv and perl now, not inside the first timed start
    on_loop: list[float] = []
    until_runs: list[float] = []
    real = subprocess.Popen._execute_child  # type: ignore[attr-defined]
    subprocess.Popen._execute_child = timed(real, on_loop)  # type: ignore[attr-defined]
    try:
        for _ in range(starts):
            started = time.perf_counter()
            proc = await start_process(["/bin/true"], dict(os.environ), identity=identity)
            until_runs.append((time.perf_counter() - started) * 1000)
            await proc.wait()
    finally:
        subprocess.Popen._execute_child = real  # type: ignore[attr-defined]
    return on_loop, until_runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--user", default="nobody")
    parser.add_argument("--heap-mib", type=int, default=200)
    parser.add_argument("--starts", type=int, default=60)
    args = parser.parse_args()
    heap = bytearray(args.heap_mib << 20)
    for page in range(0, len(heap), 4096):
        heap[page] = 1  # touched: its pages are mapped, as a daemon's are
    identity = lookup_user(args.user) if os.geteuid() == 0 else None
    on_loop, until_runs = asyncio.run(measure(identity, args.starts))
    who = identity.user if identity is not None else "the daemon's own user"
    print(f"{args.starts} starts of /bin/true as {who}, heap {args.heap_mib} MiB, no cgroup")
    print(f"| on the loop (ms, p50 / p90 / max) | {spread(on_loop)} |")
    print(f"| until it runs (ms, p50 / p90 / max) | {spread(until_runs)} |")


if __name__ == "__main__":
    main()
