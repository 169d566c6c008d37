"""Only an admin drains or undrains a node; a drained node is shown so and never placed
(issue 37)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from elasticd.identity import hash_token, new_token
from tests.conftest import PY, asgi_client, make_daemon, wait_job

pytestmark = pytest.mark.timeout(90)


async def test_drain_and_undrain_by_an_admin_refused_to_others(tmp_path: Path) -> None:
    """A token identity gets 403; the admin's drain shows in /nodes and keeps jobs off the
    node (queued), its undrain lets them run; the record says why, since when, by whom."""
    token = new_token()
    identities = tmp_path / "identities.toml"
    identities.write_text(f'[[identity]]\nname = "ci"\ntoken_sha256 = "{hash_token(token)}"\n')
    daemon = make_daemon(tmp_path, identities_file=str(identities))
    async with asyncio.timeout(30):
        await daemon.start()
    try:
        async with (
            asgi_client(daemon) as admin,
            asgi_client(daemon, headers={"Authorization": f"Bearer {token}"}) as other,
        ):
            for verb in ("drain", "undrain"):
                r = await other.post(f"/nodes/node-a/{verb}", json={"reason": "mine"})
                assert r.status_code == 403, r.text
            r = await admin.post("/nodes/node-a/drain", json={"reason": "bad DIMM"})
            assert r.status_code == 200, r.text
            assert (r.json()["state"], r.json()["reason"], r.json()["by"]) == (
                "drained",
                "bad DIMM",
                "admin",
            )
            (node,) = (await admin.get("/nodes")).json()
            assert (node["state"], node["reason"]) == ("drained", "bad DIMM")
            assert node["since"] is not None
            r = await admin.post("/jobs", json={"id": "j", "entrypoint": PY, "args": ["-c", ""]})
            assert r.status_code == 201
            # Nothing placed on a drained node: the job waits in the queue.
            async with asyncio.timeout(10):
                while (job := (await admin.get("/jobs/j")).json())["queue"] is None:
                    await asyncio.sleep(0.05)
            assert (job["state"], job["nodes"]) == ("PENDING", None), job
            r = await other.post("/nodes/node-a/undrain", json={"reason": "x"})
            assert r.status_code == 403
            r = await admin.post("/nodes/node-a/undrain", json={"reason": "DIMM replaced"})
            assert r.status_code == 200 and r.json()["state"] == "ready"
            assert (await admin.get("/nodes")).json()[0]["state"] == "ready"
            job = await wait_job(admin, "j", timeout=30)
            assert job["state"] == "SUCCEEDED", job
    finally:
        async with asyncio.timeout(60):
            await daemon.shutdown()


async def test_an_automatic_quarantine_ends_at_its_ttl_and_the_node_takes_jobs_again(
    tmp_path: Path,
) -> None:
    """The node's health check fails once: quarantined for ``quarantine_ttl`` (2 s), the job
    waits, uncharged. At the TTL's end the node's own daemon releases it (``node.released``,
    ``/nodes`` ready again) and the job runs there, its check passing now."""
    marker = tmp_path / "failed-once"
    check = tmp_path / "check.py"
    check.write_text(
        "import pathlib, sys\n"
        f"marker = pathlib.Path({str(marker)!r})\n"
        "if not marker.exists():\n"
        "    marker.touch()\n"
        "    print('ECC errors on GPU 0'); sys.exit(1)\n"
    )
    daemon = make_daemon(tmp_path, health_check=[PY, str(check)], quarantine_ttl=2.0)
    async with asyncio.timeout(30):
        await daemon.start()
    try:
        async with asgi_client(daemon) as admin:
            r = await admin.post(
                "/jobs", json={"id": "j", "entrypoint": PY, "args": ["-c", ""], "max_restarts": 0}
            )
            assert r.status_code == 201, r.text
            async with asyncio.timeout(20):
                while (node := (await admin.get("/nodes")).json()[0])["state"] != "quarantined":
                    await asyncio.sleep(0.05)
            assert "ECC errors on GPU 0" in node["reason"] and node["until"] is not None, node
            job = await wait_job(admin, "j", timeout=30)
            assert (job["state"], job["restart_count"]) == ("SUCCEEDED", 0), job
            (node,) = (await admin.get("/nodes")).json()
            assert node["state"] == "ready", node
            kinds = [e["kind"] for e in (await admin.get("/jobs/j/events")).json()]
            assert kinds.index("node.quarantined") < kinds.index("node.released"), kinds
    finally:
        async with asyncio.timeout(60):
            await daemon.shutdown()
