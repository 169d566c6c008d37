"""The progress heartbeat: a small file the daemon creates and the worker writes through mmap.

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
    28      4     layout size: 0 in the first 64-byte layout, 1024 in this one
    -- the progress fields (present when the layout size is 1024 or more) --
    32      8     step: the last step reported by ping(step=N), signed; -1 = none
    40      8     checkpoint step: the last durable checkpoint, signed; -1 = none
    48      8     CLOCK_MONOTONIC when the checkpoint in progress began; 0 = none
    56      4     checkpoint sequence: odd while the worker writes 40..63 and the path
    60      2     checkpoint path length in bytes (at most 960)
    62      2     reserved, zero
    64      960   checkpoint path (``os.fsencode``; no NUL; read as UTF-8, bad bytes replaced)

**Compatibility.** The magic and the version stay those of the first
layout, and the first 32 bytes mean what they meant, so both halves of two
versions of elasticd work together. A worker library that knows only 64
bytes maps the first 64 bytes of a new file and pings (no step). A new
worker library that finds a 64-byte file (an older daemon) pings without
step or checkpoint. A new daemon reading an old file (a worker adopted after
an upgrade) sees ``layout size`` 0 and reports no step and no checkpoint.

**Cost.** ``ping(step=N)`` writes count, time, pid, layout size and step with
one ``pack_into`` (the pid and layout size it writes are the values already
there), so a step costs what a ping costs: about 0.2 µs, no system call.
``checkpointing()`` and ``checkpointed()`` are rare and may write more.

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
  daemon, which keeps reading (``pread``, one file's size) the inode it made: a
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
* The ping fields are written with one ``pack_into``; a reader that
  could see a torn write reads twice and keeps a value only when both reads
  agree (:meth:`HeartbeatFile.read`). The checkpoint fields and the path are
  several writes, framed by the checkpoint sequence (odd while in flux): a
  read that sees it odd reports no checkpoint fields, and the daemon keeps
  what it last read. The path is bounded (960 bytes) and only ever read from
  the daemon's own descriptor, like the rest of the file.

This module imports only the standard library: the daemon uses its reading
half, workers its writing half.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import operator
import os
import secrets
import stat
import struct
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

__all__ = [
    "ENV_VAR",
    "FILE_SIZE",
    "MAX_CHECKPOINT_PATH",
    "HeartbeatFile",
    "HeartbeatValue",
    "checkpointed",
    "checkpointing",
    "create_heartbeat_file",
    "ping",
    "read_heartbeat",
]

#: The environment variable that names a worker's heartbeat file.
ENV_VAR = "ELASTICD_HEARTBEAT_FILE"

MAGIC = b"EDHB"
VERSION = 1
FILE_SIZE = 1024
"""The size of the file the daemon creates (the layout with progress fields)."""
V1_SIZE = 64
"""The size of the first layout (count and time only), still read and written."""
MAX_CHECKPOINT_PATH = FILE_SIZE - 64
"""The longest checkpoint path (bytes, ``os.fsencode``) :func:`checkpointed` accepts."""

_HEADER = struct.Struct("<4sI")  # magic, version
_BEAT = struct.Struct("<QQ")  # count, monotonic ns
_BEAT_STEP = struct.Struct("<QQIIq")  # count, monotonic ns, pid, layout size, step
_PID = struct.Struct("<I")
_LAYOUT = struct.Struct("<I")
_STEP = struct.Struct("<q")
_CHECKPOINT = struct.Struct("<qQIH")  # checkpoint step, checkpointing since ns, sequence, length
_SINCE = struct.Struct("<Q")
_SEQ = struct.Struct("<I")
_BEAT_OFFSET = 8
_PID_OFFSET = 24
_LAYOUT_OFFSET = 28
_STEP_OFFSET = 32
_CHECKPOINT_OFFSET = 40
_SINCE_OFFSET = 48
_SEQ_OFFSET = 56
_PATH_OFFSET = 64


@dataclass(frozen=True)
class HeartbeatValue:
    """What a heartbeat file says: pings, the step, and the last durable checkpoint.

    ``step``, ``checkpoint_step``, ``checkpoint_path`` and
    ``checkpointing_since`` are None when the worker has not reported them,
    when the file has the first (64-byte) layout, and (the checkpoint fields)
    when the worker was writing them at the moment of the read.
    """

    count: int
    last_ns: int
    """``CLOCK_MONOTONIC`` nanoseconds of the last ping; 0 when never pinged."""
    pid: int
    step: int | None = None
    """The last step given to ``ping(step=N)``."""
    checkpoint_step: int | None = None
    """The step of the last checkpoint reported by :func:`checkpointed`."""
    checkpoint_path: str | None = None
    """Where that checkpoint lies, when the worker said so."""
    checkpointing_since: float | None = None
    """``time.monotonic()`` seconds when the checkpoint in progress began (``checkpointing()``)."""

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
                _write_all(fd, _new_file())
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


def _new_file() -> bytes:
    """The content of a fresh file: never pinged, no step, no checkpoint."""
    data = bytearray(FILE_SIZE)
    _HEADER.pack_into(data, 0, MAGIC, VERSION)
    _LAYOUT.pack_into(data, _LAYOUT_OFFSET, FILE_SIZE)
    _STEP.pack_into(data, _STEP_OFFSET, -1)
    _STEP.pack_into(data, _CHECKPOINT_OFFSET, -1)
    return bytes(data)


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
    beat = HeartbeatValue(count=count, last_ns=last_ns, pid=pid)
    if len(data) < FILE_SIZE or _LAYOUT.unpack_from(data, _LAYOUT_OFFSET)[0] < FILE_SIZE:
        return beat  # the first layout: count and time only
    (step,) = _STEP.unpack_from(data, _STEP_OFFSET)
    beat = replace(beat, step=step if step >= 0 else None)
    checkpoint_step, since_ns, seq, length = _CHECKPOINT.unpack_from(data, _CHECKPOINT_OFFSET)
    if seq % 2 or length > MAX_CHECKPOINT_PATH:
        return beat  # the worker is writing the checkpoint fields (or they are garbage)
    raw = data[_PATH_OFFSET : _PATH_OFFSET + length]
    return replace(
        beat,
        checkpoint_step=checkpoint_step if checkpoint_step >= 0 else None,
        # UTF-8 with replacement: the path goes into JSON (the job document) and an env var.
        checkpoint_path=raw.decode("utf-8", "replace") if raw and b"\0" not in raw else None,
        checkpointing_since=since_ns / 1e9 if since_ns else None,
    )


# -- worker side -----------------------------------------------------------------


class _Heartbeat:
    """The worker's mapping of its heartbeat file; ``ping`` is the hot path."""

    __slots__ = ("count", "extended", "layout", "map", "pid", "seq", "step", "tried")

    def __init__(self) -> None:
        self.map: mmap.mmap | None = None
        self.tried = False
        self.extended = False
        """The file has the progress fields (not the first 64-byte layout)."""
        self.count = 0
        self.step = -1
        self.seq = 0
        self.pid = 0
        self.layout = 0

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
            size = os.fstat(fd).st_size
            if size < V1_SIZE:
                return
            mapped = mmap.mmap(
                fd,
                FILE_SIZE if size >= FILE_SIZE else V1_SIZE,
                mmap.MAP_SHARED,
                mmap.PROT_READ | mmap.PROT_WRITE,
            )
        except (OSError, ValueError):
            return
        finally:
            os.close(fd)
        if _HEADER.unpack_from(mapped, 0) != (MAGIC, VERSION):
            mapped.close()
            return
        self.layout = _LAYOUT.unpack_from(mapped, _LAYOUT_OFFSET)[0]
        self.extended = len(mapped) >= FILE_SIZE and self.layout >= FILE_SIZE
        if self.extended:
            self.seq = _SEQ.unpack_from(mapped, _SEQ_OFFSET)[0] & ~1
        self.pid = os.getpid()
        _PID.pack_into(mapped, _PID_OFFSET, self.pid)
        self.map = mapped

    def forget(self) -> None:
        """In a forked child: drop the parent's mapping and never ping."""
        self.map = None
        self.tried = True


