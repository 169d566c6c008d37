"""Decided on one read, acted on another: real daemons raced by real callers over HTTP.

Each test races two callers on one job (a cancel and a delete, a delete and a
resubmission of the same id) and checks that every answer says what was done, and
that nothing is done to a job nobody asked about.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from elasticd.identity import hash_token, new_token
from elasticd.keys import goodput_prefix, keys_of_job, worker_prefix
from elasticd.models import Job
from elasticd.node.jobs import incarnation_tag
from elasticd.store.base import MAX_BATCH_KEYS
from tests.e2e.cluster import LocalCluster
from tests.hardening.support import Served, serve

pytestmark = [pytest.mark.slow]

#: A job no single node can hold: it stays PENDING, with no agent, until cancelled.
WAITS = {"entrypoint": "/bin/true", "min_nodes": 2}
#: A job this node runs at once, to its end.
RUNS = {"entrypoint": "/bin/true"}
#: Keys a deleted job leaves: enough that deleting them takes a while.
OLD_KEYS = 3000
#: Races run by the long-poll test.
TRIALS = 10


@pytest.fixture
async def daemon(tmp_path: Path) -> AsyncIterator[Served]:
    served = serve(tmp_path)
    try:
        await served.wait_ready(60)
        yield served
    finally:
        served.stop()
    assert "Exception in ASGI application" not in served.output(), served.output()[-5000:]


@contextlib.asynccontextmanager
async def admin_and_alice(
    tmp_path: Path,
) -> AsyncIterator[tuple[httpx.AsyncClient, httpx.AsyncClient]]:
    """A daemon with an identity "alice" (who may run jobs as nobody): clients of its admin
    and of alice. At the end the daemon stops, and it must have logged no ASGI exception."""
    token = new_token()
    identities = tmp_path / "identities.toml"
    identities.write_text(
        f'[[identity]]\nname = "alice"\ntoken_sha256 = "{hash_token(token)}"\nusers = ["nobody"]\n'
    )
    served = serve(tmp_path, env={"ELASTICD_IDENTITIES_FILE": str(identities)})
    try:
        await served.wait_ready(60)
        async with (
            served.client() as admin,
            served.client(headers={"Authorization": f"Bearer {token}"}) as alice,
        ):
            yield admin, alice
    finally:
        served.stop()
    assert "Exception in ASGI application" not in served.output(), served.output()[-5000:]


async def _keys_of(c: httpx.AsyncClient, job_id: str) -> list[str]:
    """Every key of the job's in the store (its document aside), read through ``/store``."""
    keys = []
    for prefix in keys_of_job(job_id):
        answer = await c.get("/store/list", params={"prefix": prefix})
        assert answer.status_code == 200, answer.text
        keys += [entry["key"] for entry in answer.json()["entries"]]
    return keys


async def _ended(c: httpx.AsyncClient, job_id: str, deadline: float) -> dict[str, Any]:
    """The job once it is terminal (long-polls its events in between)."""
    while True:
        job: dict[str, Any] = (await c.get(f"/jobs/{job_id}")).json()
        if job["state"] in ("SUCCEEDED", "FAILED", "CANCELLED"):
            return job
        assert time.monotonic() < deadline, job
        await c.get(f"/jobs/{job_id}/events", params={"wait": 1, "after": 0})


async def _delete_when_ended(c: httpx.AsyncClient, job_id: str, deadline: float) -> int:
    """DELETE the job again and again until it goes (204) or is gone (404)."""
    while True:
        answer = await c.delete(f"/jobs/{job_id}")
        if answer.status_code in (204, 404):
            return answer.status_code
        assert answer.status_code == 409, answer.text
        assert time.monotonic() < deadline, f"{job_id} was never deleted: {answer.text}"


