"""A torchrun run's document on a daemon: listed like a job, never run, resumed or cancelled."""

from __future__ import annotations

import asyncio
import time

import httpx

from elasticd.keys import job_key
from elasticd.node.daemon import Daemon
from elasticd.states import JobState
from elasticd.torchrun_backend import RunStep, backend_config, run_edit, run_spec


async def test_a_torchrun_run_is_listed_but_never_run_resumed_or_cancelled(
    daemon: Daemon, client: httpx.AsyncClient
) -> None:
    """The daemon shows the document torchruns write (GET /jobs) but starts no agent for it,
    leaves it alone when it recovers, and refuses to cancel it (409: stop the torchruns)."""
    async with asyncio.timeout(20):
        config = backend_config(
            endpoint="127.0.0.1:7070",
            run_id="tr1",
            min_nodes=1,
            max_nodes=2,
            local_addr=None,
            conf={},
            environ={},
        )
        spec = run_spec(config, ["torchrun", "--nnodes=1:2", "train.py"])
        job = run_edit(None, RunStep(JobState.PENDING), run_id="tr1", spec=spec, node="t", now=1.0)
        assert job is not None
        job = run_edit(
            job, RunStep(JobState.RUNNING, 0), run_id="tr1", spec=spec, node="t", now=2.0
        )
        assert job is not None
        await daemon.store.compare_and_set(job_key("tr1"), job.model_dump_json().encode(), None)

        deadline = time.monotonic() + 10
        while (r := await client.get("/jobs")).json()["total"] == 0:
            assert time.monotonic() < deadline, "the daemon never saw the run"
            await asyncio.sleep(0.02)
        listed = r.json()["jobs"][0]
        assert (listed["id"], listed["launcher"], listed["state"]) == ("tr1", "torchrun", "RUNNING")

        daemon.jobs.on_jobs([job])  # what the watch calls; explicit, so nothing races the check
        assert "tr1" not in daemon.jobs.supervisor.agents
        await daemon.jobs.recover()
        assert (await client.get("/jobs/tr1")).json()["state"] == "RUNNING"

        refused = await client.post("/jobs/tr1/cancel", json={})
        assert refused.status_code == 409
        assert "torchrun" in refused.json()["detail"]
        assert (await client.get("/jobs/tr1/workers")).json()["groups"] == []

        # Its torchruns are all gone (stopped by a signal: no shutdown ran): DELETE removes it.
        # While one of them is alive (its presence key), the run is not deleted.
        lease = await daemon.store.grant(30)
        from elasticd.rendezvous import presence_prefix

        presence = presence_prefix("tr1") + "t"
        await daemon.store.put(presence, b"{}", lease=lease)
        busy = await client.delete("/jobs/tr1")
        assert busy.status_code == 409
        await daemon.store.revoke(lease)
        gone = await client.delete("/jobs/tr1")
        assert gone.status_code == 204, gone.text
        assert (await client.get("/jobs/tr1")).status_code == 404


def test_a_torchrun_on_the_daemons_host_advertises_the_host_name_not_loopback() -> None:
    """Found in review: every node advertised 127.0.0.1 when pointed at its local daemon."""
    import socket

    from elasticd.torchrun_backend import address_towards

    assert address_towards("http://127.0.0.1:7070") == socket.getfqdn()
    assert address_towards("http://[::1]:7070") == socket.getfqdn()