_HB = _Heartbeat()
_OPEN_LOCK = threading.Lock()
os.register_at_fork(after_in_child=_HB.forget)


def _mapping() -> mmap.mmap | None:
    """The mapped file (mapping it on the first call); None outside elasticd."""
    hb = _HB
    if hb.map is None and not hb.tried:
        with _OPEN_LOCK:
            if not hb.tried:
                hb.open()
    return hb.map


def ping(step: int | None = None) -> None:
    """Tell the daemon this worker is making progress, at training step ``step`` if given.

    Costs well under a microsecond once the file is mapped (the first call
    maps it), with or without a step; never blocks on the daemon and never
    raises (a step that is not an integer of 64 bits is ignored). Without
    ``step`` the last step given stays. Outside elasticd (no
    ``ELASTICD_HEARTBEAT_FILE``) it does nothing.
    """
    hb = _HB
    mapped = hb.map
    if mapped is None:
        mapped = _mapping()
        if mapped is None:
            return
    hb.count += 1
    try:
        if hb.extended:
            _BEAT_STEP.pack_into(
                mapped,
                _BEAT_OFFSET,
                hb.count,
                time.monotonic_ns(),
                hb.pid,
                hb.layout,
                hb.step if step is None else step,
            )
            if step is not None:
                hb.step = step
        else:
            _BEAT.pack_into(mapped, _BEAT_OFFSET, hb.count, time.monotonic_ns())
    except (ValueError, TypeError, struct.error):  # closed by a concurrent forget(); a bad step
        if step is not None:  # a refused step may have left a half-written beat: rewrite it
            hb.count -= 1
            ping()


