"""What starting a worker costs the daemon: ``start_process`` with and without its cgroup.

For each mode, 10 times: a fresh attempt cgroup (as the agent makes one per
attempt), then ``start_process`` of ``python -c`` that writes ``time.time()``
as its first statement. Reported (p50, ms): until ``start_process`` returns
(the program has been exec'd: the resolver's verdict), and until the
program's first statement. Writes to ``cgroup.procs`` made by the daemon
itself are timed too (the root stage writes its own in the child, untimed):
the first migration into a new cgroup waits for an RCU grace period unless
the cgroup2 file system is mounted with ``favordynmods`` (printed).

Usage (root, cgroup v2)::

    .venv/bin/python bench/bench_spawn.py
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))

from elasticd.supervise.cgroup import Containment  # noqa: E402
from elasticd.supervise.spawn import SpawnPolicy, start_process  # noqa: E402

FIRST = "import os, time; os.write(1, repr(time.time()).encode())"


async def once(procs_fd: int | None, writes: list[float]) -> tuple[float, float]:
    r, w = os.pipe()
    t0 = time.time()
    real_write = os.write

    def timed(fd: int, data: bytes) -> int:
        start = time.perf_counter()
        try:
            return real_write(fd, data)
        finally:
            if fd == procs_fd:
                writes.append((time.perf_counter() - start) * 1000)

    os.write = timed  # type: ignore[assignment]
    try:
        proc = await start_process(
            [sys.executable, "-c", FIRST],
            dict(os.environ),
            identity=None,
            stdout=w,
            cgroup_procs=procs_fd,
            policy=SpawnPolicy(),
        )
    finally:
        os.write = real_write  # type: ignore[assignment]
    returned = time.time()
    os.close(w)
    await proc.wait()
    first = float(os.read(r, 100))
    os.close(r)
    return (returned - t0) * 1000, (first - t0) * 1000


async def measure() -> None:
    with tempfile.TemporaryDirectory(prefix="bench-spawn-") as tmp:
        containment = Containment.setup("cgroup", node="bench-spawn", state_dir=Path(tmp))
        try:
            for mode in ("no cgroup", "cgroup"):
                rows, writes = [], []
                for i in range(10):
                    attempt = (
                        containment.open_attempt("bench", i, None) if mode == "cgroup" else None
                    )
                    rows.append(await once(attempt.procs_fd if attempt else None, writes))
                    if attempt is not None and attempt.cgroup is not None:
                        attempt.cgroup.stop_now()
                print(
                    f"{mode:9}: start_process returns p50 {statistics.median(r[0] for r in rows):.1f} ms, "
                    f"first statement p50 {statistics.median(r[1] for r in rows):.1f} ms"
                    + (
                        f", cgroup.procs write p50 {statistics.median(writes):.1f} ms"
                        if writes
                        else ""
                    )
                )
        finally:
            containment.close()


if __name__ == "__main__":
    mounts = Path("/proc/mounts").read_text().splitlines()
    print("cgroup2 mounts:", [m for m in mounts if " cgroup2 " in m])
    asyncio.run(measure())
