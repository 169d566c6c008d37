"""``/jobs``: submit, list, read, cancel; workers, events and logs of a job."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import PlainTextResponse

from api.deps import jobs_of
from api.problems import PROBLEM_JSON
from api.schemas import Event, Job, JobList, JobSpec, Problem, WorkersView
from elasticd.states import JobState

router = APIRouter(tags=["jobs"])

_problem: dict[str, Any] = {"model": Problem, "content": {PROBLEM_JSON: {}}}
NOT_FOUND: dict[int | str, dict[str, Any]] = {
    404: {"description": "No job with that id", **_problem}
}


@router.post(
    "/jobs",
    status_code=201,
    response_model=Job,
    responses={
        200: {"model": Job, "description": "A job with this id and the same spec already exists"},
        409: {"description": "A job with this id exists with a different spec", **_problem},
        422: {"description": "The spec is invalid; the detail names the field", **_problem},
        503: {"description": "The daemon is shutting down", **_problem},
    },
)
async def submit_job(spec: JobSpec, request: Request, response: Response) -> Job:
    """Submit a job. A client-chosen ``id`` makes the call idempotent."""
    job, created = jobs_of(request).submit(spec)
    response.status_code = 201 if created else 200
    response.headers["Location"] = f"/jobs/{job.id}"
    return job


@router.get("/jobs", response_model=JobList)
async def list_jobs(
    request: Request,
    state: Annotated[list[JobState] | None, Query(description="Only jobs in these states")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0)] = 0,
) -> JobList:
    """Jobs, newest first, a page at a time."""
    return jobs_of(request).list_jobs(state, limit, offset)


@router.get("/jobs/{job_id}", response_model=Job, responses=NOT_FOUND)
async def get_job(job_id: str, request: Request) -> Job:
    """One job: state, restarts, times, and the root cause of a failure."""
    return jobs_of(request).get(job_id)


@router.post(
    "/jobs/{job_id}/cancel",
    response_model=Job,
    responses={**NOT_FOUND, 409: {"description": "The job already ended", **_problem}},
)
async def cancel_job(job_id: str, request: Request) -> Job:
    """Stop the job's workers and end it as CANCELLED."""
    return jobs_of(request).cancel(job_id)


@router.get("/jobs/{job_id}/workers", response_model=WorkersView, responses=NOT_FOUND)
async def get_workers(job_id: str, request: Request) -> WorkersView:
    """The worker groups of every node in the job's current round, and their workers."""
    return await jobs_of(request).workers(job_id)


@router.get("/jobs/{job_id}/events", response_model=list[Event], responses=NOT_FOUND)
async def get_events(
    job_id: str,
    request: Request,
    after: Annotated[int, Query(ge=0, description="Only events with seq greater than this")] = 0,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
    wait: Annotated[
        float, Query(ge=0, le=60, description="Long-poll: wait up to this many seconds")
    ] = 0,
) -> list[Event]:
    """The job's events in order."""
    jobs = jobs_of(request)
    if wait > 0:
        return await jobs.follow_events(job_id, after, wait)
    return jobs.list_events(job_id, after, limit)


@router.get(
    "/jobs/{job_id}/logs",
    response_class=PlainTextResponse,
    responses={**NOT_FOUND, 200: {"content": {"text/plain": {}}}},
)
async def get_logs(
    job_id: str,
    request: Request,
    local_rank: Annotated[int, Query(ge=0, le=1_000_000)] = 0,
    stream: Literal["stdout", "stderr"] = "stdout",
    attempt: Annotated[int | None, Query(ge=0, description="Default: the latest")] = None,
    tail: Annotated[int | None, Query(ge=0, le=1_000_000, description="Last N lines")] = None,
) -> PlainTextResponse:
    """One worker's log text (the last 8 MiB at most)."""
    jobs = jobs_of(request)
    path = jobs.log_file(job_id, local_rank, stream, attempt)
    return PlainTextResponse(jobs.read_log(path, tail))
