"""Fair shares: no caller can exhaust what every other caller needs (issue 35; docs/hardening.md,
"Fair shares"). Each test performs the attack on a real root ``elasticd serve`` as a real Unix
user, or with a job's own token, and asserts that the admin is still served.

The limits are configured low (a 1 MiB list bound, a few jobs per owner) so the attacks stay
small in data and time; the defaults keep the same proportions.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from tests.hardening.support import serve
from tests.hardening.test_identities import SYSTEM_PY, as_user, request
from tests.users import User, Users

pytestmark = pytest.mark.slow
AS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="plays other users: needs root")

#: A local user submits ``count`` job specs on the socket, each with ``values`` env values of
#: 64 KiB and a node_selector no node has (they wait for ever); prints each answer.
FLOOD = r"""
import http.client, json, socket, sys
target, prefix, count, values = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
class Unix(http.client.HTTPConnection):
    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.connect(target)
for i in range(count):
    spec = {"id": f"{prefix}{i}", "entrypoint": "/bin/true", "cwd": "/",
            "node_selector": {"zone": "nowhere"},
            "env": {f"V{k}": "x" * 65536 for k in range(values)}}
    conn = Unix("localhost", timeout=30)
    conn.request("POST", "/jobs", body=json.dumps(spec),
                 headers={"Content-Type": "application/json"})
    answer = conn.getresponse()
    print(json.dumps({"status": answer.status, "body": answer.read().decode()[:2000]}),
          flush=True)
    conn.close()
"""


def flood(user: User, sock: Path, prefix: str, count: int, values: int) -> list[dict[str, Any]]:
    proc = as_user(user, SYSTEM_PY, "-I", "-c", FLOOD, str(sock), prefix, str(count), str(values))
    out, _ = proc.communicate(timeout=120)
    return [json.loads(line) for line in out.decode().splitlines() if line.startswith("{")]


async def _until(check: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while not (found := await check()):
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)
    return found


@AS_ROOT
async def test_job_documents_of_local_users_cannot_stop_placement_or_the_job_list(
    open_tmp: Path, users: Users
) -> None:
    """alice and bob each submit job specs of ~200 KB that never place, on the socket: each
    gets 429 naming owner_max_jobs past 4; together they still pass the store's 1 MiB list
    bound, yet the admin's job is placed and succeeds, and GET /jobs answers everyone."""
    alice, bob = users.user(), users.user()
    sock = open_tmp / "run" / "elasticd.sock"
    daemon = serve(
        open_tmp,
        "--unix-socket",
        str(sock),
        env={
            "ELASTICD_ALLOW_ROOT": "true",
            "ELASTICD_OWNER_MAX_JOBS": "4",
            "ELASTICD_STORE_MAX_LIST_BYTES": str(1 << 20),
        },
    )
    try:
        async with asyncio.timeout(120), daemon.client() as admin:
            await daemon.wait_ready()
            for user in (alice, bob):
                answers = await asyncio.to_thread(flood, user, sock, user.name, 6, 3)
                statuses = [a["status"] for a in answers]
                assert statuses == [201] * 4 + [429] * 2, answers
                detail = json.loads(answers[-1]["body"])["detail"]
                assert "owner_max_jobs" in detail and "its share is 4" in detail, detail
            # 8 documents of ~200 KB: a listing of job/ is over the 1 MiB bound.
            r = await admin.get("/store/list", params={"prefix": "job/"})
            assert r.status_code == 413, r.text
            made = await admin.post("/jobs", json={"id": "admins", "entrypoint": "/bin/true"})
            assert made.status_code == 201, made.text

            async def ended() -> dict[str, Any] | None:
                job: dict[str, Any] = (await admin.get("/jobs/admins")).json()
                return job if job["state"] in ("SUCCEEDED", "FAILED") else None

            job = await _until(ended, 60, "the admin's job to be placed and end")
            assert job["state"] == "SUCCEEDED", job
            listed = await admin.get("/jobs", params={"limit": 100})
            assert listed.status_code == 200, listed.text
            assert listed.json()["total"] == 9
            hers = await asyncio.to_thread(request, alice, str(sock), "GET", "/jobs?limit=100")
            assert hers["status"] == 200 and hers["json"]["total"] == 9, hers["status"]
    finally:
        daemon.stop()