@pytest.mark.timeout(240)
async def test_a_cancel_racing_a_delete_answers_what_it_did(daemon: Served) -> None:
    """A delete spun from the moment a cancel is sent lands between the cancel's write and
    its answer: the cancel still answers 200 CANCELLED (its write stands), never a 404
    for a job it cancelled; and its close of the rendezvous leaves no key of the deleted
    job behind (a job submitted again under the id would find its rendezvous closed)."""
    async with daemon.client() as c:
        answers = []
        for i in range(60):
            job_id = f"race-{i}"
            assert (await c.post("/jobs", json={"id": job_id, **WAITS})).status_code == 201
            deadline = time.monotonic() + 60
            cancel, deleted = await asyncio.gather(
                c.post(f"/jobs/{job_id}/cancel", json={}), _delete_when_ended(c, job_id, deadline)
            )
            answers.append((job_id, cancel.status_code, cancel.text, deleted))
        # The id is free again: a job submitted under it runs (its rendezvous is its own).
        assert (await c.post("/jobs", json={"id": "race-0", **RUNS})).status_code == 201
        assert (await _ended(c, "race-0", time.monotonic() + 90))["state"] == "SUCCEEDED"
        left = {job_id: await _keys_of(c, job_id) for job_id, *_ in answers[1:]}
        assert not any(left.values()), {k: v for k, v in left.items() if v}
        wrong = [a for a in answers if a[1] != 200]
        assert not wrong, f"{len(wrong)} of {len(answers)} cancels: {wrong[:3]}"
        for job_id, _, text, deleted in answers:
            assert deleted == 204, (job_id, deleted)
            assert '"state":"CANCELLED"' in text.replace(" ", ""), text


@pytest.mark.timeout(240)
async def test_a_delete_racing_a_resubmission_of_its_id_leaves_the_new_jobs_keys(
    daemon: Served,
) -> None:
    """A job is deleted while a caller submits a new job under its id the moment the old
    document is gone, and a worker of the new job writes its key: the delete sweeps every
    key of the old job (thousands, so the sweep takes a while) and none of the new job's."""
    async with daemon.client() as c:
        assert (await c.post("/jobs", json={"id": "again", **RUNS})).status_code == 201
        assert (await _ended(c, "again", time.monotonic() + 90))["state"] == "SUCCEEDED"
        old = [f"{goodput_prefix('again')}old-{i:05d}" for i in range(OLD_KEYS)]
        for start in range(0, OLD_KEYS, MAX_BATCH_KEYS):
            items = [{"key": k, "value": ""} for k in old[start : start + MAX_BATCH_KEYS]]
            assert (await c.post("/store/batch", json={"items": items})).status_code == 200
        marker = f"{worker_prefix('again')}new-worker"

        async def resubmit() -> None:
            deadline = time.monotonic() + 60
            while (await c.get("/jobs/again")).status_code != 404:
                assert time.monotonic() < deadline, "the old job was never deleted"
            assert (await c.post("/jobs", json={"id": "again", **WAITS})).status_code == 201
            answer = await c.put("/store/kv", json={"key": marker, "value": "bmV3"})
            assert answer.status_code == 200, answer.text

        deleted, _ = await asyncio.gather(c.delete("/jobs/again"), resubmit())
        assert deleted.status_code == 204, deleted.text
        left = await _keys_of(c, "again")
        assert marker in left, "the old job's delete deleted a key of the new job"
        assert not set(old) & set(left), "the old job's keys were not all deleted"
        job = (await c.get("/jobs/again")).json()
        assert (job["state"], job["spec"]["min_nodes"]) == ("PENDING", 2), job


