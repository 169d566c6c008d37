"""One owner for the store's key layout: every key of a job lies under ``keys_of_job``,
and deleting a finished job leaves none of them behind (issue 13, point 1).

The end-to-end case runs a real daemon and a worker that writes into both
subtrees the workers own (the torch store and in-process restart's), as a
training job does, then deletes the job and lists the whole store.
"""

from __future__ import annotations

import asyncio

import pytest

from elasticd import keys
from elasticd.inprocess.keys import Layout
from elasticd.keys import event_key
from elasticd.rendezvous.layout import absorber_key, presence_prefix, state_key
from elasticd.worker.names import default_namespace
from tests.hardening.support import PY, make_token_file, script, serve

pytestmark = pytest.mark.timeout(120)


def under_job(key: str, job_id: str) -> bool:
    return key == keys.job_key(job_id) or any(
        key.startswith(prefix) for prefix in keys.keys_of_job(job_id)
    )


def test_every_key_a_module_builds_for_a_job_is_deleted_with_it():
    job = "train-1.a_b"
    env = {"ELASTICD_JOB_ID": job, "ELASTICD_ATTEMPT": "3.0"}
    layout = Layout.of(job, "3.0")
    built = [
        keys.job_key(job),
        event_key(job, "node-a", 7),
        keys.group_key(job, "node-a"),
        keys.barrier_prefix(job, 2) + "node-a",
        state_key(job),
        presence_prefix(job) + "node-a",
        absorber_key(job),
        default_namespace(env) + "MASTER",
        layout.terminated(0),
        layout.arrived(0, 1, "done", 3),
        layout.torch_namespace(0) + "k",
    ]
    assert [k for k in built if not under_job(k, job)] == []
    # No job's keys lie under another's prefixes (ids cannot contain "/").
    for other in ("train-1", "train-1.a", "train-1.a_b2", "t"):
        assert not [k for k in built if under_job(k, other)], other
    # Nothing a job owns lies where every daemon lists job documents.
    assert not [k for k in built[1:] if k.startswith(keys.JOBS)]


WORKER = """
from elasticd.inprocess.keys import Layout
from elasticd.worker.store import ClusterStoreClient
ClusterStoreClient.from_env().set("MASTER_ADDR", b"127.0.0.1")
ClusterStoreClient.from_env(namespace=Layout.from_env().root).set("probe", b"1")
"""


async def test_deleting_a_finished_job_leaves_no_key_of_it(tmp_path):
    token_file, _ = make_token_file(tmp_path)
    daemon = serve(tmp_path, token_file=token_file)
    worker = script(tmp_path, "worker.py", WORKER)
    try:
        await daemon.wait_ready()
        async with daemon.client() as c:
            r = await c.post(
                "/jobs",
                json={"id": "layout", "entrypoint": PY, "args": [worker], "nproc_per_node": 2},
            )
            assert r.status_code == 201, r.text
            async with asyncio.timeout(60):
                while (job := (await c.get("/jobs/layout")).json())["state"] not in (
                    "SUCCEEDED",
                    "FAILED",
                ):
                    await asyncio.sleep(0.1)
            assert job["state"] == "SUCCEEDED", (job, daemon.output()[-3000:])
            before = [e["key"] for e in (await c.get("/store/list")).json()["entries"]]
            mine = [k for k in before if "layout" in k]
            # The job really wrote into every subtree: the check below is not vacuous.
            for prefix in ("job/", "ev/", "group/", "rdzv/", "barrier/", "jobs/layout/torch/"):
                assert any(k.startswith(prefix) for k in mine), (prefix, mine)
            assert any("/inprocess/" in k for k in mine), mine
            assert all(under_job(k, "layout") for k in mine), mine
            assert (await c.delete("/jobs/layout")).status_code == 204
            after = [e["key"] for e in (await c.get("/store/list")).json()["entries"]]
            assert [k for k in after if "layout" in k] == []
    finally:
        daemon.stop()
