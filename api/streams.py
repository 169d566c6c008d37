"""Long-lived responses: a job's events as Server-Sent Events, and a worker's log as it grows.

Both wake on the event log's notification (:meth:`~elasticd.events.EventLog.follow`)
rather than on a timer, both end when the job is terminal (after delivering
what is left), and both end at once when the daemon sets
``Daemon.closing_streams`` during shutdown, so that an open stream never holds
the HTTP server, and with it the daemon, past its stop.

SSE framing (https://html.spec.whatwg.org/multipage/server-sent-events.html):
``id:`` is the event's ``seq``, ``event:`` its ``kind``, ``data:`` the event as
JSON. A reconnect that sends ``Last-Event-ID`` resumes after that seq, so
nothing is missed and nothing repeated. A comment line every
:data:`HEARTBEAT_S` seconds keeps proxies from closing an idle stream. The
last message is ``event: end`` with the job's final state, so clients know
the stream ended on purpose and need not reconnect.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Literal

from elasticd.errors import LogNotFound
from elasticd.models import Event

if TYPE_CHECKING:
    from elasticd.daemon import Daemon

#: Seconds between SSE heartbeat comments (tests lower it).
HEARTBEAT_S = 15.0
#: What SSE clients are told to wait before reconnecting, in milliseconds.
RETRY_MS = 2000
#: Seconds between checks of a followed log file for new bytes (see follow_log).
LOG_POLL_S = 0.25
_CHUNK = 64 * 1024
_TAIL_WINDOW = 8 * 1024 * 1024


def sse_message(event: Event) -> str:
    """One event as an SSE message."""
    kind = event.kind.replace("\r", " ").replace("\n", " ")
    return f"id: {event.seq}\nevent: {kind}\ndata: {event.model_dump_json()}\n\n"


def resume_point(after: int, last_event_id: str | None) -> int:
    """Where a stream starts: after ``Last-Event-ID`` when the client sends one."""
    if last_event_id is not None and last_event_id.strip().isdigit():
        return max(after, int(last_event_id.strip()))
    return after


async def _wait_or_close(
    follow: Coroutine[Any, Any, list[Event]], closing: asyncio.Event
) -> list[Event] | None:
    """The follow's result, or None when the daemon closes streams first."""
    follower = asyncio.ensure_future(follow)
    stopper = asyncio.ensure_future(closing.wait())
    try:
        await asyncio.wait({follower, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (follower, stopper):
            task.cancel()
        await asyncio.gather(follower, stopper, return_exceptions=True)
    if follower.cancelled() or follower.exception() is not None:
        return None
    return follower.result()


async def event_stream(
    daemon: Daemon, job_id: str, after: int, heartbeat: float = HEARTBEAT_S
) -> AsyncIterator[str]:
    """The job's events after ``after`` as SSE, until the job is terminal."""
    jobs = daemon.jobs
    yield f"retry: {RETRY_MS}\n\n"
    while True:
        events = jobs.list_events(job_id, after, 1000)
        if events:
            after = events[-1].seq
            yield "".join(sse_message(e) for e in events)
            continue
        # Nothing unread. The read and this check run without an await in between,
        # so a job that is terminal here has had its final events read above.
        job = jobs.get(job_id)
        if job.state.is_terminal:
            end = json.dumps({"job_id": job.id, "state": job.state.value, "last_seq": after})
            yield f"event: end\ndata: {end}\n\n"
            return
        if daemon.closing_streams.is_set():
            return
        got = await _wait_or_close(
            jobs.follow_events(job_id, after, heartbeat), daemon.closing_streams
        )
        if got is None:
            return
        if not got:
            yield ": heartbeat\n\n"


def _attempts(job_dir: Path) -> list[int]:
    return sorted(
        int(p.name.removeprefix("attempt_"))
        for p in job_dir.glob("attempt_*")
        if p.name.removeprefix("attempt_").isdigit()
    )


def _tail_start(fh: BinaryIO, size: int, lines: int) -> int:
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


async def follow_log(
    daemon: Daemon,
    job_id: str,
    local_rank: int,
    stream: Literal["stdout", "stderr"],
    attempt: int | None,
    tail: int | None,
) -> AsyncIterator[bytes]:
    """A worker's log as it grows; with ``attempt=None`` it moves on to each new attempt.

    The log files are appended by the daemon's output pipes
    (:mod:`elasticd.workers.output`), which announce nothing per write. So
    the loop wakes on the job's events (a new attempt, the end of the job)
    and, between them, looks at the file once every :data:`LOG_POLL_S`
    seconds: a ``read`` at EOF is a cheap syscall, and a bounded interval
    keeps a followed log at most that far behind.
    """
    jobs = daemon.jobs
    job_dir = (daemon.config.logs / job_id).resolve()
    current = attempt
    fh: BinaryIO | None = None
    after = 0
    final = False
    last_byte = b"\n"
    first = True
    try:
        while True:
            if fh is None:
                if attempt is None:  # the newest attempt, until its file appears
                    found = _attempts(job_dir)
                    current = found[-1] if found else None
                if current is not None:
                    try:
                        path = jobs.log_file(job_id, local_rank, stream, current)
                    except LogNotFound:
                        path = None
                    if path is not None:
                        fh = path.open("rb")
                        if first and tail is not None:
                            size = path.stat().st_size
                            fh.seek(_tail_start(fh, size, tail))
                        if not first:
                            sep = b"" if last_byte == b"\n" else b"\n"
                            yield sep + f"==> attempt {current} <==\n".encode()
                        first = False
            if fh is not None:
                data = fh.read(_CHUNK)
                if data:
                    last_byte = data[-1:]
                    yield data
                    continue
            if attempt is None and fh is not None:
                found = _attempts(job_dir)
                if found and current is not None and found[-1] > current:
                    fh.close()
                    fh, current = None, found[-1]
                    continue
            if final:
                return
            job = jobs.get(job_id)
            if job.state.is_terminal:
                final = True  # one more pass reads what was written up to the end
                continue
            if daemon.closing_streams.is_set():
                return
            got = await _wait_or_close(
                jobs.follow_events(job_id, after, LOG_POLL_S), daemon.closing_streams
            )
            if got is None:
                return
            if got:
                after = got[-1].seq
    finally:
        if fh is not None:
            fh.close()
