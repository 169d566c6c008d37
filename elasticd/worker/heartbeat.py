"""The progress heartbeat: a 64-byte file the daemon creates and the worker writes through mmap.

Why a shared file and not a pipe or a socket: a ping must cost microseconds,
never block and never fail when the daemon is gone. Writing 16 bytes into a
page that is already mapped is a memory store: no system call, no buffer that
can fill up, no peer that can disappear. ``time.monotonic_ns()`` is served by
the vDSO on Linux, so it is not a system call either.

The file (little endian)::

    offset  size  field
    0       4     magic b"EDHB"
    4       4     format version (1)
    8       8     count: pings so far (0 = never pinged)
    16      8     CLOCK_MONOTONIC of the last ping, in nanoseconds
    24      4     pid of the process that mapped the file
    28      36    reserved, zero

``CLOCK_MONOTONIC`` is one clock for every process of a machine, so the
daemon compares the value with its own ``time.monotonic()`` directly; the
wall time it shows (``last_progress_at``) is derived from its own clocks, not
from the worker's.

Rules both sides keep:

* The daemon creates each file **before** the worker starts, by writing a new
  file and renaming it over the path (:func:`create_heartbeat_file`). It never
  truncates a file in place: a worker that still maps the old inode would get
  ``SIGBUS`` on its next ping. Renaming leaves the old mapping valid.
* The worker maps the file lazily on the first :func:`ping`. Without
  ``ELASTICD_HEARTBEAT_FILE``, with a file that is missing, too short or not
  ours, ping becomes a no-op for the life of the process. It never raises.
* A forked child (a DataLoader worker) does not inherit the right to ping:
  after ``fork`` the child's ping is a no-op, so only the worker itself
  reports progress.
* The two 8-byte fields are written with one ``pack_into``; a reader that
  could see a torn write reads twice and keeps a value only when both reads
  agree (:func:`read_heartbeat`).

This module imports only the standard library: the daemon uses its reading
half, workers its writing half.
"""

from __future__ import annotations

import mmap
import os
import struct
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "ENV_VAR",
    "FILE_SIZE",
    "HeartbeatValue",
    "create_heartbeat_file",
    "ping",
    "read_heartbeat",
]

#: The environment variable that names a worker's heartbeat file.
ENV_VAR = "ELASTICD_HEARTBEAT_FILE"

MAGIC = b"EDHB"
VERSION = 1
FILE_SIZE = 64

_HEADER = struct.Struct("<4sI")  # magic, version
_BEAT = struct.Struct("<QQ")  # count, monotonic ns
_PID = struct.Struct("<I")
_BEAT_OFFSET = 8
_PID_OFFSET = 24


@dataclass(frozen=True)
class HeartbeatValue:
    """What a heartbeat file says: how many pings, and the monotonic time of the last one."""

    count: int
    last_ns: int
    """``CLOCK_MONOTONIC`` nanoseconds of the last ping; 0 when never pinged."""
    pid: int

    @property
    def last(self) -> float | None:
        """The last ping in ``time.monotonic()`` seconds, or None when never pinged."""
        return self.last_ns / 1e9 if self.count > 0 else None


# -- daemon side -----------------------------------------------------------------


def create_heartbeat_file(path: Path, *, owner: tuple[int, int] | None = None) -> None:
    """Create (or replace) the heartbeat file at ``path``, "never pinged", atomically.

    ``owner`` is ``(uid, gid)`` for workers that run as another user than the
    daemon: the worker must be able to open the file for writing. The file
    is mode 0600 otherwise.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    content = _HEADER.pack(MAGIC, VERSION) + bytes(FILE_SIZE - _HEADER.size)
    fd, tmp = tempfile.mkstemp(prefix=".heartbeat-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(content)
            if owner is not None:
                os.fchown(f.fileno(), owner[0], owner[1])
        os.replace(tmp, path)  # never truncate in place: see the module docstring
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def read_heartbeat(path: Path) -> HeartbeatValue | None:
    """The heartbeat at ``path``; None when the file is missing or not a heartbeat file."""
    try:
        with open(path, "rb", buffering=0) as f:
            first = f.read(FILE_SIZE)
            for _ in range(8):
                f.seek(0)
                second = f.read(FILE_SIZE)
                if second == first:
                    break
                first = second
    except OSError:
        return None
    if len(first) < _PID_OFFSET + _PID.size:
        return None
    magic, version = _HEADER.unpack_from(first, 0)
    if magic != MAGIC or version != VERSION:
        return None
    count, last_ns = _BEAT.unpack_from(first, _BEAT_OFFSET)
    (pid,) = _PID.unpack_from(first, _PID_OFFSET)
    return HeartbeatValue(count=count, last_ns=last_ns, pid=pid)


# -- worker side -----------------------------------------------------------------


class _Heartbeat:
    """The worker's mapping of its heartbeat file; ``ping`` is the hot path."""

    __slots__ = ("count", "map", "tried")

    def __init__(self) -> None:
        self.map: mmap.mmap | None = None
        self.tried = False
        self.count = 0

    def open(self) -> None:
        """Map the file named by the environment, once; on any problem stay disabled."""
        self.tried = True
        path = os.environ.get(ENV_VAR)
        if not path:
            return
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            return
        try:
            if os.fstat(fd).st_size < FILE_SIZE:
                return
            mapped = mmap.mmap(fd, FILE_SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError):
            return
        finally:
            os.close(fd)
        if _HEADER.unpack_from(mapped, 0) != (MAGIC, VERSION):
            mapped.close()
            return
        _PID.pack_into(mapped, _PID_OFFSET, os.getpid())
        self.map = mapped

    def forget(self) -> None:
        """In a forked child: drop the parent's mapping and never ping."""
        self.map = None
        self.tried = True


_HB = _Heartbeat()
_OPEN_LOCK = threading.Lock()
os.register_at_fork(after_in_child=_HB.forget)


def ping() -> None:
    """Tell the daemon this worker is making progress.

    Costs well under a microsecond once the file is mapped (the first call
    maps it), never blocks on the daemon and never raises. Outside elasticd
    (no ``ELASTICD_HEARTBEAT_FILE``) it does nothing.
    """
    hb = _HB
    mapped = hb.map
    if mapped is None:
        if hb.tried:
            return
        with _OPEN_LOCK:
            if not hb.tried:
                hb.open()
        mapped = hb.map
        if mapped is None:
            return
    hb.count += 1
    try:
        _BEAT.pack_into(mapped, _BEAT_OFFSET, hb.count, time.monotonic_ns())
    except (ValueError, TypeError):  # closed by a concurrent forget(); never raise
        pass


def _reset_for_tests() -> None:
    """Forget the mapping so that the next ping maps the file named by the environment again."""
    with _OPEN_LOCK:
        if _HB.map is not None:
            _HB.map.close()
        _HB.map = None
        _HB.tried = False
        _HB.count = 0
