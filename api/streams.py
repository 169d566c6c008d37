"""Long-lived responses: a job's events as Server-Sent Events, and a worker's log as it grows.

Both wake on a notification (the event log's,
:meth:`~elasticd.node.events.EventLog.follow`; for a log, also the output pipe's)
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

A worker's log is followed by the daemon's :mod:`elasticd.node.logfollow` (it
wakes when the output pipe writes the file, never on a timer, and opens the
file only through ``JobService.open_log``, in a thread). At most
``max_streams`` streams run at once (:class:`StreamLimit`); more get a 429
problem.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import weakref
from collections.abc import AsyncIterator, Coroutine
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from elasticd.errors import JobConflict, JobNotFound, StoreError, TooManyStreams
from elasticd.eventkinds import EventKind
from elasticd.models import Event, Job
from elasticd.node import logfollow
from elasticd.node.jobs import incarnation, same_job
from elasticd.states import JobState
from elasticd.tasks import cancel_and_wait, race

if TYPE_CHECKING:
    from elasticd.node.daemon import Daemon

T = TypeVar("T")

#: Live streams a daemon serves at once unless ``max_streams`` says otherwise.
DEFAULT_MAX_STREAMS = 256
#: Seconds between SSE heartbeat comments (tests lower it).
HEARTBEAT_S = 15.0
#: Seconds a stream waits for the final job.state event once the job document is terminal.
FINAL_EVENT_GRACE_S = 5.0
#: Pause after a failed read of the cluster store before trying again.
ERROR_PAUSE_S = 1.0
#: What SSE clients are told to wait before reconnecting, in milliseconds.
RETRY_MS = 2000


class StreamLimit:
    """At most ``limit`` live streams (log follows and SSE event streams) at once.

    Each stream holds a slot from :meth:`guard` until it ends, its client goes
    away, or it is dropped before it ever started (the slot is then released
    when the generator is collected). Beyond the limit a request gets a 429
    problem naming ``max_streams``, so thousands of followers cannot starve
    the event loop or grow the daemon's memory.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open = 0

    def guard(self, body: AsyncIterator[T]) -> AsyncIterator[T]:
        """``body`` holding one slot; ``TooManyStreams`` when none is free."""
        if self.open >= self.limit:
            raise TooManyStreams(
                f"this daemon already serves {self.open} live streams (log follows and event "
                f"streams), its max_streams limit; close one, read without follow, or raise "
                "max_streams in the daemon's configuration"
            )
        self.open += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.open -= 1

        async def guarded() -> AsyncIterator[T]:
            try:
                async for item in body:
                    yield item
            finally:
                release()
                aclose = getattr(body, "aclose", None)
                if aclose is not None:
                    await aclose()

        stream = guarded()
        weakref.finalize(stream, release)
        return stream


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
    """The follow's result, or None when the daemon closes streams first.

    A follow that fails (the cluster store is away) counts as "nothing new",
    after a pause, so that a lasting outage is not a busy loop.
    """
    follower = asyncio.ensure_future(follow)
    try:
        with contextlib.suppress(Exception):  # a failed follow is read below
            await race(asyncio.shield(follower), closing.wait())
    finally:
        await cancel_and_wait(follower)  # a no-op when it is done
    if closing.is_set() or follower.cancelled():
        return None
    if follower.exception() is not None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(ERROR_PAUSE_S):
                await closing.wait()
        return None if closing.is_set() else []
    return follower.result()


async def _final_event_seen(daemon: Daemon, job_id: str, state: str) -> bool:
    """Whether the ``job.state`` event of the job's final state is in the log yet."""
    events = await daemon.jobs.list_events(job_id, 0, 1_000_000)
    # The job's own: a job of replica groups' events hold its groups' job.state too.
    return any(
        e.kind == EventKind.JOB_STATE and e.state == state and e.job_id == job_id for e in events
    )


async def event_stream(
    daemon: Daemon, seen: Job, after: int, heartbeat: float = HEARTBEAT_S
) -> AsyncIterator[str]:
    """The job's events after ``after`` as SSE, until the job is terminal.

    ``seen``: the job its reader was authorized for. The stream ends, unfinished, when
    the job is deleted meanwhile; it never goes on with a new job that took its id.
    """
    jobs = daemon.jobs
    job_id = seen.id
    loop = asyncio.get_running_loop()
    final_seen = False
    give_up_at: float | None = None
    yield f"retry: {RETRY_MS}\n\n"
    while True:
        try:
            events = await jobs.list_events(job_id, after, 1000, seen)
            if events:
                after = events[-1].seq
                final_seen = final_seen or any(
                    e.kind == EventKind.JOB_STATE and _terminal(e.state) and e.job_id == job_id
                    for e in events
                )
                yield "".join(sse_message(e) for e in events)
                continue
            job = await jobs.get(job_id)
            same_job(seen, job)
        except (JobNotFound, JobConflict):  # deleted, maybe with its id taken again
            return
        except StoreError:  # the cluster store is away for a moment: say so, try again
            yield ": store unavailable, retrying\n\n"
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(ERROR_PAUSE_S):
                    await daemon.closing_streams.wait()
            if daemon.closing_streams.is_set():
                return
            continue
        if job.state.is_terminal:
            # The job document turns terminal a moment before its job.state event is
            # in the log; end once that event is delivered (or after a grace period,
            # should its writer have died in between).
            if give_up_at is None:
                give_up_at = loop.time() + FINAL_EVENT_GRACE_S
                final_seen = final_seen or await _final_event_seen(daemon, job_id, job.state.value)
            if final_seen or loop.time() >= give_up_at:
                end = json.dumps({"job_id": job.id, "state": job.state.value, "last_seq": after})
                yield f"event: end\ndata: {end}\n\n"
                return
        got: list[Event] | None = None
        if not daemon.closing_streams.is_set():
            timeout = heartbeat if give_up_at is None else max(0.0, give_up_at - loop.time())
            got = await _wait_or_close(
                jobs.follow_events(job_id, after, min(heartbeat, timeout), seen),
                daemon.closing_streams,
            )
        if got is None:  # the daemon is stopping: deliver what its stop recorded, then end
            # Still only the job its reader was authorized for (deleted meanwhile: nothing).
            with contextlib.suppress(StoreError, TimeoutError, JobNotFound, JobConflict):
                async with asyncio.timeout(ERROR_PAUSE_S):
                    events = await jobs.list_events(job_id, after, 10_000, seen)
                    if events:
                        yield "".join(sse_message(e) for e in events)
            return
        if not got and give_up_at is None:
            yield ": heartbeat\n\n"


def _terminal(state: str | None) -> bool:
    return state in {s.value for s in JobState if s.is_terminal}


async def follow_log(
    daemon: Daemon,
    job: Job,
    local_rank: int,
    stream: Literal["stdout", "stderr"],
    attempt: int | None,
    tail: int | None,
) -> AsyncIterator[bytes]:
    """A worker's log as it grows (the daemon's :func:`elasticd.node.logfollow.follow_log`)."""
    async for chunk in logfollow.follow_log(
        daemon.jobs,
        daemon.jobs.log_growth,
        daemon.closing_streams,
        job.id,
        local_rank,
        stream,
        attempt,
        tail,
        incarnation(job),
    ):
        yield chunk
