"""Following a worker's log as it grows: the daemon-side service behind ``GET .../logs?follow``.

The daemon is the only writer of its workers' log files (the output pipes of
:mod:`elasticd.supervise.output` append every chunk the moment it arrives), so
it knows when a file grew: each pipe calls :meth:`LogGrowth.grew` after a
write, and a follower waits for that, for the job's next event (a new
attempt, the end of the job) or for the daemon's stop, whichever comes
first. Nothing polls a file that is being followed; only a log that cannot
be opened (not written yet, or refused because the job put a link or a FIFO
in its place) is tried again every :data:`RETRY_OPEN_S`. With ``attempt=None`` the follower
moves on to each new attempt (:class:`~elasticd.logs.LogLayout` finds them),
marking the switch with ``==> attempt N <==``; it ends once the job is
terminal or the daemon stops, after reading what was written up to then.

Which side of the boundary: the daemon, reading files in the job's folders.
A log is opened only through ``JobService.open_log`` (no link followed, no
FIFO, a regular file of the worker's own), and opened and read in a thread,
so a job that swaps its log file can neither redirect nor stall a follower.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from elasticd.errors import LogNotFound, StoreError
from elasticd.logs import Stream
from elasticd.tasks import race

if TYPE_CHECKING:
    from elasticd.node.jobs import JobService

__all__ = ["LogGrowth", "follow_log"]

#: How long one wait for the job's events lasts before it is asked again (a long poll).
EVENT_WAIT_S = 30.0
#: How soon a log that could not be opened (absent, or refused) is tried again.
RETRY_OPEN_S = 0.25
#: Pause after a failed read of the cluster store before trying again.
ERROR_PAUSE_S = 1.0
_CHUNK = 64 * 1024
_TAIL_WINDOW = 8 * 1024 * 1024


class LogGrowth:
    """Who waits for which log file to grow; the output pipes say when one did."""

    def __init__(self) -> None:
        self._waiting: dict[Path, set[asyncio.Future[None]]] = {}

    def arm(self, path: Path) -> asyncio.Future[None]:
        """A future that completes at the next :meth:`grew` of ``path``; arm before reading."""
        future = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(path, set()).add(future)
        future.add_done_callback(lambda f: self._forget(path, f))
        return future

    def grew(self, path: Path) -> None:
        """``path`` got new bytes (called on the loop by the pipe that wrote them)."""
        for future in list(self._waiting.get(path, ())):
            if not future.done():
                future.set_result(None)

    def _forget(self, path: Path, future: asyncio.Future[None]) -> None:
        waiting = self._waiting.get(path)
        if waiting is not None:
            waiting.discard(future)
            if not waiting:
                del self._waiting[path]


def tail_start(fh: BinaryIO, size: int, lines: int) -> int:
    """The offset where the last ``lines`` lines (of the first ``size`` bytes) begin."""
    start = max(0, size - _TAIL_WINDOW)
    fh.seek(start)
    data = fh.read(size - start)
    if lines == 0:
        return size
    cut = len(data)
    if data.endswith(b"\n"):
        cut -= 1
    for _ in range(lines):
        cut = data.rfind(b"\n", 0, cut)
        if cut < 0:
            return start
    return start + cut + 1


def open_log_at_tail(
    jobs: JobService,
    job_id: str,
    local_rank: int,
    stream: Stream,
    attempt: int,
    tail: int | None,
    incarnation: str,
) -> BinaryIO:
    """The log opened safely (``JobService.open_log``), at its last ``tail`` lines. Blocking."""
    fh = jobs.open_log(job_id, local_rank, stream, attempt, incarnation=incarnation)
    try:
        if tail is not None:
            fh.seek(tail_start(fh, os.fstat(fh.fileno()).st_size, tail))
    except BaseException:
        fh.close()
        raise
    return fh


async def _read_new(fh: BinaryIO) -> bytes:
    """The next chunk past the read position, read in a thread; ``b""`` when there is none."""
    if os.fstat(fh.fileno()).st_size <= fh.tell():
        return b""
    return await asyncio.to_thread(fh.read, _CHUNK)


async def follow_log(
    jobs: JobService,
    growth: LogGrowth,
    closing: asyncio.Event,
    job_id: str,
    local_rank: int,
    stream: Stream,
    attempt: int | None,
    tail: int | None,
    incarnation: str,
) -> AsyncIterator[bytes]:
    """A worker's log as it grows (see the module); ends when the job or the daemon does.

    ``incarnation``: the job followed (``jobs.incarnation``); only its folders are read.
    """
    current = attempt
    fh: BinaryIO | None = None
    path: Path | None = None
    after = 0
    final = False
    last_byte = b"\n"
    first = True
    try:
        while True:
            if fh is None:
                if attempt is None:  # the newest attempt, until its file appears
                    found = jobs.log_attempts(job_id, incarnation)
                    current = found[-1] if found else None
                if current is not None:
                    try:
                        fh = await asyncio.to_thread(
                            open_log_at_tail,
                            jobs,
                            job_id,
                            local_rank,
                            stream,
                            current,
                            tail if first else None,
                            incarnation,
                        )
                    except LogNotFound:
                        fh = None  # not there (yet), or replaced by the job: nothing to read
                    if fh is not None:
                        if not first:
                            sep = b"" if last_byte == b"\n" else b"\n"
                            yield sep + f"==> attempt {current} <==\n".encode()
                        first = False
            path = (
                None if current is None else jobs.logs.log_file(job_id, current, local_rank, stream)
            )
            # Armed before the read: a write between the read and the wait still wakes us.
            grown = growth.arm(path) if path is not None else None
            if fh is not None:
                data = await _read_new(fh)
                if data:
                    if grown is not None:
                        grown.cancel()
                    last_byte = data[-1:]
                    yield data
                    continue
            if attempt is None and fh is not None:
                found = jobs.log_attempts(job_id, incarnation)
                if found and current is not None and found[-1] > current:
                    if grown is not None:
                        grown.cancel()
                    fh.close()
                    fh, current = None, found[-1]
                    continue
            if final:
                if grown is not None:
                    grown.cancel()
                return
            # No readable file yet (not written, or refused: the job put a link or a FIFO in
            # its place): its first write wakes us, and a refused one is tried again shortly.
            retry = RETRY_OPEN_S if fh is None and path is not None else None
            final, after = await _wait(jobs, grown, closing, job_id, after, retry)
    finally:
        if fh is not None:
            fh.close()


async def _wait(
    jobs: JobService,
    grown: asyncio.Future[None] | None,
    closing: asyncio.Event,
    job_id: str,
    after: int,
    retry: float | None,
) -> tuple[bool, int]:
    """Until the file grows, the job has a new event, the daemon stops (or ``retry`` passes).

    Returns ``(final, after)``: ``final`` when the job is over or the daemon
    stops (one more pass reads what was written up to then).
    """
    try:
        job = await jobs.get(job_id)
    except StoreError:
        job = None  # the store is away for a moment: keep following the file
    if (job is not None and job.state.is_terminal) or closing.is_set():
        if grown is not None:
            grown.cancel()
        return True, after
    waits: list[Awaitable[Any]] = [closing.wait()]
    if grown is not None:
        waits.append(grown)
    waits.append(jobs.follow_events(job_id, after, EVENT_WAIT_S if retry is None else retry))
    try:
        which, result = await race(*waits)
    except StoreError:
        # The event follow failed (the store is away): wait a moment, or for the file.
        pause: list[Awaitable[Any]] = [closing.wait(), asyncio.sleep(ERROR_PAUSE_S)]
        if grown is not None and not grown.done():
            pause.append(grown)
        await race(*pause)
        return closing.is_set(), after
    if which == 0:
        return True, after
    if which == len(waits) - 1 and result:
        after = result[-1].seq
    return False, after
