"""The run reaper: what an embedded daemon's jobs leave is killed even after ``kill -9`` of it.

A served daemon that is killed finds what its jobs left at its next start
(the start-up sweep of its cgroup subtree). An embedded daemon
(``elasticd run``, :func:`elasticd.launch`) has no next start: its state is
temporary, and a worker's double-forked ``setsid()`` grandchild, which the
parent-death signal does not reach, would run on for ever (issue 23).

So the embedded daemon starts a tiny child that outlives it: ``python -I -S``
(no site, no environment, no elasticd import: a few MiB for a few ms of
start) running :data:`REAPER_SOURCE`, in a session of its own (a Ctrl-C or a
hang-up of the terminal is the daemon's to handle, not its), with the read
end of a pipe as its stdin. The daemon holds the write end (close-on-exec, so
no worker holds it). The reaper blocks reading; the kernel closes the write
end when the daemon dies, however it dies, and the read returns EOF:

* A daemon that ends normally writes ``done`` first (after its own shutdown
  stopped every attempt and removed its subtree) and waits for the reaper,
  which exits without touching anything: no reaper is left behind, and none
  can kill a later run's processes.
* EOF without ``done``: the daemon died. With cgroups, the reaper kills the
  daemon's whole subtree (``cgroup.kill`` on it, which kills every attempt
  cgroup below; on kernels before 5.14 it freezes the subtree, SIGKILLs every
  member and thaws), waits (bounded) until ``cgroup.events`` says
  ``populated 0`` and removes the cgroups, deepest first. Without cgroups
  (the subreaper fallback: a daemon that is not root), it kills every process
  whose environment names the run (``ELASTICD_URL`` and ``ELASTICD_JOB_ID``),
  rounds until none is left; partial, as the fallback is: a process that
  cleared its environment is not found. Then it removes the run's temporary
  state folder, if it was given one, and exits.

It may also hold the state folder's lock (:mod:`elasticd.node.statelock`),
passed as a descriptor: the folder stays locked until the clean-up is done,
so a new daemon on the same folder never starts while the reaper still works
in it.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Self

__all__ = ["DONE", "REAPER_SOURCE", "RunReaper"]

#: What a daemon that ends normally writes before closing the pipe.
DONE = b"done"

#: Seconds a clean exit waits for the reaper to go.
DONE_TIMEOUT = 5.0

#: The reaper's program. Standard library only (``-I -S``); argv[1] is its JSON settings.
REAPER_SOURCE = r"""
import json, os, signal, sys, time
for s in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM, signal.SIGPIPE, signal.SIGUSR1,
          signal.SIGUSR2):  # USR1/2: a scheduler's warning to the whole step (Slurm --signal)
    signal.signal(s, signal.SIG_IGN)
conf = json.loads(sys.argv[1])
got = b""
while True:
    try:
        chunk = os.read(0, 64)
    except InterruptedError:
        continue
    except OSError:
        break
    if not chunk:
        break
    got += chunk
if got.endswith(b"done"):
    sys.exit(0)

def write(path, text):
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        os.write(fd, text)
    finally:
        os.close(fd)

def tree(base):
    return [top for top, _, _ in os.walk(base, topdown=False)]

def members(base):
    pids = []
    for group in tree(base):
        try:
            with open(os.path.join(group, "cgroup.procs")) as f:
                pids += [int(x) for x in f.read().split()]
        except OSError:
            pass
    return pids

def populated(base):
    try:
        with open(os.path.join(base, "cgroup.events")) as f:
            return "populated 1" in f.read().splitlines()
    except OSError:
        return False

def kill_cgroups(base):
    if not os.path.isdir(base):
        return
    try:
        write(os.path.join(base, "cgroup.kill"), b"1")
    except OSError:
        try:
            write(os.path.join(base, "cgroup.freeze"), b"1")
        except OSError:
            pass
        for _ in range(500):
            pids = members(base)
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.01)
        try:
            write(os.path.join(base, "cgroup.freeze"), b"0")
        except OSError:
            pass
    deadline = time.monotonic() + 10
    while populated(base) and time.monotonic() < deadline:
        time.sleep(0.01)
    for group in tree(base):
        try:
            os.rmdir(group)
        except OSError:
            pass

def environ(pid):
    try:
        with open("/proc/%d/environ" % pid, "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    return dict(i.split(b"=", 1) for i in raw.split(b"\0") if b"=" in i)

def kill_by_env(match):
    want = {k.encode(): v.encode() for k, v in match.items()}
    me = os.getpid()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        found = []
        for name in os.listdir("/proc"):
            if name.isdigit() and int(name) != me:
                env = environ(int(name))
                if env and all(env.get(k) == v for k, v in want.items()):
                    found.append(int(name))
        if not found:
            return
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.02)

if conf.get("cgroup"):
    kill_cgroups(conf["cgroup"])
elif conf.get("match"):
    kill_by_env(conf["match"])
if conf.get("remove"):
    import shutil
    shutil.rmtree(conf["remove"], ignore_errors=True)
"""


class RunReaper:
    """The reaper child of one embedded daemon: ``start()`` once its containment is known,
    ``done()`` after its clean shutdown (or use it as a context manager)."""

    def __init__(
        self,
        *,
        cgroup: Path | None,
        match: Mapping[str, str],
        remove: Path | None = None,
        keep_fd: int | None = None,
    ) -> None:
        """``cgroup``: the daemon's subtree (None: the subreaper fallback, by ``match``:
        environment variables every process of the run has); ``remove``: a temporary folder
        to delete after the kill; ``keep_fd``: a descriptor the reaper holds (the lock)."""
        self.settings = {
            "cgroup": str(cgroup) if cgroup is not None else None,
            "match": dict(match),
            "remove": str(remove) if remove is not None else None,
        }
        self._keep_fd = keep_fd
        self.proc: subprocess.Popen[bytes] | None = None
        self._pipe: int | None = None

    def start(self) -> Self:
        read, write = os.pipe()  # both close-on-exec: no worker holds the write end
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", REAPER_SOURCE, json.dumps(self.settings)],
                stdin=read,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                pass_fds=() if self._keep_fd is None else (self._keep_fd,),
                start_new_session=True,
                env={},
            )
        except BaseException:
            os.close(write)
            raise
        finally:
            os.close(read)
        self._pipe = write
        return self

    def done(self) -> None:
        """The daemon ended normally: the reaper exits without killing anything; awaited."""
        if self._pipe is not None:
            pipe, self._pipe = self._pipe, None
            with contextlib.suppress(OSError):
                os.write(pipe, DONE)
            os.close(pipe)
        if self.proc is not None:
            try:
                self.proc.wait(DONE_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.done()