def checkpointing() -> None:
    """Say that a checkpoint begins now: until :func:`checkpointed`, ``checkpoint_timeout`` applies.

    A checkpoint may take much longer than a step; while one is in progress
    the daemon judges the worker by the job's ``checkpoint_timeout`` instead
    of its ``progress_timeout``. Counts as a ping. Never raises; a no-op
    outside elasticd.
    """
    mapped = _mapping()
    if mapped is None:
        return
    if _HB.extended:
        with contextlib.suppress(ValueError, TypeError):
            _SINCE.pack_into(mapped, _SINCE_OFFSET, time.monotonic_ns())
    ping()


def checkpointed(step: int, path: str | os.PathLike[str] | None = None) -> None:
    """Report a durable checkpoint of training step ``step`` (at ``path``, when given).

    Ends the checkpoint begun by :func:`checkpointing` (if any) and counts as
    a ping. A restarted attempt of the job gets the last checkpoint in
    ``ELASTICD_CHECKPOINT_STEP`` (and ``ELASTICD_CHECKPOINT_PATH``). Raises
    ``ValueError`` for a negative step, or a path longer than
    :data:`MAX_CHECKPOINT_PATH` bytes or holding a NUL; a no-op outside
    elasticd.
    """
    step = operator.index(step)
    if not 0 <= step < 2**63:
        raise ValueError(f"checkpointed(step): a step is a non-negative integer, not {step!r}")
    raw = b"" if path is None else os.fsencode(path)
    if len(raw) > MAX_CHECKPOINT_PATH or b"\0" in raw:
        raise ValueError(
            f"checkpointed(path=): the path must be at most {MAX_CHECKPOINT_PATH} bytes "
            f"without NUL, not {len(raw)} bytes"
        )
    mapped = _mapping()
    if mapped is None:
        return
    hb = _HB
    if hb.extended:
        with _OPEN_LOCK, contextlib.suppress(ValueError, TypeError):
            # Odd while in flux: a reader that sees it keeps what it read before.
            hb.seq += 1
            _SEQ.pack_into(mapped, _SEQ_OFFSET, hb.seq)
            mapped[_PATH_OFFSET : _PATH_OFFSET + len(raw)] = raw
            hb.seq += 1
            _CHECKPOINT.pack_into(mapped, _CHECKPOINT_OFFSET, step, 0, hb.seq - 1, len(raw))
            _SEQ.pack_into(mapped, _SEQ_OFFSET, hb.seq)
    ping()


def _reset_for_tests() -> None:
    """Forget the mapping so that the next ping maps the file named by the environment again."""
    with _OPEN_LOCK:
        if _HB.map is not None:
            _HB.map.close()
        _HB.map = None
        _HB.tried = False
        _HB.count = 0
        _HB.step = -1
        _HB.extended = False
