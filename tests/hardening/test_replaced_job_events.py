"""An event of a deleted job that reaches the store after its id was taken again is never
shown as the new job's: real daemons, a real store outage that only one node sees.

Node ``n1`` reaches the store on ``n0`` through a proxy the test cuts. While it is cut,
n1 fences and stops its workers of the admin's job, and its events of that job wait in
its queue; meanwhile the admin cancels and deletes the job on ``n0`` and alice submits a
job of her own under its id. When the link is back, n1 publishes what it queued, under
the id. Alice's events, her long-poll and her goodput show nothing of the admin's job.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from elasticd.identity import hash_token, new_token
from elasticd.keys import event_prefix, goodput_key, goodput_prefix, group_key, group_prefix
from elasticd.models import Job
from elasticd.node.jobs import incarnation_tag
from tests.e2e.cluster import LocalCluster
from tests.e2e.test_store_hiccups import CuttableProxy

pytestmark = [pytest.mark.slow]

LEASE_TTL = 3.0
JOB = "reused"
#: The admin's job: a worker on each node that sleeps until it is stopped.
OLD = {
    "id": JOB,
    "entrypoint": sys.executable,
    "args": ["-c", "import time; time.sleep(600)", "s3cret-old"],
    "min_nodes": 2,
    "max_nodes": 2,
    "termination_grace": 1,
}
#: Alice's job of the same id: no two-node cluster can place it, so it stays PENDING and
#: none of its events are n1's.
NEW = {"id": JOB, "entrypoint": "/bin/true", "min_nodes": 3}


async def _until(what: str, deadline: float, check: Any) -> Any:
    """Poll ``check()`` until it returns something true, failing at ``deadline``."""
    while True:
        if found := await check():
            return found
        assert time.monotonic() < deadline, f"{what}: not within the deadline"
        await asyncio.sleep(0.1)


async def _stored(admin: httpx.AsyncClient, prefix: str) -> list[tuple[str, bytes]]:
    """The store's entries under ``prefix`` (key, value), read through ``/store``."""
    answer = await admin.get("/store/list", params={"prefix": prefix})
    assert answer.status_code == 200, answer.text
    return [(e["key"], base64.b64decode(e["value"])) for e in answer.json()["entries"]]


def _gone(pids: list[int]) -> bool:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 0)
            return False
    return True


@pytest.mark.timeout(240)
async def test_a_cut_off_nodes_late_events_of_a_deleted_job_are_not_the_new_jobs(
    tmp_path: Path,
) -> None:
    """n1's events of the admin's job, published after alice's job took the id, are in the
    store under the id, yet alice's event list, her long-poll and her goodput (a ``job.placed``
    of the admin's job published again late, too) show none of them."""
    token = new_token()
    identities = tmp_path / "identities.toml"
    identities.write_text(
        f'[[identity]]\nname = "alice"\ntoken_sha256 = "{hash_token(token)}"\nusers = ["nobody"]\n'
    )
    env = {"ELASTICD_IDENTITIES_FILE": str(identities)}
    with LocalCluster(tmp_path, lease_ttl=LEASE_TTL) as cluster:
        cluster.start("n0", env=env)
        await cluster.wait_ready("n0", timeout=60)
        proxy = CuttableProxy(cluster.nodes["n0"].port)
        await proxy.start()
        try:
            cluster.store_url = f"http://127.0.0.1:{proxy.port}"
            cluster.start("n1", env=env)
            await cluster.wait_ready("n1", timeout=60)
            alice_headers = {"Authorization": f"Bearer {token}"}
            async with (
                cluster.client("n0") as admin,
                httpx.AsyncClient(
                    base_url=cluster.nodes["n0"].url, headers=alice_headers, timeout=70
                ) as alice,
            ):
                await _race(admin, alice, proxy)
        finally:
            await proxy.close()


