"""A node whose round's workers all exited 0 closes the rendezvous only once the job ended.

The close tells every node the job is over; a job that goes on (a later round runs it
elsewhere, or the plan put it back in the queue) must not find its rendezvous closed:
its nodes would undo the closure as a new round (``StoreRendezvous._reopened``),
stopping the workers of the round that runs. Real job documents and a real rendezvous
over the in-memory store.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from elasticd.agent.jobdoc import JobRecord
from elasticd.clock import SYSTEM_CLOCK
from elasticd.keys import job_key
from elasticd.models import Job, JobSpec
from elasticd.node.db import Database
from elasticd.node.events import EventLog
from elasticd.node.jobs.documents import JobDocuments
from elasticd.rendezvous import Settings, StoreRendezvous
from elasticd.rendezvous.layout import decode_state, state_key
from elasticd.states import JobState
from elasticd.store.memory import MemoryStore
from tests.agent.test_checkpoints import _round


async def _closed(store: MemoryStore) -> bool:
    entry = await store.get(state_key("j"))
    return entry is not None and decode_state(entry.value, entry.version).closed


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    ("state", "job_round", "ends", "closed"),
    [
        (JobState.RUNNING, 1, JobState.SUCCEEDED, True),  # its round: it ended here
        (JobState.RESTARTING, 1, JobState.SUCCEEDED, True),
        (JobState.FAILED, 1, JobState.FAILED, True),  # ended before: closed, as it was
        (JobState.RUNNING, 2, JobState.RUNNING, False),  # a later round runs it elsewhere
        (JobState.PENDING, 1, JobState.PENDING, False),  # back in the queue meanwhile
    ],
    ids=["running", "restarting", "ended", "a later round", "queued"],
)
async def test_the_round_that_succeeded_closes_the_rendezvous_only_of_a_job_that_ended(
    tmp_path: Path, state: JobState, job_round: int, ends: JobState, closed: bool
) -> None:
    async with MemoryStore() as store, Database(tmp_path / "elasticd.sqlite3") as db:
        documents = JobDocuments(store, EventLog(db, "n0"), SYSTEM_CLOCK)
        job = Job(
            id="j",
            spec=JobSpec(entrypoint="x"),
            state=state,
            round=job_round,
            max_restarts=3,
            created_at=1.0,
        )
        await store.put(job_key("j"), job.model_dump_json().encode())
        lease = await store.grant(30.0)

        async def current_lease() -> int:
            return lease

        rendezvous = StoreRendezvous(
            store,
            "j",
            node="n0",
            role="default",
            local_world_size=1,
            advertise_addr="127.0.0.1",
            settings=Settings(min_nodes=1, max_nodes=2),
            lease=current_lease,
        )
        record = JobRecord("j", "n0", store, documents.update, rendezvous, lambda *a, **k: None)
        await record.succeeded(_round(1))
        assert (await documents.read("j")).state is ends
        assert await _closed(store) is closed
