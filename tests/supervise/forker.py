"""Members that fork without end, safely bounded: for the tests of a standby's hand-off
move (tests/supervise/test_cgroup.py, tests/e2e/test_prewarm.py)."""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

#: ``python -I -c FORKER <pids cgroup.procs or ""> <stop file> <perl> <chains> [<sleepers>]``:
#: a subreaper (it reaps what its chains leave) running that many chains, each a perl
#: process that forks its successor and exits at once, so a new pid is born every few
#: microseconds and a move pid by pid keeps finding some left behind; and that many
#: sleeping processes (a move's rounds last longer). Bounded by the stop file, a minute,
#: and the pids.max of the v1 pids cgroup it joins first (:func:`v1_pids_cgroup`).
FORKER = r"""
import ctypes, os, sys
pids_procs, stop, perl, chains = sys.argv[1:5]
sleepers = int(sys.argv[5]) if len(sys.argv) > 5 else 0
if pids_procs:
    with open(pids_procs, "w") as f:
        f.write("0")
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
chain = ("my $end = time + 60; while (-e $ARGV[0] && time < $end) "
         "{ my $p = fork; exit 0 if $p; select(undef, undef, undef, 0.01) unless defined $p }")
sleep = "my $end = time + 60; select(undef, undef, undef, 1) while -e $ARGV[0] && time < $end"
for _ in range(sleepers):
    os.posix_spawn(perl, [perl, "-e", sleep, stop], os.environ)
started = 0
while True:
    if started < int(chains):
        try:
            os.posix_spawn(perl, [perl, "-e", chain, stop], os.environ)
            started += 1
        except BlockingIOError:  # pids.max, until the zombies below are reaped
            pass
    try:
        os.waitpid(-1, os.WNOHANG if started < int(chains) else 0)
    except ChildProcessError:
        break
"""


def v1_pids_mount() -> Path | None:
    """Where cgroup v1's pids hierarchy is mounted (a hybrid host), if it is."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        tail = right.split()
        if len(tail) >= 3 and tail[0] == "cgroup" and "pids" in tail[2].split(","):
            return Path(left.split()[4])
    return None


@contextlib.contextmanager
def v1_pids_cgroup(limit: int) -> Iterator[Path | None]:
    """A cgroup of v1's pids hierarchy with ``pids.max`` = ``limit`` (its ``cgroup.procs``
    yielded, for a forker to join), or None where there is none; removed at the end, once
    every process of it is gone and reaped (bounded: the test fails if one is left)."""
    mount = v1_pids_mount()
    if mount is None:
        yield None
        return
    v1 = mount / f"elasticd-test.{secrets.token_hex(4)}"
    v1.mkdir()
    try:
        (v1 / "pids.max").write_text(str(limit))
        yield v1 / "cgroup.procs"
    finally:
        deadline = time.monotonic() + 30
        while True:  # busy while a process of the forker is left (a zombie not yet reaped)
            try:
                v1.rmdir()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