async def _race(admin: httpx.AsyncClient, alice: httpx.AsyncClient, proxy: CuttableProxy) -> None:
    assert (await admin.post("/jobs", json=OLD)).status_code == 201

    async def n1_pids() -> list[int]:
        groups = (await admin.get(f"/jobs/{JOB}/workers")).json()["groups"]
        return [
            w["pid"]
            for g in groups
            if g["node"] == "n1" and g["state"] == "HEALTHY"
            for w in g["workers"]
            if w["pid"]
        ]

    pids = await _until("n1 runs its worker", time.monotonic() + 90, n1_pids)
    placed = [
        (key, value)
        for key, value in await _stored(admin, event_prefix(JOB))
        if b'"job.placed"' in value
    ]
    assert placed, "the admin's job has no job.placed event"

    async def n1_records() -> list[tuple[str, bytes]]:
        keys = {group_key(JOB, "n1"), goodput_key(JOB, "n1")}
        found = [
            (key, value)
            for prefix in (group_prefix(JOB), goodput_prefix(JOB))
            for key, value in await _stored(admin, prefix)
            if key in keys and b'"attempts":[]' not in value
        ]
        return found if len(found) == 2 else []

    # n1's group view and goodput record of the admin's job, as its agent publishes them.
    n1_old = await _until("n1 published its group and goodput", time.monotonic() + 60, n1_records)

    # n1 loses the store: it fences, stops its worker, and queues its events of the job.
    proxy.cut = True
    proxy.sever()

    async def fenced() -> bool:
        return _gone(pids)

    await _until("n1 fenced its worker", time.monotonic() + 60, fenced)
    assert (await admin.post(f"/jobs/{JOB}/cancel", json={})).status_code == 200
    deadline = time.monotonic() + 60
    while (deleted := await admin.delete(f"/jobs/{JOB}")).status_code == 409:
        assert time.monotonic() < deadline, deleted.text
        await asyncio.sleep(0.1)
    assert deleted.status_code == 204, deleted.text
    created = await alice.post("/jobs", json=NEW)
    assert created.status_code == 201, created.text
    tag = incarnation_tag(Job.model_validate(created.json()))

    async def told_unschedulable() -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = (await alice.get(f"/jobs/{JOB}/events")).json()
        return events if any(e["kind"] == "job.unschedulable" for e in events) else []

    mine = await _until("alice's job is unschedulable", time.monotonic() + 60, told_unschedulable)
    poll = asyncio.ensure_future(
        alice.get(f"/jobs/{JOB}/events", params={"after": mine[-1]["seq"], "wait": 15})
    )
    # The old job's placement, published again late (as a node that restarts publishes
    # what it had not marked published): same key, created after alice's document.
    for key, value in placed:
        answer = await admin.put(
            "/store/kv", json={"key": key, "value": base64.b64encode(value).decode()}
        )
        assert answer.status_code == 200, answer.text
    # Read while n1 is still cut off: its goodput record of the old job cannot come back.
    goodput = (await alice.get(f"/jobs/{JOB}/goodput")).json()
    # n1's old agent publishing its group view and goodput record of the admin's job again
    # (it does, once the link is back, until it sees the delete): same keys and bytes.
    for key, value in n1_old:
        answer = await admin.put(
            "/store/kv", json={"key": key, "value": base64.b64encode(value).decode()}
        )
        assert answer.status_code == 200, answer.text
    groups = (await alice.get(f"/jobs/{JOB}/workers")).json()["groups"]
    assert groups == [], f"alice was shown the admin's job's groups: {groups}"
    goodput_late = (await alice.get(f"/jobs/{JOB}/goodput")).json()
    assert goodput_late["attempts"] == 0, goodput_late

    # The link is back: n1 publishes its events of the admin's job, under the id.
    proxy.cut = False

    async def published() -> list[tuple[str, bytes]]:
        return await _stored(admin, f"{event_prefix(JOB)}n1/")

    late = await _until("n1 published its queued events", time.monotonic() + 90, published)
    late_kinds = sorted({v.split(b'"kind":"')[1].split(b'"')[0].decode() for _, v in late})
    events = (await alice.get(f"/jobs/{JOB}/events")).json()
    long_poll = await poll

    leaked = [e for e in events if e["node"] == "n1" or e["kind"] == "job.placed"]
    assert not leaked, f"n1 published {late_kinds}; alice was shown {leaked}"
    assert [e["job_tag"] for e in events] == [tag] * len(events), events
    assert long_poll.status_code == 200, long_poll.text
    shown = [e for e in long_poll.json() if e["node"] == "n1" or e["kind"] == "job.placed"]
    assert not shown, f"alice's long-poll answered the admin's job's events: {shown}"
    # Never placed: all of its time is queued (the old job's placement would make it startup).
    assert goodput["badput_s"]["startup"] == 0, goodput
    assert goodput["attempts"] == 0, goodput
