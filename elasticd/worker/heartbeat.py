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

* The daemon creates each file **before** the worker starts
  (:meth:`HeartbeatFile.create`), and reads it only through the descriptor
  it created it with, never by name again. The file lies in the worker's own
  log folder, which the worker owns and may fill with anything: a FIFO, a
  symbolic link to a root-only file, a directory. None of that reaches the
  daemon, which keeps reading (``pread``, 64 bytes) the inode it made: a
  worker that maps what it put there instead reports no progress (one that
  mapped the file before replacing the path still pings the daemon's
  inode), and :meth:`HeartbeatFile.replaced` says what now lies at the path
  so that the daemon can say so once. The daemon does not ``mmap`` the file: the worker
  owns it and could truncate it, and a read of a mapping past the end of the
  file is ``SIGBUS``; a short ``pread`` is only "not a heartbeat".
* Creating never follows a link planted at the path: the folder is opened
  with ``O_NOFOLLOW | O_DIRECTORY`` (the folders above it are the daemon's,
  see :func:`elasticd.security.prepare_worker_dir`), the file is made under
  a fresh random name with ``O_CREAT | O_EXCL | O_NOFOLLOW`` relative to that
  folder's descriptor, handed to the job's user by descriptor (``fchown``;
  the worker must open it for writing) and renamed over the path. It never
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
  agree (:meth:`HeartbeatFile.read`).

This module imports only the standard library: the daemon uses its reading
half, workers its writing half.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import secrets
import stat
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "ENV_VAR",
    "FILE_SIZE",
    "HeartbeatFile",
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


class HeartbeatFile:
    """The daemon's handle on one worker's heartbeat: the descriptor of the file it created.

    Reads go through that descriptor only (see the module docstring), so
    nothing the worker later puts at :attr:`path` can block, redirect or
    crash them. :meth:`close` releases it; an unreferenced handle closes
    itself.
    """

    __slots__ = ("_fd", "_identity", "path")

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd
        st = os.fstat(fd)
        self._identity = (st.st_dev, st.st_ino)

    @classmethod
    def create(cls, path: Path, *, owner: tuple[int, int] | None = None) -> HeartbeatFile:
        """Create (or replace) the file at ``path``, "never pinged", and keep its descriptor.

        ``owner`` is ``(uid, gid)`` for workers that run as another user than
        the daemon: the file becomes theirs (mode 0600), so that they can map
        it for writing. Raises ``OSError`` when the folder is a symbolic link
        or the path cannot be replaced (a directory lies there).
        """
        path.parent.mkdir(parents=True, exist_ok=True)
        folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            fd, tmp = _create_exclusive(folder)
            try:
                _write_all(fd, _HEADER.pack(MAGIC, VERSION) + bytes(FILE_SIZE - _HEADER.size))
                if owner is not None:
                    os.fchown(fd, owner[0], owner[1])
                os.fchmod(fd, 0o600)
                # Never truncate in place (see the module docstring); a rename over a
                # link or a FIFO replaces that entry and touches nothing it points to.
                os.rename(tmp, path.name, src_dir_fd=folder, dst_dir_fd=folder)
            except BaseException:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=folder)
                raise
        finally:
            os.close(folder)
        return cls(path, fd)

    def read(self) -> HeartbeatValue | None:
        """The heartbeat as the worker last wrote it; None when the content is not one."""
        return None if self._fd is None else _read_fd(self._fd)

    def replaced(self) -> str | None:
        """What lies at :attr:`path` if it is no longer the file the daemon created, else None.

        A ``lstat``: it never opens the path, so it cannot block or follow a link.
        """
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return "nothing (it was removed)"
        except OSError as exc:
            return f"something the daemon cannot look at ({exc.strerror or exc})"
        if (st.st_dev, st.st_ino) == self._identity:
            return None
        return _kind(st.st_mode)

    def fileno(self) -> int:
        """The daemon's descriptor of the file (handed across its re-exec)."""
        if self._fd is None:
            raise ValueError("the heartbeat file is closed")
        return self._fd

    def close(self) -> None:
        """Release the descriptor (idempotent); reads return None afterwards."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def _create_exclusive(folder: int) -> tuple[int, str]:
    """A new file under a fresh random name in ``folder``; never opens one that is there."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(16):
        name = f".heartbeat-{secrets.token_hex(8)}"
        try:
            return os.open(name, flags, 0o600, dir_fd=folder), name
        except FileExistsError:
            continue
    raise OSError(errno.EEXIST, "cannot find a free temporary name for the heartbeat file")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISREG(mode):
        return "another file"
    return "a special file"


def create_heartbeat_file(path: Path, *, owner: tuple[int, int] | None = None) -> None:
    """Create (or replace) the heartbeat file at ``path`` without keeping it open (tools, tests)."""
    HeartbeatFile.create(path, owner=owner).close()


def read_heartbeat(path: Path) -> HeartbeatValue | None:
    """The heartbeat at ``path``, by name (tools, tests; the daemon uses :class:`HeartbeatFile`).

    None when the path is missing or is not a regular heartbeat file. The
    path is opened with ``O_NOFOLLOW | O_NONBLOCK`` and checked with
    ``fstat``, so a link or a FIFO put there is refused, never followed or
    waited on.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return _read_fd(fd)
    finally:
        os.close(fd)


def _read_fd(fd: int) -> HeartbeatValue | None:
    """Read twice and keep a value only when both reads agree (a ping may be half written)."""
    try:
        first = os.pread(fd, FILE_SIZE, 0)
        for _ in range(8):
            second = os.pread(fd, FILE_SIZE, 0)
            if second == first:
                break
            first = second
    except OSError:
        return None
    return _parse(first)


def _parse(data: bytes) -> HeartbeatValue | None:
    if len(data) < _PID_OFFSET + _PID.size:
        return None
    magic, version = _HEADER.unpack_from(data, 0)
    if magic != MAGIC or version != VERSION:
        return None
    count, last_ns = _BEAT.unpack_from(data, _BEAT_OFFSET)
    (pid,) = _PID.unpack_from(data, _PID_OFFSET)
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
