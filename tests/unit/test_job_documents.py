"""A user's action on a job is decided on the document it writes over (``node/jobs/documents``).

A cancel or a delete reads the job, checks it, and then writes: the job may end, or be
deleted and submitted again under its id, in between. The decision runs inside the
compare-and-set, so each of these is a clear conflict (409), never an illegal
transition (500) or an action on a job nobody authorized.
"""

from __future__ import annotations

import pytest

from elasticd.clock import SYSTEM_CLOCK
from elasticd.errors import JobConflict
from elasticd.keys import job_key
from elasticd.models import Job, JobEdit, JobSpec
from elasticd.node.db import Database
from elasticd.node.events import EventLog
from elasticd.node.jobs.documents import JobDocuments, apply_edit, cancelled
from elasticd.states import JobState
from elasticd.store.memory import MemoryStore


def _job(state: JobState, created_at: float = 1.0) -> Job:
    spec = JobSpec(entrypoint="x")
    return Job(id="j", spec=spec, state=state, max_restarts=3, created_at=created_at)


@pytest.mark.parametrize("state", [JobState.PENDING, JobState.RUNNING, JobState.RESTARTING])
def test_a_live_job_is_cancelled(state: JobState) -> None:
    assert cancelled()(_job(state)) == {"state": JobState.CANCELLED, "reason": "cancelled by user"}


@pytest.mark.parametrize("state", [JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED])
def test_a_job_that_ended_is_a_conflict_naming_its_end(state: JobState) -> None:
    with pytest.raises(JobConflict, match=f"already ended as {state.value}"):
        cancelled()(_job(state))


def test_a_job_that_replaced_the_one_authorized_is_a_conflict() -> None:
    seen = _job(JobState.RUNNING, created_at=1.0)
    with pytest.raises(JobConflict, match="replaced by a new job"):
        cancelled(seen)(_job(JobState.RUNNING, created_at=2.0))
    assert cancelled(seen)(_job(JobState.RUNNING, created_at=1.0))["state"] is JobState.CANCELLED


@pytest.mark.parametrize(
    ("state", "reason", "changes", "after"),
    [
        # running again after a restart: the failure's "restarting the group" is over
        (JobState.RESTARTING, "rank 1 failed: boom; restarting the group", {}, None),
        # out of the queue: its "waiting in the queue" is over too
        (JobState.PENDING, "waiting in the queue: needs 2 nodes", {}, None),
        # a move that says why keeps what it says
        (JobState.RESTARTING, "x; restarting the group", {"reason": "resumed"}, "resumed"),
        # no move (already RUNNING): the reason is left as it is
        (JobState.RUNNING, "kept", {}, "kept"),
    ],
)
def test_a_move_to_running_clears_a_reason_that_no_longer_applies(
    state: JobState, reason: str, changes: JobEdit, after: str | None
) -> None:
    """The reason a job carries into RUNNING (a restart's, the queue's) is cleared as it
    runs, so the API never serves a RUNNING job "restarting the group"."""
    job = _job(state).model_copy(update={"reason": reason, "started_at": 1.0})
    new = apply_edit(job, {"state": JobState.RUNNING, **changes}, now=5.0)
    assert (new.state, new.reason, new.started_at) == (JobState.RUNNING, after, 1.0)


def test_the_first_move_to_running_stamps_its_start_and_the_end_its_finish() -> None:
    """``started_at`` is the first RUNNING's time, ``finished_at`` the terminal state's."""
    running = apply_edit(_job(JobState.PENDING), {"state": JobState.RUNNING}, now=5.0)
    assert running.started_at == 5.0 and running.finished_at is None
    failed = apply_edit(running, {"state": JobState.FAILED, "reason": "boom"}, now=9.0)
    assert (failed.started_at, failed.finished_at, failed.reason) == (5.0, 9.0, "boom")


@pytest.mark.timeout(10)
async def test_a_cancel_racing_the_jobs_own_end_is_a_conflict_and_writes_nothing(tmp_path) -> None:
    """The API read RUNNING; the agent wrote FAILED before the cancel's compare-and-set."""
    async with MemoryStore() as store, Database(tmp_path / "elasticd.sqlite3") as db:
        documents = JobDocuments(store, EventLog(db, "n0"), SYSTEM_CLOCK)
        seen = _job(JobState.RUNNING)
        await store.put(job_key("j"), seen.model_dump_json().encode())
        ended = seen.model_copy(update={"state": JobState.FAILED, "reason": "workers failed"})
        await store.put(job_key("j"), ended.model_dump_json().encode())
        with pytest.raises(JobConflict, match="already ended as FAILED"):
            await documents.update("j", mutate=cancelled(seen))
        after = await documents.read("j")
    assert (after.state, after.reason) == (JobState.FAILED, "workers failed")