@pytest.mark.timeout(240)
async def test_a_long_poll_never_answers_with_a_new_owners_job_of_the_id(tmp_path: Path) -> None:
    """Alice long-polls the events of her ended job; meanwhile the admin deletes it and
    submits a job of their own under its id (its arguments are secret to others). Alice
    is answered her own job's events or told it is gone (404, 409, or 403 once the id is
    the admin's), never the admin's job's events."""
    async with admin_and_alice(tmp_path) as (admin, alice):
        answers = []
        for i in range(TRIALS):
            job_id = f"leak-{i}"
            assert (await alice.post("/jobs", json={"id": job_id, **WAITS})).status_code == 201
            assert (await alice.post(f"/jobs/{job_id}/cancel", json={})).status_code == 200
            last = (await alice.get(f"/jobs/{job_id}/events")).json()[-1]["seq"]
            poll = asyncio.ensure_future(
                alice.get(f"/jobs/{job_id}/events", params={"after": last, "wait": 30})
            )
            for _ in range(3):  # the daemon reads alice's request before these
                assert (await admin.get("/healthz")).status_code == 200
            assert (await admin.delete(f"/jobs/{job_id}")).status_code == 204
            secret = {"id": job_id, **WAITS, "args": [f"s3cret-{i}"]}
            assert (await admin.post("/jobs", json=secret)).status_code == 201
            answers.append(await poll)
        leaks = [a.text for a in answers if "s3cret" in a.text]
        assert not leaks, f"{len(leaks)} of {TRIALS} long-polls: {leaks[:2]}"
        for answer in answers:
            assert answer.status_code in (403, 404, 409), answer.text


@pytest.mark.timeout(240)
async def test_a_job_deleted_the_moment_it_ends_leaves_nothing_for_the_next_job_of_its_id(
    daemon: Served,
) -> None:
    """Each job is deleted as soon as it has SUCCEEDED, while its agent is still closing its
    rendezvous: once every agent has ended (all slots free again), no key of any of them
    is left, and a job submitted again under one of their ids runs (the closed rendezvous
    of the deleted one would hold it PENDING for ever)."""
    async with daemon.client() as c:
        ids = [f"end-{i}" for i in range(8)]
        for job_id in ids:
            spec = {"id": job_id, **RUNS, "nproc_per_node": 2}
            assert (await c.post("/jobs", json=spec)).status_code == 201
            assert await _delete_when_ended(c, job_id, time.monotonic() + 60) == 204
        deadline = time.monotonic() + 60
        while (node := (await c.get("/nodes")).json()[0])["free_slots"] != node["slots"]:
            assert time.monotonic() < deadline, f"agents still hold slots: {node}"
            await asyncio.sleep(0.05)
        left = {job_id: await _keys_of(c, job_id) for job_id in ids}
        assert not any(left.values()), {k: v for k, v in left.items() if v}
        assert (await c.post("/jobs", json={"id": ids[-1], **RUNS})).status_code == 201
        assert (await _ended(c, ids[-1], time.monotonic() + 90))["state"] == "SUCCEEDED"


@pytest.mark.timeout(240)
async def test_a_forwarded_log_read_answers_only_about_the_job_authorized(tmp_path: Path) -> None:
    """A log read on n0 for n1's log is forwarded to n1 naming the job n0 authorized; when
    it reaches n1 after the job was deleted and its id taken by a new job, n1 answers 409,
    never the new job's log (the forward carries the cluster's credential, for which n1
    would otherwise serve any job)."""
    both = {"min_nodes": 2, "entrypoint": "/bin/echo"}
    with LocalCluster(tmp_path) as cluster:
        await cluster.start_all("n0", "n1")
        async with cluster.client("n0") as n0, cluster.client("n1") as n1:
            spec = {"id": "told", **both, "args": ["the old job"]}
            assert (await n0.post("/jobs", json=spec)).status_code == 201
            old = await _ended(n0, "told", time.monotonic() + 90)
            assert old["state"] == "SUCCEEDED", old
            proxied = await n0.get("/jobs/told/logs", params={"node": "n1"})
            assert (proxied.status_code, proxied.text) == (200, "the old job\n")
            # What n0 sends n1 for this job, sent once the id names a new job on n1.
            tag = {"x-elasticd-job": incarnation_tag(Job.model_validate(old))}
            assert (await n1.get("/jobs/told/logs", headers=tag)).status_code == 200
            assert (await n0.delete("/jobs/told")).status_code == 204
            spec = {"id": "told", **both, "args": ["the new job"]}
            assert (await n0.post("/jobs", json=spec)).status_code == 201
            new = await _ended(n0, "told", time.monotonic() + 90)
            assert new["state"] == "SUCCEEDED", new
            late = await n1.get("/jobs/told/logs", headers=tag)
            assert late.status_code == 409, late.text
            assert "replaced by a new job" in late.json()["detail"]
            proxied = await n0.get("/jobs/told/logs", params={"node": "n1"})
            assert (proxied.status_code, proxied.text) == (200, "the new job\n")


