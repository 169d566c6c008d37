"""A tiny, torch-free worker that records when it started and when it ended.

The same script runs under ``torchrun --standalone`` and under elasticd: it
only reads the environment both set (``LOCAL_RANK``, ``RANK``,
``TORCHELASTIC_RESTART_COUNT``). Every time it writes is ``time.time()``, the
clock elasticd stamps its events with.

Records, one small JSON file each, in ``--out``:

* ``start-a{attempt}-r{rank}-p{pid}.json``: ``first_stmt`` (the time read by
  this file's first statement), ``fork_est`` (when the process was forked,
  derived from ``first_stmt`` and the scheduler's accounting, see
  :func:`fork_time`), ``proc_start`` (the process's creation time
  from ``/proc/self/stat``, converted to wall-clock time; 1/CLK_TCK
  resolution, truncated), ``pid``, ``rank``, ``attempt``;
* ``exit-a{attempt}-r{rank}-p{pid}-{why}.txt``: the time read immediately
  before ``os._exit``, and nothing else (the file is opened in advance so the
  write is one syscall). ``why`` is ``crash``, ``sigterm`` or ``done``;
  ``sigterm`` files hold two times: when the handler ran, then the exit.

Behaviour per attempt (``TORCHELASTIC_RESTART_COUNT``):

* attempt < ``--crash-attempts``: rank ``--crash-rank`` waits
  ``--crash-after`` seconds (so the supervisor has finished starting the
  group), then exits with ``--exit-code``; every other rank waits for SIGTERM;
* later attempts: every rank waits ``--done-after`` seconds and exits 0.

``--sleep`` makes every rank wait for SIGTERM (the API benchmark's sleeper).
No rank ever waits longer than ``--max-wait`` seconds: it then exits 3, so a
broken supervisor cannot leave it behind. ``--calibrate`` writes the start
record and exits 0 at once (to measure interpreter start-up).
"""

import time

FIRST_STMT = time.time()
CPU_AT_FIRST = time.clock_gettime(time.CLOCK_THREAD_CPUTIME_ID)
try:
    with open("/proc/self/schedstat", "rb") as _fh:
        SCHEDSTAT_AT_FIRST = _fh.read()
except OSError:
    SCHEDSTAT_AT_FIRST = b""

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402


def proc_start_time() -> float:
    """This process's creation time, as wall-clock seconds (1/CLK_TCK resolution)."""
    with open("/proc/self/stat", "rb") as fh:
        stat = fh.read()
    # Field 22 (starttime), counted after the ")" that ends the command name.
    fields = stat[stat.rindex(b")") + 2 :].split()
    ticks = int(fields[19])
    boot_to_wall = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
    return boot_to_wall + ticks / os.sysconf("SC_CLK_TCK")


def fork_time() -> float | None:
    """When this process was forked, to a fraction of a millisecond; None if unknown.

    Since the fork, the process has been either running (its CPU time, read
    with the current slice included) or waiting on a run queue (``run_delay``,
    the second field of ``/proc/self/schedstat``, complete while it runs);
    start-up blocks on nothing when the interpreter's files are in the page
    cache. So ``FIRST_STMT - cpu - run_delay`` is the fork time; any blocking
    would make it late, never early.
    """
    try:
        run_delay_ns = int(SCHEDSTAT_AT_FIRST.split()[1])
    except (IndexError, ValueError):
        return None
    return FIRST_STMT - CPU_AT_FIRST - run_delay_ns / 1e9


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="benchmark worker")
    p.add_argument("--out", required=True, help="folder for the records")
    p.add_argument("--crash-rank", type=int, default=1)
    p.add_argument("--crash-attempts", type=int, default=0)
    p.add_argument("--crash-after", type=float, default=0.3)
    p.add_argument("--exit-code", type=int, default=1)
    p.add_argument("--done-after", type=float, default=0.05)
    p.add_argument("--sleep", action="store_true")
    p.add_argument("--max-wait", type=float, default=120.0)
    p.add_argument("--calibrate", action="store_true")
    return p.parse_args(argv)


def main() -> None:
    args = parse(sys.argv[1:])
    rank = int(os.environ.get("RANK", "0"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    pid = os.getpid()
    tag = f"a{attempt}-r{rank}-p{pid}"
    start = {
        "pid": pid,
        "rank": rank,
        "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
        "attempt": attempt,
        "first_stmt": FIRST_STMT,
        "fork_est": fork_time(),
        "proc_start": proc_start_time(),
    }
    with open(os.path.join(args.out, f"start-{tag}.json"), "w") as fh:
        json.dump(start, fh)
    if args.calibrate:
        os._exit(0)

    def opened(why: str) -> int:
        path = os.path.join(args.out, f"exit-{tag}-{why}.txt")
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    term_fd = opened("sigterm")

    def on_term(signum: int, frame: object) -> None:
        got = time.time()
        os.write(term_fd, f"{got!r} {time.time()!r}".encode())
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)

    crashing = attempt < args.crash_attempts and rank == args.crash_rank and not args.sleep
    finishing = attempt >= args.crash_attempts and not args.sleep
    if crashing or finishing:
        why = "crash" if crashing else "done"
        fd = opened(why)
        time.sleep(args.crash_after if crashing else args.done_after)
        code = args.exit_code if crashing else 0
        os.write(fd, repr(time.time()).encode())
        os._exit(code)
    # Wait for SIGTERM, bounded.
    deadline = time.monotonic() + args.max_wait
    while time.monotonic() < deadline:
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    os._exit(3)


if __name__ == "__main__":
    main()
