"""``/jobs``: submit, list, read, cancel; workers, goodput, events and logs of a job."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Header, Query, Request, Response
from fastapi.responses import PlainTextResponse, StreamingResponse

from api import proxy, streams
from api.auth import principal_of, require_lister
from api.deps import daemon_of, jobs_of, streams_of
from api.encode import json_of
from api.problems import PROBLEM_JSON
from api.schemas import Empty, Event, Goodput, Job, JobList, JobSpec, Problem, WorkersView
from elasticd.errors import LogNotFound
from elasticd.identity import Action
from elasticd.models import NODE_NAME_PATTERN
from elasticd.node.jobs import incarnation_tag
from elasticd.states import JobState

router = APIRouter(tags=["jobs"])

_problem: dict[str, Any] = {"model": Problem, "content": {PROBLEM_JSON: {}}}
TOO_MANY_STREAMS: dict[int | str, dict[str, Any]] = {
    429: {"description": "The daemon already serves max_streams live streams", **_problem}
}
NOT_FOUND: dict[int | str, dict[str, Any]] = {
    404: {"description": "No job with that id", **_problem}
}
#: A read of a job by its id: the job may be deleted, and its id taken by a new job, while
#: the read runs; what the new job holds is never answered to the old one's reader.
READ_BY_ID: dict[int | str, dict[str, Any]] = {
    **NOT_FOUND,
    409: {
        "description": "The job was deleted and a new job took its id while it was read",
        **_problem,
    },
}
#: The header naming the job a forwarded request is about (``x_elasticd_job`` of the logs).
JOB_HEADER = "x-elasticd-job"
#: Headers of a long-lived response: no caching, no proxy buffering (nginx).
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@router.post(
    "/jobs",
    status_code=201,
    response_model=Job,
    responses={
        200: {"model": Job, "description": "A job with this id and the same spec already exists"},
        409: {"description": "A job with this id exists with a different spec", **_problem},
        403: {
            "description": "The job asks for something this node refuses (a user not allowed)",
            **_problem,
        },
        422: {"description": "The spec is invalid; the detail names the field", **_problem},
        429: {
            "description": "The owner keeps its share of job documents (owner_max_jobs, or "
            "its identity's max_jobs), ended ones included until deleted or expired (past "
            "its share in bytes, owner_max_job_bytes, the answer is 413)",
            **_problem,
        },
        503: {"description": "The daemon is shutting down", **_problem},
        507: {
            "description": "This node's disk refuses writes (full): the job was not accepted",
            **_problem,
        },
    },
)
async def submit_job(spec: JobSpec, request: Request, response: Response) -> Job:
    """Submit a job. A client-chosen ``id`` makes the call idempotent."""
    job, created = await jobs_of(request).submit(spec, principal_of(request))
    response.status_code = 201 if created else 200
    response.headers["Location"] = f"/jobs/{job.id}"
    return job


@router.get("/jobs", response_model=JobList, dependencies=[Depends(require_lister)])
async def list_jobs(
    request: Request,
    state: Annotated[list[JobState] | None, Query(description="Only jobs in these states")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0)] = 0,
) -> Response:
    """Jobs, newest first, a page at a time (another owner's without its env and args)."""
    jobs = jobs_of(request)
    page = await jobs.list_jobs(state, limit, offset)
    who = principal_of(request)
    shown = page.model_copy(update={"jobs": [jobs.as_seen_by(j, who) for j in page.jobs]})
    return json_of(JobList, shown)


@router.get("/jobs/{job_id}", response_model=Job, responses=NOT_FOUND)
async def get_job(job_id: str, request: Request) -> Response:
    """One job: state, restarts, times, and the root cause of a failure.

    Its spec's env and args, and the root cause, are its owner's (and an admin's).
    """
    who = principal_of(request)
    jobs = jobs_of(request)
    return json_of(Job, jobs.as_seen_by(await jobs.authorized(job_id, who, Action.READ), who))


@router.post(
    "/jobs/{job_id}/cancel",
    response_model=Job,
    responses={**NOT_FOUND, 409: {"description": "The job already ended", **_problem}},
)
async def cancel_job(job_id: str, body: Empty, request: Request) -> Job:
    """Stop the job's workers and end it as CANCELLED. The body is ``{}``."""
    jobs = jobs_of(request)
    seen = await jobs.authorized(job_id, principal_of(request), Action.CANCEL)
    return await jobs.cancel(job_id, seen)


@router.delete(
    "/jobs/{job_id}",
    status_code=204,
    response_class=Response,
    responses={**NOT_FOUND, 409: {"description": "The job has not ended", **_problem}},
)
async def delete_job(job_id: str, request: Request) -> Response:
    """Forget a finished job (its record, events and groups; log files stay on disk)."""
    jobs = jobs_of(request)
    seen = await jobs.authorized(job_id, principal_of(request), Action.DELETE)
    await jobs.delete(job_id, seen)
    return Response(status_code=204)


@router.get("/jobs/{job_id}/workers", response_model=WorkersView, responses=READ_BY_ID)
async def get_workers(job_id: str, request: Request) -> Response:
    """The worker groups of every node in the job's current round, and their workers."""
    jobs = jobs_of(request)
    seen = await jobs.authorized(job_id, principal_of(request), Action.READ_DETAIL)
    return json_of(WorkersView, await jobs.workers(job_id, seen))


@router.get("/jobs/{job_id}/goodput", response_model=Goodput, responses=READ_BY_ID)
async def get_goodput(job_id: str, request: Request) -> Goodput:
    """Where the job's wall time went: productive time, badput by kind, steps and
    checkpoints, failures (docs/goodput.md)."""
    jobs = jobs_of(request)
    seen = await jobs.authorized(job_id, principal_of(request), Action.READ_DETAIL)
    return await jobs.goodput(job_id, seen)


@router.get(
    "/jobs/{job_id}/events",
    response_model=list[Event],
    responses={
        **READ_BY_ID,
        **TOO_MANY_STREAMS,
        200: {
            "description": "The events (JSON), or with `Accept: text/event-stream` a live "
            "stream of them: `id:` is the seq, `event:` the kind, `data:` the event; "
            "`Last-Event-ID` resumes; the last message is `event: end`.",
            "content": {"text/event-stream": {}},
        },
    },
)
async def get_events(
    job_id: str,
    request: Request,
    after: Annotated[int, Query(ge=0, description="Only events with seq greater than this")] = 0,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
    wait: Annotated[
        float, Query(ge=0, le=60, description="Long-poll: wait up to this many seconds")
    ] = 0,
    last_event_id: Annotated[
        str | None, Header(description="SSE reconnect: resume after this seq")
    ] = None,
) -> Response:
    """The job's events in order; as Server-Sent Events with ``Accept: text/event-stream``."""
    jobs = jobs_of(request)
    seen = await jobs.authorized(job_id, principal_of(request), Action.READ_DETAIL)
    if "text/event-stream" in request.headers.get("accept", ""):
        start = streams.resume_point(after, last_event_id)
        return StreamingResponse(
            streams_of(request).guard(
                streams.event_stream(daemon_of(request), seen, start, streams.HEARTBEAT_S)
            ),
            media_type="text/event-stream",
            headers=STREAM_HEADERS,
        )
    if wait > 0:
        return json_of(list[Event], await jobs.follow_events(job_id, after, wait, seen))
    return json_of(list[Event], await jobs.list_events(job_id, after, limit, seen))


@router.get(
    "/jobs/{job_id}/logs",
    response_class=PlainTextResponse,
    responses={**READ_BY_ID, **TOO_MANY_STREAMS, 200: {"content": {"text/plain": {}}}},
)
async def get_logs(
    job_id: str,
    request: Request,
    local_rank: Annotated[int, Query(ge=0, le=1_000_000)] = 0,
    stream: Literal["stdout", "stderr"] = "stdout",
    attempt: Annotated[int | None, Query(ge=0, description="Default: the latest")] = None,
    tail: Annotated[int | None, Query(ge=0, le=1_000_000, description="Last N lines")] = None,
    node: Annotated[
        str | None,
        Query(
            max_length=253,
            pattern=NODE_NAME_PATTERN,
            description="The node that holds the log (default: this one)",
        ),
    ] = None,
    follow: Annotated[
        bool,
        Query(
            description="Stream the log as it grows until the job ends; without `attempt`, "
            "go on to each new attempt after a `==> attempt N <==` line"
        ),
    ] = False,
    x_elasticd_job: Annotated[
        str | None,
        Header(
            max_length=64,
            description="Set by a daemon that forwards the request: the job it authorized "
            "its caller for; another job of the id (deleted and taken again since) is a 409",
        ),
    ] = None,
) -> Response:
    """One worker's log text (the last 8 MiB at most), or followed live.

    With ``node`` naming another daemon, the request is proxied to it.
    """
    jobs = jobs_of(request)
    job = await jobs.authorized(
        job_id, principal_of(request), Action.READ_DETAIL, tag=x_elasticd_job
    )
    if node is not None and node != jobs.node:
        return await proxy.forward(
            request,
            await jobs.node_url(node),
            token=daemon_of(request).cluster_token,
            drop=("node",),
            add={JOB_HEADER: incarnation_tag(job)},
        )
    if follow:
        if local_rank >= job.spec.nproc_per_node:
            raise LogNotFound(
                f"job {job_id!r} has local ranks 0-{job.spec.nproc_per_node - 1}, not {local_rank}"
            )
        if attempt is not None or job.state.is_terminal:
            await jobs.check_log(job, local_rank, stream, attempt)  # 404: it never will be
        return StreamingResponse(
            streams_of(request).guard(
                streams.follow_log(daemon_of(request), job, local_rank, stream, attempt, tail)
            ),
            media_type="text/plain; charset=utf-8",
            headers=STREAM_HEADERS,
        )
    return PlainTextResponse(await jobs.read_log(job, local_rank, stream, attempt, tail))
