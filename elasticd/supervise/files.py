"""Reading a file a worker can write, from the daemon: never through a link, never blocking.

A worker owns its own folder, ``<log_root>/<job>/attempt_<n>/<local_rank>``,
and everything in it (its ``stdout.log``, ``stderr.log``, ``error.json``);
the folders above it are the daemon's (:func:`elasticd.security.prepare_worker_dir`).
So the worker can, at any moment, replace a file in its folder with a symbolic
link to a root-only file, a FIFO that blocks whoever opens it, or a hard link.
Checking a path and then opening it (``resolve()``, ``is_file()``, ``open()``)
is a race the worker wins a fraction of the time.

:func:`open_worker_file` is the one way the daemon opens such a file for
reading. It never looks at a path twice: it opens the daemon-owned attempt
folder, then the rank folder *relative to that descriptor* with
``O_DIRECTORY | O_NOFOLLOW``, then the file relative to the rank folder with
``O_NOFOLLOW | O_NONBLOCK`` (a FIFO opens at once instead of waiting for a
writer), and checks ``fstat`` of the descriptor it got: a regular file with
one link (a hard link to someone else's file has two or more). Whatever the
worker swaps in between, the daemon reads either the worker's own regular
file or nothing.

Callers on the event loop run the open and the read in a thread
(:func:`asyncio.to_thread`): a regular file never blocks for long, but a
slow disk must not stall the API.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

__all__ = ["UnsafeWorkerFile", "open_worker_file", "read_worker_file"]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW
_FILE_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY


class UnsafeWorkerFile(OSError):
    """The worker's file is a link, not a regular file, or has other names; it is not read."""


def open_worker_file(worker_dir: Path, name: str) -> int:
    """A read-only descriptor of the regular file ``name`` in ``worker_dir``.

    ``worker_dir`` is ``<...>/attempt_<n>/<local_rank>``: its parent must be
    a folder the worker cannot change. Raises ``FileNotFoundError`` when the
    file (or a folder) is absent, :class:`UnsafeWorkerFile` when something a
    worker planted was found instead (a link, a FIFO, a device, a hard link),
    and ``OSError`` for any other failure. The caller closes the descriptor.
    """
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"{name!r} is not a file name")
    parent = os.open(worker_dir.parent, _DIR_FLAGS)
    try:
        rank = _open_at(worker_dir.name, _DIR_FLAGS, parent, worker_dir)
    finally:
        os.close(parent)
    try:
        fd = _open_at(name, _FILE_FLAGS, rank, worker_dir / name)
    finally:
        os.close(rank)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnsafeWorkerFile(errno.EINVAL, "not a regular file", str(worker_dir / name))
        if info.st_nlink > 1:
            raise UnsafeWorkerFile(errno.EMLINK, "has other hard links", str(worker_dir / name))
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_at(name: str, flags: int, dir_fd: int, shown: Path) -> int:
    try:
        return os.open(name, flags, dir_fd=dir_fd)
    except OSError as exc:
        # O_NOFOLLOW on a link: ELOOP; O_DIRECTORY on a link or a file: ENOTDIR.
        if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENXIO, errno.EMLINK):
            why = "a link or not the expected kind of file"
            raise UnsafeWorkerFile(exc.errno, why, str(shown)) from None
        raise


def read_worker_file(worker_dir: Path, name: str, limit: int, *, tail: bool = False) -> bytes:
    """At most ``limit`` bytes of a worker's file: its start, or with ``tail`` its end.

    Blocking (call it in a thread from the event loop); raises as
    :func:`open_worker_file` does.
    """
    fd = open_worker_file(worker_dir, name)
    try:
        if tail:
            size = os.fstat(fd).st_size
            if size > limit:
                os.lseek(fd, size - limit, os.SEEK_SET)
        chunks: list[bytes] = []
        got = 0
        while got < limit:
            chunk = os.read(fd, min(limit - got, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)