#: Checkpoints on SIGTERM (step 99) and runs on: its group's stop takes the whole grace.
STUBBORN = (
    "import signal, time\n"
    "from elasticd.worker import checkpointed, ping\n"
    "signal.signal(signal.SIGTERM, lambda *_: checkpointed(99, '/srv/admin/ckpt-99'))\n"
    "while True:\n"
    "    ping()\n"
    "    time.sleep(0.05)\n"
)


@pytest.mark.timeout(240)
async def test_a_new_jobs_workers_and_goodput_never_show_the_old_jobs_agent(
    tmp_path: Path,
) -> None:
    """The admin cancels their job, whose worker ignores SIGTERM (its agent stops it for
    the whole grace), deletes it, and alice submits a job under its id: alice's reads of
    her job's workers and goodput show nothing of the admin's job, whose agent still
    stops its workers on this node (its pids, its log folder, its attempt), nor any event
    of it (its worker's exit, its group's stop); nor does her job's document get the old
    job's progress (the checkpoint its worker reported as it was stopped: her job would
    resume from the admin's checkpoint)."""
    async with admin_and_alice(tmp_path) as (admin, alice):
        spec = {
            "id": "shared",
            "entrypoint": sys.executable,
            "args": ["-c", STUBBORN],
            "termination_grace": 8,
        }
        assert (await admin.post("/jobs", json=spec)).status_code == 201
        deadline = time.monotonic() + 60
        while True:
            view = (await admin.get("/jobs/shared/workers")).json()
            pids = [w.get("pid") for g in view["groups"] for w in g["workers"]]
            if view["state"] == "RUNNING" and any(pids):
                break
            assert time.monotonic() < deadline, view
            await asyncio.sleep(0.1)
        old = view["groups"][0]
        assert (await admin.post("/jobs/shared/cancel", json={})).status_code == 200
        assert (await admin.delete("/jobs/shared")).status_code == 204
        assert (await alice.post("/jobs", json={"id": "shared", **WAITS})).status_code == 201
        workers = await alice.get("/jobs/shared/workers")
        goodput = await alice.get("/jobs/shared/goodput")
        assert workers.status_code == 200, workers.text
        assert workers.json()["groups"] == [], (old, workers.json())
        assert goodput.status_code == 200, goodput.text
        assert goodput.json()["attempts"] == 0, goodput.json()
        # Once the old agent has ended, still nothing of it (its last publications).
        deadline = time.monotonic() + 60
        while (node := (await admin.get("/nodes")).json()[0])["free_slots"] != node["slots"]:
            assert time.monotonic() < deadline, f"the old agent still holds slots: {node}"
            await asyncio.sleep(0.1)
        workers = await alice.get("/jobs/shared/workers")
        assert workers.json()["groups"] == [], (old, workers.json())
        goodput = await alice.get("/jobs/shared/goodput")
        assert goodput.json()["attempts"] == 0, goodput.json()
        progress = (await alice.get("/jobs/shared")).json()["progress"]
        assert progress["checkpoint_step"] is None, progress
        assert progress["attempt"] is None, progress
        events = (await alice.get("/jobs/shared/events")).json()
        theirs = [(e["kind"], e["message"]) for e in events]
        assert {kind for kind, _ in theirs} <= {"job.submitted", "job.unschedulable"}, theirs
