"""A worker's output stream: a pipe the daemon's event loop reads into a log file.

Each stream (stdout, stderr) of each worker gets its own pipe. The write end
becomes the worker's fd 1 or 2; the read end is registered with the event
loop, and every chunk the kernel hands over is appended to the log file at
once, with one unbuffered ``write`` (so ``tail -f`` and the logs API see it
immediately and nothing sits in a buffer when the daemon stops), and, when
console forwarding is on for that stream, split into lines for the sink.

Nothing here ever waits on the worker: reading is driven by readiness, the
pipe buffer is raised to 256 KiB where the kernel allows, so a worker that
prints a burst keeps running even if the loop is busy for a moment, and a
full disk drops output rather than blocking the pipe. Dropped output is
counted (:attr:`OutputPipe.bytes_lost`, reported by the agent in a
``logs.lost`` event), every later chunk is tried again (writing resumes by
itself when space returns), and while a log file refuses writes the
daemon's :class:`~elasticd.storage.StorageHealth` says so (``/readyz``).

The daemon writes as root, so it also holds itself to what the job's user
could write (:mod:`elasticd.supervise.outputlimits`): where only root's
reserve is left on the log filesystem, or the user's quota is spent, a chunk
is dropped before it is written, exactly as if the disk had refused it
(counted in ``bytes_lost``, ``/readyz`` says so, writing resumes when room
returns). Past the attempt's budget (``log_limit_bytes`` per stream), output
is counted in :attr:`OutputPipe.bytes_over_budget` and dropped for the rest
of the attempt (a ``logs.truncated`` event). Neither touches the console
forwarding: a forwarded stream reaches the sink whole, as before.
This runs on the daemon's side, on a file it opened itself
(:func:`_open_log`: no link followed, never blocking).

The pipe is owned here and not by :mod:`asyncio.subprocess` on purpose: with
asyncio's own pipes, ``Process.wait()`` on Python 3.11 returns only once the
pipes are closed, and a grandchild that inherited stdout keeps them open
after the worker itself has died. Keeping the pipes out of the subprocess
transport makes exit detection independent of EOF; EOF is awaited separately
(:meth:`OutputPipe.wait_eof`), so output written up to the exit is drained.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, Literal

from elasticd.security import LOG_FILE_MODE
from elasticd.storage import StorageHealth, describe
from elasticd.supervise.adopt import HandedPipe, inheritable_dup
from elasticd.supervise.outputlimits import Limit, SpaceGuard, admit

__all__ = ["MAX_LINE_BYTES", "PIPE_BUFFER_BYTES", "OutputPipe", "OutputSink", "Stream"]

log = logging.getLogger(__name__)

#: What starts an error report on stderr (:attr:`OutputPipe.error_at`); the whole report is
#: read from the log at the exit (:mod:`elasticd.supervise.tracebacks`).
ERROR_MARKERS = (b"Traceback (most recent call last):", b"terminate called after throwing")

Stream = Literal["stdout", "stderr"]

#: Receives one line (with its trailing newline) of a worker's output:
#: ``(local_rank, stream, line)``. Called on the event loop; it must not block.
OutputSink = Callable[[int, Stream, bytes], None]

#: Asked of the kernel for each pipe: what the loop reads in one go, so a
#: burst fits while the loop is busy elsewhere. Not more, because pipe memory
#: counts against the daemon user's pipe-user-pages-soft (64 MiB by default),
#: past which Linux gives new pipes a single page. A refusal keeps the 64 KiB default.
PIPE_BUFFER_BYTES = 1 << 18

#: Output with no newline for this long is forwarded to the sink in pieces,
#: so a worker that never prints a newline cannot grow the daemon's memory.
MAX_LINE_BYTES = 1 << 16


class OutputPipe:
    """One stream of one worker: pipe -> log file (appended), and lines -> sink when forwarded.

    Life: :meth:`open` (file and pipe exist, the loop reads), hand
    :attr:`write_fd` to the child, :meth:`close_write_end` once it is spawned,
    :meth:`wait_eof` until every holder of the write end is gone, :meth:`close`.
    """

    def __init__(
        self,
        local_rank: int,
        stream: Stream,
        log_path: Path,
        file: BinaryIO | None,
        write_fd: int,
        sink: OutputSink | None,
        health: StorageHealth | None = None,
        on_written: Callable[[Path], None] | None = None,
        limit_bytes: int | None = None,
        guard: SpaceGuard | None = None,
    ) -> None:
        self.local_rank = local_rank
        self._on_written = on_written
        self.stream: Stream = stream
        self.log_path = log_path
        self._file: BinaryIO | None = file
        self._write_fd: int | None = write_fd
        self._sink = sink
        self._partial = b""
        self._transport: asyncio.ReadTransport | None = None
        self._eof = asyncio.Event()
        self._write_failed = False
        self._sink_failed = False
        self._health = health
        #: Output read from the worker that could not be written to the log file: the disk
        #: refused it, or only root's reserve or none of the user's quota was left.
        self.bytes_lost = 0
        #: Output past :attr:`limit_bytes`, dropped (the file keeps the first ``limit_bytes``).
        self.bytes_over_budget = 0
        #: The most bytes this attempt's log file takes (None: no budget).
        self.limit_bytes = limit_bytes
        self._guard = guard
        self._offered = 0  # bytes handed to the file (written or refused by the disk)
        #: The wall clock :attr:`error_at` is read from (the group's clock, set by its owner).
        self.clock: Callable[[], float] = time.time
        #: When the stream last carried the start of an error report (a Python traceback, a
        #: C++ abort): when a failed worker said what it died of, which may be well before
        #: its exit (torch's teardown), and before its peers died of losing it.
        self.error_at: float | None = None

    @classmethod
    async def open(
        cls,
        local_rank: int,
        stream: Stream,
        log_path: Path,
        sink: OutputSink | None,
        *,
        owner: tuple[int, int] | None = None,
        health: StorageHealth | None = None,
        on_written: Callable[[Path], None] | None = None,
        limit_bytes: int | None = None,
        guard: SpaceGuard | None = None,
    ) -> OutputPipe:
        """Open `log_path` for appending and a pipe whose read end the loop watches.

        The file is never reached through a symbolic link, must be a
        regular file without other hard links, and an existing one must be
        the daemon's or the worker's (a worker may own the folder it lies
        in). With `owner` (uid, gid) the file is handed to the worker's user.
        ``on_written(log_path)`` is called after each chunk lands in the file
        (log followers wait on it: :mod:`elasticd.node.logfollow`). The file
        takes at most `limit_bytes` of this pipe's output, and only what
        `guard` finds room for on the disk.
        Raises OSError when the file cannot be opened or is refused; nothing
        is left open then.
        """
        file = _open_log(log_path, owner)
        try:
            read_fd, write_fd = os.pipe()
        except OSError:
            file.close()
            raise
        with contextlib.suppress(OSError):
            fcntl.fcntl(write_fd, fcntl.F_SETPIPE_SZ, PIPE_BUFFER_BYTES)
        pipe = cls(local_rank, stream, log_path, file, write_fd, sink, health, on_written)
        pipe.limit_bytes, pipe._guard = limit_bytes, guard
        await pipe._read(read_fd)
        return pipe

    async def _read(self, read_fd: int) -> None:
        """Have the loop read ``read_fd``; if that fails, nothing of the pipe is left open."""
        try:
            reader = os.fdopen(read_fd, "rb", buffering=0)
        except BaseException:
            os.close(read_fd)
            self.close()
            raise
        try:
            loop = asyncio.get_running_loop()
            transport, _ = await loop.connect_read_pipe(lambda: _PipeProtocol(self), reader)
        except BaseException:
            reader.close()
            self.close()
            raise
        self._transport = transport

    @classmethod
    async def adopt(
        cls,
        local_rank: int,
        stream: Stream,
        log_path: Path,
        sink: OutputSink | None,
        handed: HandedPipe,
        *,
        health: StorageHealth | None = None,
        on_written: Callable[[Path], None] | None = None,
        limit_bytes: int | None = None,
        guard: SpaceGuard | None = None,
    ) -> OutputPipe:
        """The pipe of a worker taken up after the daemon's re-exec: the read end and the log
        file the previous image handed over (:mod:`elasticd.supervise.adopt`). What the
        worker wrote meanwhile waits in the pipe: nothing is lost or read twice."""
        for fd in handed.fds:
            os.set_inheritable(fd, False)  # no later child may inherit them
        file = None if handed.at_eof else os.fdopen(handed.file_fd, "ab", buffering=0)
        pipe = cls(local_rank, stream, log_path, file, -1, sink, health, on_written)
        pipe._write_fd = None
        pipe.limit_bytes, pipe._guard, pipe._offered = limit_bytes, guard, handed.offered
        if handed.at_eof:
            pipe._finish()  # its worker exited before the exec and every byte is in the file
        else:
            await pipe._read(handed.read_fd)
        return pipe

    def hand_over(self) -> HandedPipe:
        """Inheritable copies of the read end and the log file, for the next program image
        (the daemon's re-exec); everything read so far is in the file already. A pipe at
        its end hands nothing (its read end and file are closed)."""
        if self._eof.is_set():
            return HandedPipe(read_fd=-1, file_fd=-1, offered=self._offered, at_eof=True)
        assert self._transport is not None
        assert self._file is not None
        read_fd = self._transport.get_extra_info("pipe").fileno()
        return HandedPipe(
            read_fd=inheritable_dup(read_fd),
            file_fd=inheritable_dup(self._file.fileno()),
            offered=self._offered,
        )

    @property
    def write_fd(self) -> int:
        """The write end, for the child's stdout or stderr."""
        if self._write_fd is None:
            raise RuntimeError("the write end of this pipe is already closed")
        return self._write_fd

    @property
    def at_eof(self) -> bool:
        """True once every process holding the write end has closed it (or the pipe was closed)."""
        return self._eof.is_set()

    def close_write_end(self) -> None:
        """Drop the daemon's copy of the write end; EOF then comes when the worker's copies go."""
        if self._write_fd is not None:
            fd, self._write_fd = self._write_fd, None
            os.close(fd)

    async def wait_eof(self) -> None:
        """Return when the pipe has reached EOF and everything before it is in the log."""
        await self._eof.wait()

    def close(self) -> None:
        """Stop reading, forward a last unterminated line, close the pipe and the file.

        Idempotent. Output still buffered in the pipe of a process that escaped
        the worker's process group is given up here.
        """
        self.close_write_end()
        if self._transport is not None:
            transport, self._transport = self._transport, None
            transport.close()
        self._finish()

    # Called by the protocol, on the event loop.

    def _on_data(self, data: bytes) -> None:
        if self.stream == "stderr" and any(marker in data for marker in ERROR_MARKERS):
            self.error_at = self.clock()
        if self._file is not None:
            self._append(self._file, data)
        if self._sink is not None:
            self._forward(data)

    def _append(self, file: BinaryIO, data: bytes) -> None:
        """Write what the budget and the user's room on the disk admit; count the rest."""
        if self.bytes_over_budget:
            self.bytes_over_budget += len(data)  # the budget is spent for the whole attempt
            return
        budget_left = None if self.limit_bytes is None else self.limit_bytes - self._offered
        disk = self._guard.room(file.fileno()) if self._guard is not None else None
        admission = admit(len(data), budget_left, disk)
        if admission.dropped:
            self._dropped(admission.dropped, admission.limit)
        if admission.keep:
            self._offered += admission.keep
            if self._guard is not None:
                self._guard.wrote(admission.keep)
            self._write(file, data if admission.keep == len(data) else data[: admission.keep])

    def _dropped(self, n: int, limit: Limit | None) -> None:
        if limit == "budget":
            self.bytes_over_budget += n
            log.warning(
                "local rank %d: %s reached its budget of %d bytes (log_limit_bytes) in %s; "
                "the rest of this attempt's %s is counted and dropped",
                self.local_rank,
                self.stream,
                self.limit_bytes,
                self.log_path,
                self.stream,
            )
            return
        what = "quota" if limit == "quota" else "space for unprivileged users"
        self._refused(n, f"disk full for the job's user (no {what} left)")

    def _refused(self, n: int, reason: str) -> None:
        """``n`` bytes could not be written; the first refusal of an episode is reported."""
        self.bytes_lost += n
        if not self._write_failed:
            self._write_failed = True
            log.error(
                "local rank %d: cannot write %s to %s (%s); output is dropped and counted "
                "until the disk takes it again",
                self.local_rank,
                self.stream,
                self.log_path,
                reason,
            )
            if self._health is not None:
                self._health.failing(self._source, reason)

    def _write(self, file: BinaryIO, data: bytes) -> None:
        """Append ``data``; what the disk refuses is counted, and the next chunk tries again."""
        view = memoryview(data)
        try:
            while view:
                written = file.write(view)
                if not written:
                    raise OSError(errno.ENOSPC, "no progress writing the log file")
                view = view[written:]
        except OSError as exc:
            # Keep reading (the worker must not block on a full pipe); count what is lost.
            self._refused(len(view), describe(exc))
            return
        if self._on_written is not None:
            try:
                self._on_written(self.log_path)
            except Exception:  # a follower's wake-up must never cost output
                log.exception("log growth callback failed")
        if self._write_failed:
            self._write_failed = False
            log.warning(
                "local rank %d: writing %s to %s again (%d bytes lost so far)",
                self.local_rank,
                self.stream,
                self.log_path,
                self.bytes_lost,
            )
            if self._health is not None:
                self._health.ok(self._source)

    @property
    def _source(self) -> str:
        return f"log {self.log_path}"

    def _on_eof(self) -> None:
        self._transport = None
        self._finish()

    def _finish(self) -> None:
        if self._partial:
            rest, self._partial = self._partial, b""
            self._emit(rest)
        if self._file is not None:
            file, self._file = self._file, None
            with contextlib.suppress(OSError):  # nothing is buffered (buffering=0)
                file.close()
        if self._write_failed and self._health is not None:
            self._health.ok(self._source, gone=True)  # the loss is in bytes_lost
        self._eof.set()

    def _forward(self, data: bytes) -> None:
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            self._emit(line + b"\n")
        while len(self._partial) > MAX_LINE_BYTES:
            piece, self._partial = self._partial[:MAX_LINE_BYTES], self._partial[MAX_LINE_BYTES:]
            self._emit(piece)

    def _emit(self, line: bytes) -> None:
        if self._sink is None:
            return
        try:
            self._sink(self.local_rank, self.stream, line)
        except Exception:
            # A broken sink must not stop the log file or the pipe; say so once.
            if not self._sink_failed:
                self._sink_failed = True
                log.exception(
                    "local rank %d: the %s output sink failed; continuing without it",
                    self.local_rank,
                    self.stream,
                )


def _open_log(path: Path, owner: tuple[int, int] | None) -> BinaryIO:
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
    # Born private (0600): the output of a job is its user's only (and root's).
    fd = os.open(path, flags, LOG_FILE_MODE)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        # The folder is the worker's: a hard link planted there (to a file of root's, where
        # fs.protected_hardlinks is off) must not be appended to, chowned or chmodded.
        if st.st_nlink != 1:
            raise OSError(errno.EPERM, "has other hard links; refusing to use it", str(path))
        if st.st_uid not in (os.geteuid(), owner[0] if owner is not None else os.geteuid()):
            raise OSError(errno.EPERM, f"belongs to uid {st.st_uid}; refusing to use it", str(path))
        if owner is not None:
            # By descriptor, so the file that is handed over is the one that was opened.
            os.fchown(fd, *owner)
            os.fchmod(fd, LOG_FILE_MODE)
        return os.fdopen(fd, "ab", buffering=0)
    except BaseException:
        os.close(fd)
        raise


class _PipeProtocol(asyncio.Protocol):
    """Hands the read transport's callbacks to its :class:`OutputPipe`."""

    def __init__(self, pipe: OutputPipe) -> None:
        self._pipe = pipe

    def data_received(self, data: bytes) -> None:
        self._pipe._on_data(data)

    def eof_received(self) -> bool | None:
        return None  # let the transport close; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self._pipe._on_eof()
