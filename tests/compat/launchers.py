"""Run one command line under torchrun and under `elasticd run`, side by side, and collect what
each produced: exit code, console output, files.

Both launchers get the same arguments (`--standalone` is a no-op for `elasticd run`), run at the
same time (they are mostly waiting), each with its own output folder and port in place of the
``{out}`` and ``{port}`` placeholders.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

TORCH_BIN = Path(__file__).resolve().parent / "torch_bin"
LAUNCHER_BIN = TORCH_BIN / "launcher"  # pytorch's test/distributed/launcher/bin
MP_BIN = TORCH_BIN / "multiprocessing"  # pytorch's test/distributed/elastic/multiprocessing/bin
NAMES = ("torchrun", "elasticd")


def launcher_command(name: str) -> list[str]:
    """The launcher's own command: the `torchrun` script beside this Python, or `elasticd run`."""
    if name == "torchrun":
        exe = Path(sys.executable).with_name("torchrun")
        return [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]
    return [sys.executable, "-m", "elasticd", "run"]


def free_port() -> int:
    """A free port *below* the kernel's ephemeral range, for a ``--master-port``.

    Both launchers run at once and bind ports of their own with port 0 (torchrun's store,
    elasticd run's API): a port taken from the ephemeral range and freed again could be
    handed to the other launcher before the workers bind it (seen in CI: EADDRINUSE). No
    bind to port 0 ever returns a port below the range.
    """
    low = 32768
    with contextlib.suppress(OSError, ValueError):
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    candidates = list(range(max(1024, low - 8000), low))
    random.shuffle(candidates)
    for port in candidates:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def base_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The caller's environment without launcher settings, as a user's shell would have it."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("ELASTICD_", "PET_", "TORCHELASTIC_"))
        and k not in {"PYTHONUNBUFFERED", "RANK", "LOCAL_RANK", "WORLD_SIZE"}
    }
    env["ELASTICD_ALLOW_ROOT"] = "true"  # CI runs as root; torchrun has no such guard
    env["TEST_SENTINEL_PARENT"] = "FOOBAR"  # torch's run_test.py sets it; test_script.py reads it
    env.update(extra or {})
    return env


@dataclass
class Outcome:
    """What one launcher's run left behind."""

    returncode: int
    stdout: str
    stderr: str
    out: Path
    files: set[str] = field(default_factory=set)

    def teed(self) -> dict[int, list[str]]:
        """Worker lines of ``--tee``'s console, ``[default<rank>]:line``, by local rank."""
        lines: dict[int, list[str]] = {}
        for m in re.finditer(r"^\[default(\d+)\]:(.*)$", self.stdout, re.MULTILINE):
            lines.setdefault(int(m.group(1)), []).append(m.group(2))
        return lines

    def text(self) -> str:
        """The output with this run's folder written as ``OUT``, comparable across launchers."""
        return (self.stdout + self.stderr).replace(str(self.out), "OUT")


def _fill(args: Sequence[str], out: Path, port: int) -> list[str]:
    return [a.replace("{out}", str(out)).replace("{port}", str(port)) for a in args]


@contextmanager
def started(
    tmp_path: Path,
    args: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    stdin: str | None = None,
) -> Iterator[dict[str, tuple[subprocess.Popen[bytes], Path]]]:
    """Start both launchers on ``args``; kill what is left when the block ends."""
    procs: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}
    try:
        for name in NAMES:
            home = tmp_path / name
            out = home / "out"
            out.mkdir(parents=True)
            with (home / "stdout").open("wb") as stdout, (home / "stderr").open("wb") as stderr:
                proc = subprocess.Popen(
                    [*launcher_command(name), *_fill(args, out, free_port())],
                    env=base_env(env),
                    cwd=cwd or home,
                    stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                    stdout=stdout,
                    stderr=stderr,
                    start_new_session=True,
                )
            if stdin is not None:
                assert proc.stdin is not None
                proc.stdin.write(stdin.encode())
                proc.stdin.close()
            procs[name] = (proc, out)
        yield procs
    finally:
        for proc, out in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)  # a launcher stops its workers on SIGTERM
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            # torchrun's workers run in sessions of their own: none may outlive the test
            for pid in processes_with_arg(str(out)):
                os.kill(pid, signal.SIGKILL)


def collect(
    procs: Mapping[str, tuple[subprocess.Popen[bytes], Path]], timeout: float
) -> dict[str, Outcome]:
    """Wait for both launchers and read what they left."""
    deadline = time.monotonic() + timeout
    outcomes = {}
    for name, (proc, out) in procs.items():
        code = proc.wait(max(0.1, deadline - time.monotonic()))
        home = out.parent
        outcomes[name] = Outcome(
            returncode=code,
            stdout=(home / "stdout").read_text(errors="replace"),
            stderr=(home / "stderr").read_text(errors="replace"),
            out=out,
            files=set(os.listdir(out)),
        )
    return outcomes


# torch 2.13's gloo sometimes aborts a worker at interpreter exit, after its work is done
# (this line, then SIGABRT), under torchrun and `elasticd run` alike and more often on a loaded
# machine; torch's own init_method script does not call destroy_process_group. Both launchers
# run again, side by side, while either has not had a run without it, up to TRIES runs; each
# launcher's outcome is its first run without the abort (CI saw the abort in every one of four
# runs, always in one launcher only, a different one each time). A launcher that aborts in
# every run fails the test.
EXIT_ABORT = "terminate called without an active exception"
#: Runs of both launchers at most, while either's run hit the exit abort.
TRIES = 6


def aborted_at_exit(outcome: Outcome) -> bool:
    return EXIT_ABORT in outcome.stderr


def run_both(
    tmp_path: Path,
    args: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    stdin: str | None = None,
    timeout: float = 90,
) -> dict[str, Outcome]:
    """Run ``args`` under both launchers and return their outcomes by launcher name."""
    kept: dict[str, Outcome] = {}
    for attempt in range(TRIES):
        home = tmp_path / f"try{attempt}"
        with started(home, args, env=env, cwd=cwd, stdin=stdin) as procs:
            outcomes = collect(procs, timeout)
        for name, outcome in outcomes.items():
            if name not in kept and not aborted_at_exit(outcome):
                kept[name] = outcome
        if len(kept) == len(outcomes):
            return kept
    return {name: kept.get(name, outcome) for name, outcome in outcomes.items()}


def copy_script(src: Path, dest_dir: Path) -> Path:
    """A copy of an unchanged script under a path unique to this test, to find its processes."""
    dest = dest_dir / src.name
    shutil.copy2(src, dest)
    return dest


def processes_with_arg(text: str) -> list[int]:
    """Pids of processes with an argument containing ``text`` (a test's own folder)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(text.encode() in arg for arg in argv):
            pids.append(int(entry.name))
    return pids


def workers_running(script: Path) -> list[int]:
    """Pids of Python processes running ``script`` as their program (`python -u script`)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[1:3] == [b"-u", str(script).encode()]:
            pids.append(int(entry.name))
    return pids
