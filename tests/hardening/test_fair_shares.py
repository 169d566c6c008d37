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


#: A worker that PUTs ``count`` values of 700 KB under its own job's prefix with its token.
FILL_STORE = r"""
import base64, json, os, urllib.error, urllib.request
token = open(os.environ["ELASTICD_TOKEN_FILE"]).read().strip()
url, job = os.environ["ELASTICD_URL"], os.environ["ELASTICD_JOB_ID"]
value = base64.b64encode(os.urandom(700_000)).decode()
answers = []
for i in range(8):
    req = urllib.request.Request(url + "/store/kv", method="PUT",
        data=json.dumps({"key": f"jobs/{job}/v{i}", "value": value}).encode(),
        headers={"Authorization": "Bearer " + token, "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as answer:
            answers.append([answer.status, ""])
    except urllib.error.HTTPError as exc:
        answers.append([exc.code, json.loads(exc.read()).get("detail", "")])
print(json.dumps(answers), flush=True)
"""


def _store_bytes(state: Path) -> int:
    return sum(p.stat().st_size for p in state.glob("store.sqlite3*"))


@AS_ROOT
async def test_a_jobs_token_cannot_fill_the_store_hosts_disk(open_tmp: Path) -> None:
    """A job running as nobody PUTs 700 KB values under jobs/<id>/ with its token: past its
    2 MiB share (job_store_max_bytes) each write is 413 naming the setting; the store file
    stays within the share, and the admin's next job is accepted and runs."""
    (open_tmp / "fill.py").write_text(FILL_STORE)
    daemon = serve(
        open_tmp,
        "--run-as",
        "nobody",
        env={"ELASTICD_ALLOW_ROOT": "false", "ELASTICD_JOB_STORE_MAX_BYTES": str(2 << 20)},
    )
    try:
        async with asyncio.timeout(120), daemon.client() as admin:
            await daemon.wait_ready()
            before = _store_bytes(daemon.state_dir)
            spec = {"entrypoint": SYSTEM_PY, "args": ["-I", str(open_tmp / "fill.py")], "cwd": "/"}
            r = await admin.post("/jobs", json={"id": "filler", **spec})
            assert r.status_code == 201, r.text

            async def ended(job_id: str) -> dict[str, Any] | None:
                job: dict[str, Any] = (await admin.get(f"/jobs/{job_id}")).json()
                return job if job["state"] in ("SUCCEEDED", "FAILED") else None

            job = await _until(lambda: ended("filler"), 60, "the filler to end")
            assert job["state"] == "SUCCEEDED", job
            out = (await admin.get("/jobs/filler/logs", params={"attempt": 0})).text
            answers = json.loads(out.strip().splitlines()[-1])
            assert [a[0] for a in answers] == [200] * 2 + [413] * 6, answers
            assert "job_store_max_bytes" in answers[2][1], answers[2]
            grown = _store_bytes(daemon.state_dir) - before
            assert grown < 2 * (2 << 20), grown  # the share, and the journal's copy of it
            r = await admin.post("/jobs", json={"id": "after", "entrypoint": "/bin/true"})
            assert r.status_code == 201, r.text
            assert (await _until(lambda: ended("after"), 60, "the next job"))["state"] == (
                "SUCCEEDED"
            )
    finally:
        daemon.stop()


#: A local user opens ``count`` connections on the socket, each a 60 s wait for events of her
#: own job past any it has; after a second, prints how many are held and what the rest got.
HOLD = r"""
import json, select, socket, sys, time
target, job, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
held = []
for _ in range(count):
    s = socket.socket(socket.AF_UNIX)
    s.connect(target)
    s.sendall(f"GET /jobs/{job}/events?after=1000000&wait=60 HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    held.append(s)
time.sleep(1.0)
ready, _, _ = select.select(held, [], [], 0)
def first_line(s):
    try:
        return s.recv(200).split(b"\r\n", 1)[0].decode() or "closed"
    except OSError as exc:
        return type(exc).__name__
answers = [first_line(s) for s in ready]
print(json.dumps({"held": count - len(ready), "answers": sorted(set(answers))}), flush=True)
time.sleep(120)
"""


@AS_ROOT
async def test_one_local_user_s_long_polls_cannot_hold_every_connection(
    open_tmp: Path, users: Users
) -> None:
    """alice opens 80 event waits of 60 s on a daemon with 64 connections: she holds at most
    the share the admins' reserve leaves (the rest get 429 naming the setting), and the
    admin's /healthz and /jobs answer over TCP and over the socket."""
    alice = users.user()
    sock = open_tmp / "run" / "elasticd.sock"
    daemon = serve(open_tmp, "--unix-socket", str(sock), env={"ELASTICD_MAX_CONNECTIONS": "64"})
    holder = None
    try:
        async with asyncio.timeout(120), daemon.client() as admin:
            await daemon.wait_ready()
            (made,) = await asyncio.to_thread(flood, alice, sock, "hers", 1, 0)
            assert made["status"] == 201, made
            holder = as_user(alice, SYSTEM_PY, "-I", "-c", HOLD, str(sock), "hers0", "80")
            assert holder.stdout is not None
            line = await asyncio.to_thread(holder.stdout.readline)
            assert line.startswith(b"{"), line + holder.stdout.read(3000)
            seen = json.loads(line)
            assert 40 <= seen["held"] <= 48, seen  # she holds waits: the attack is real
            assert any("429" in a for a in seen["answers"]), seen
            for _ in range(3):
                assert (await admin.get("/healthz")).status_code == 200
                assert (await admin.get("/jobs")).status_code == 200
            mine = await asyncio.to_thread(_root_on_socket, sock)
            assert mine == [200, 200], mine
    finally:
        if holder is not None:
            holder.kill()
            holder.communicate()
        daemon.stop()


def _root_on_socket(sock: Path) -> list[int]:
    """root's /healthz and /jobs over the socket (root is the node's admin there)."""
    import http.client
    import socket as socketlib

    class Unix(http.client.HTTPConnection):
        def connect(self) -> None:
            self.sock = socketlib.socket(socketlib.AF_UNIX)
            self.sock.connect(str(sock))

    statuses = []
    for path in ("/healthz", "/jobs"):
        conn = Unix("localhost", timeout=10)
        conn.request("GET", path)
        statuses.append(conn.getresponse().status)
        conn.close()
    return statuses
