"""Who is asking decides who runs: attacks on a real daemon by local users, token holders,
a job's own workers and unauthenticated clients (issue 22; docs/hardening.md, "Who is asking").

Each test plays the attacker with a real process of a real Unix user (made for the test,
tests/users.py) or a real socket, against a real ``elasticd serve``, and asserts the safe
outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from elasticd.identity import hash_token, new_token
from tests.hardening.support import (
    PY,
    eventually,
    free_port,
    healthy_pids,
    proc_uid,
    serve,
)
from tests.users import User, Users

pytestmark = pytest.mark.slow
AS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="plays other users: needs root")
ROOT = Path(__file__).resolve().parents[2]
#: A stdlib interpreter other users can run (the test's own may live in root's home).
SYSTEM_PY = shutil.which("python3", path="/usr/bin:/bin") or "python3"

#: One HTTP request with the standard library, over a unix socket or TCP, printed as JSON.
REQUEST = r"""
import http.client, json, socket, sys
target, method, path, body, token = sys.argv[1:6]
class Unix(http.client.HTTPConnection):
    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.connect(target)
try:
    conn = Unix("localhost", timeout=30) if target.startswith("/") else (
        http.client.HTTPConnection(target, timeout=30))
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = "Bearer " + token
    conn.request(method, path, body=body or None, headers=headers)
    answer = conn.getresponse()
    print(json.dumps({"status": answer.status, "body": answer.read().decode()}))
except OSError as exc:
    print(json.dumps({"status": None, "error": f"{type(exc).__name__}: {exc.strerror}"}))
"""


def as_user(user: User, *argv: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start ``argv`` as ``user`` (its uid, gid and groups only), as a login would."""
    return subprocess.Popen(
        ["setpriv", f"--reuid={user.uid}", f"--regid={user.gid}", "--init-groups", *argv],
        env={"PATH": "/usr/bin:/bin", "HOME": user.home, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def request(
    user: User, target: str, method: str, path: str, body: Any = None, token: str = ""
) -> dict[str, Any]:
    """One request made by a process of ``user`` (a unix socket path, or host:port)."""
    text = "" if body is None else json.dumps(body)
    proc = as_user(user, SYSTEM_PY, "-I", "-c", REQUEST, target, method, path, text, token)
    out, _ = proc.communicate(timeout=60)
    answer: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    if answer.get("status") is not None:
        with contextlib.suppress(ValueError):
            answer["json"] = json.loads(answer["body"])
    return answer


SLEEP_JOB = {"entrypoint": "/bin/sh", "args": ["-c", "id -u; exec sleep 600"], "cwd": "/"}


@AS_ROOT
async def test_local_users_on_the_socket_run_jobs_as_themselves_and_only_their_own(
    open_tmp: Path, users: Users
) -> None:
    """alice, on a root daemon's socket, runs jobs as alice and only as alice, at her priority
    cap; bob, who shares her group, sees her job's state and owner but not its args, and may
    not cancel it or read its logs, events or workers; alice may."""
    group = users.group()
    alice, bob = users.user(group=group), users.user(group=group)
    sock = open_tmp / "run" / "elasticd.sock"
    daemon = serve(open_tmp, "--unix-socket", str(sock), env={"ELASTICD_ALLOW_ROOT": "false"})
    try:
        async with asyncio.timeout(90), daemon.client() as admin:
            await daemon.wait_ready()
            target = str(sock)
            for asks, why in [
                ({"user": "root"}, "root"),
                ({"user": bob.name}, bob.name),
                ({"priority": 5}, "priority"),
            ]:
                refused = request(alice, target, "POST", "/jobs", {**SLEEP_JOB, **asks})
                assert refused["status"] == 403, refused
                assert why in refused["json"]["detail"]
            made = request(alice, target, "POST", "/jobs", {"id": "hers", **SLEEP_JOB})
            assert made["status"] == 201, made
            assert made["json"]["owner"]["name"] == alice.name
            assert made["json"]["spec"]["user"] == alice.name
            try:
                (pid,) = await healthy_pids(admin, "hers", 1)
            except AssertionError:
                raise AssertionError((await admin.get("/jobs/hers")).text) from None
            assert proc_uid(pid) == alice.uid
            # bob: the list and the state, never the args; nothing else of it.
            listed = request(bob, target, "GET", "/jobs")
            assert listed["status"] == 200
            (seen,) = [j for j in listed["json"]["jobs"] if j["id"] == "hers"]
            assert seen["owner"]["name"] == alice.name and seen["state"] == "RUNNING"
            assert "sleep" not in json.dumps(seen["spec"]["args"])
            for method, path in [
                ("POST", "/jobs/hers/cancel"),
                ("DELETE", "/jobs/hers"),
                ("GET", "/jobs/hers/logs"),
                ("GET", "/jobs/hers/events"),
                ("GET", "/jobs/hers/workers"),
                ("GET", "/jobs/hers/goodput"),
                ("GET", "/store/list?prefix="),
            ]:
                answer = request(bob, target, method, path, {} if method == "POST" else None)
                assert answer["status"] == 403, (method, path, answer)
            assert (await admin.get("/jobs/hers")).json()["state"] == "RUNNING"
            # alice reads her own logs (the daemon reads them for her) and cancels.
            logs = request(alice, target, "GET", "/jobs/hers/logs")
            assert logs["status"] == 200 and logs["body"].strip() == str(alice.uid)
            done = request(alice, target, "POST", "/jobs/hers/cancel", {})
            assert done["status"] == 200 and done["json"]["state"] == "CANCELLED"
    finally:
        daemon.stop()


@AS_ROOT
async def test_a_token_identity_runs_only_as_its_users_up_to_its_priority(
    open_tmp: Path, users: Users
) -> None:
    """An identity's token (not an admin) runs jobs as its own user by default, is refused any
    other user, a priority above its cap and someone else's job; the admin may cancel its job."""
    carol = users.user()
    token = new_token()
    identities = open_tmp / "identities.toml"
    identities.write_text(
        f'[[identity]]\nname = "carol-ci"\ntoken_sha256 = "{hash_token(token)}"\n'
        f'users = ["{carol.name}"]\nmax_priority = 5\n'
    )
    daemon = serve(
        open_tmp,
        "--run-as",
        "nobody",
        "--allowed-users",
        "nobody,daemon",
        env={"ELASTICD_ALLOW_ROOT": "false", "ELASTICD_IDENTITIES_FILE": str(identities)},
    )
    try:
        async with (
            asyncio.timeout(90),
            daemon.client() as admin,
            daemon.client(headers={"Authorization": f"Bearer {token}"}) as c,
        ):
            await daemon.wait_ready()
            theirs = await admin.post("/jobs", json={"id": "admins", **SLEEP_JOB})
            assert theirs.status_code == 201
            for asks in ({"user": "daemon"}, {"user": "nobody"}, {"priority": 6}):
                r = await c.post("/jobs", json={**SLEEP_JOB, **asks})
                assert r.status_code == 403, (asks, r.text)
            r = await c.post("/jobs", json={"id": "ci", **SLEEP_JOB, "priority": 5})
            assert r.status_code == 201, r.text
            assert r.json()["owner"] == {
                "name": "carol-ci",
                "local": False,
                "admin": False,
                "unix_user": carol.name,
                "may_preempt": False,
                "slot_quota": None,
            }
            (pid,) = await healthy_pids(admin, "ci", 1)
            assert proc_uid(pid) == carol.uid
            assert (await c.post("/jobs/admins/cancel", json={})).status_code == 403
            assert (await c.get("/jobs/admins/logs")).status_code == 403
            assert (await c.get("/store/kv", params={"key": "job/admins"})).status_code == 403
            assert (await admin.post("/jobs/ci/cancel", json={})).status_code == 200
            assert (await admin.post("/jobs/admins/cancel", json={})).status_code == 200
    finally:
        daemon.stop()


def _site_packages() -> Path | None:
    return next(Path(sys.prefix, "lib").glob("python3*/site-packages"), None)


def _python_for(user: User) -> list[str] | None:
    """A command line that runs this checkout's elasticd as ``user``; None if it cannot."""
    site = _site_packages()
    if site is None:
        return None
    env = {"PYTHONPATH": f"{ROOT}:{site}"}
    probe = as_user(user, SYSTEM_PY, "-c", "import elasticd.cli, api.app", env=env)
    probe.communicate(timeout=60)
    if probe.returncode != 0:
        return None
    return [SYSTEM_PY, "-m", "elasticd"]


@AS_ROOT
async def test_a_users_own_daemon_serves_that_user_only(open_tmp: Path, users: Users) -> None:
    """A non-root `elasticd serve` with no token (the README's first example): it makes its own
    0600 token, so mallory gets 401 on TCP and cannot read the token; on its unix socket
    mallory gets 403; alice, its owner, is served on the socket (no token) and her job runs
    as alice."""
    alice, mallory = users.user(), users.user()
    command = _python_for(alice)
    if command is None:
        pytest.skip("this checkout's packages are not readable by other users")
    state = open_tmp / "alice-state"
    sock = open_tmp / "alice-run" / "elasticd.sock"
    for folder in (state, sock.parent):
        folder.mkdir()
        os.chown(folder, alice.uid, alice.gid)
    port = free_port()
    site = _site_packages()
    assert site is not None
    log = open_tmp / "alice-daemon.log"
    daemon = as_user(
        alice,
        *command,
        "serve",
        "--port",
        str(port),
        "--state-dir",
        str(state),
        "--unix-socket",
        str(sock),
        "--node-name",
        "alice-node",
        env={"PYTHONPATH": f"{ROOT}:{site}"},
    )
    try:
        deadline = time.monotonic() + 60
        while not sock.exists():
            assert daemon.poll() is None, "alice's daemon exited"
            assert time.monotonic() < deadline, "alice's daemon did not start"
            await asyncio.sleep(0.1)
        token_file = state / "token"
        st = token_file.stat()
        assert (st.st_uid, st.st_mode & 0o777) == (alice.uid, 0o600)
        tcp = f"127.0.0.1:{port}"
        anonymous = request(mallory, tcp, "POST", "/jobs", SLEEP_JOB)
        assert anonymous["status"] == 401, anonymous
        stolen = as_user(mallory, "cat", str(token_file))
        leaked, _ = stolen.communicate(timeout=30)
        assert stolen.returncode != 0 and b"Permission denied" in leaked
        on_socket = request(mallory, str(sock), "POST", "/jobs", SLEEP_JOB)
        assert on_socket["status"] in (403, None), on_socket  # refused, or cannot even connect
        if on_socket["status"] == 403:
            assert "serves that user only" in on_socket["json"]["detail"]
        mine = request(alice, str(sock), "POST", "/jobs", {"id": "mine", **SLEEP_JOB})
        assert mine["status"] == 201, mine
        workers: dict[str, Any] = {}

        def running() -> bool:
            workers.update(request(alice, str(sock), "GET", "/jobs/mine/workers")["json"])
            return any(w.get("pid") for g in workers["groups"] for w in g["workers"])

        await eventually(running, 30, "alice's job to start")
        pid = next(w["pid"] for g in workers["groups"] for w in g["workers"] if w.get("pid"))
        assert proc_uid(pid) == alice.uid
        assert request(alice, str(sock), "POST", "/jobs/mine/cancel", {})["status"] == 200
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(daemon.pid, signal.SIGTERM)
        try:
            daemon.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(daemon.pid, signal.SIGKILL)
            daemon.wait()
        if daemon.stdout is not None:
            log.write_bytes(daemon.stdout.read())
            daemon.stdout.close()


@AS_ROOT
def test_a_root_daemon_refuses_a_store_anyone_can_write(open_tmp: Path) -> None:
    """A tokenless store server on loopback: any local user could write job/<id> with
    `user: daemon` into it. A root daemon with run_as refuses to start on it (exit 2, saying
    why and what to do), instead of running what is written there."""
    port = free_port()
    store_state = open_tmp / "store"
    store = subprocess.Popen(
        [PY, "-m", "api.store_server", "--port", str(port), "--state-dir", str(store_state)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            assert time.monotonic() < deadline and store.poll() is None, "no store server"
            time.sleep(0.05)
        daemon = serve(
            open_tmp,
            "--run-as",
            "nobody",
            "--store-url",
            f"http://127.0.0.1:{port}",
            env={"ELASTICD_ALLOW_ROOT": "false"},
        )
        assert daemon.proc.wait(60) == 2, daemon.output()
        assert "answers without a token" in daemon.output()
        assert "allow_insecure_store" in daemon.output()
    finally:
        store.terminate()
        store.wait(30)


@AS_ROOT
def test_a_root_daemon_refuses_an_etcd_without_credentials_on_loopback(open_tmp: Path) -> None:
    """etcd's default is no auth: a root daemon refuses it on loopback too (exit 2), before it
    connects, unless allow_insecure_store says every local user is trusted."""
    daemon = serve(
        open_tmp,
        "--run-as",
        "nobody",
        "--store-url",
        f"etcd://127.0.0.1:{free_port()}",
        env={"ELASTICD_ALLOW_ROOT": "false"},
    )
    assert daemon.proc.wait(60) == 2, daemon.output()
    assert "store is not authenticated" in daemon.output()


async def test_unfinished_bodies_without_a_token_hold_nothing(tmp_path: Path) -> None:
    """1,000 connections send `POST /jobs` with a complete head, no token and a body that never
    ends: each is answered 401 from the head and closed, and /healthz and the token's own
    requests are answered meanwhile."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 4096:
        pytest.skip(f"needs 4096 descriptors (hard limit {hard})")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 4096), hard))
    daemon = serve(tmp_path)
    held: list[socket.socket] = []
    try:
        async with asyncio.timeout(90), daemon.client() as c:
            await daemon.wait_ready()
            head = (
                f"POST /jobs HTTP/1.1\r\nHost: 127.0.0.1:{daemon.port}\r\n"
                "Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{"
            ).encode()
            for _ in range(1000):
                s = socket.create_connection(("127.0.0.1", daemon.port), timeout=10)
                s.sendall(head)
                held.append(s)
            # Each is answered from its head and closed (the old daemon waited for the body).
            for s in held:
                s.settimeout(15)
                answer = b""
                while chunk := s.recv(65536):
                    answer += chunk
                assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
            assert (await c.get("/healthz")).status_code == 200
            assert (await c.get("/jobs")).status_code == 200
    finally:
        for s in held:
            s.close()
        daemon.stop()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


#: A worker that tries its job's token on the daemon: its own keys, and everything else.
TOKEN_PROBE = r"""
import json, os, urllib.request, urllib.error, base64
token = open(os.environ["ELASTICD_TOKEN_FILE"]).read().strip()
url, job = os.environ["ELASTICD_URL"], os.environ["ELASTICD_JOB_ID"]
def call(method, path, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method=method, headers={
        "Authorization": "Bearer " + token, "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as answer:
            return answer.status
    except urllib.error.HTTPError as exc:
        return exc.code
value = base64.b64encode(b'{"user": "root"}').decode()
print(json.dumps({
    "own_key": call("PUT", "/store/kv", {"key": f"jobs/{job}/mine", "value": value}),
    "job_doc": call("PUT", "/store/kv", {"key": "job/evil", "value": value}),
    "escape": call("PUT", "/store/kv", {"key": f"jobs/{job}/../../job/evil", "value": value}),
    "other_job": call("GET", "/store/kv?key=jobs/other/x"),
    "list_all": call("GET", "/store/list?prefix="),
    "lease": call("POST", "/store/leases", {"ttl": 5}),
    "own_job": call("GET", f"/jobs/{job}"),
    "jobs": call("GET", "/jobs"),
    "submit": call("POST", "/jobs", {"entrypoint": "/bin/true"}),
    "cancel_other": call("POST", "/jobs/other/cancel", {}),
}), flush=True)
"""


@AS_ROOT
async def test_a_jobs_token_reaches_only_its_own_keys(open_tmp: Path) -> None:
    """A worker (as nobody) holds its job's token, in a file only it can read; with it, it
    writes its own job's keys and reads its own job, and nothing else: no job document, no
    path escape, no other job, no lease, no listing, no submission, no cancel."""
    (open_tmp / "probe.py").write_text(TOKEN_PROBE)
    daemon = serve(open_tmp, "--run-as", "nobody", env={"ELASTICD_ALLOW_ROOT": "false"})
    try:
        async with asyncio.timeout(90), daemon.client() as c:
            await daemon.wait_ready()
            other = await c.post("/jobs", json={"id": "other", **SLEEP_JOB})
            assert other.status_code == 201
            r = await c.post(
                "/jobs",
                json={
                    "id": "probe",
                    "entrypoint": SYSTEM_PY,
                    "args": ["-I", str(open_tmp / "probe.py")],
                    "cwd": "/",
                },
            )
            assert r.status_code == 201
            deadline = time.monotonic() + 60
            while (await c.get("/jobs/probe")).json()["state"] not in ("SUCCEEDED", "FAILED"):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.1)
            out = (await c.get("/jobs/probe/logs", params={"attempt": 0})).text
            seen = json.loads(out.strip().splitlines()[-1])
            assert seen == {
                "own_key": 200,
                "job_doc": 403,
                "escape": 403,
                "other_job": 403,
                "list_all": 403,
                "lease": 403,
                "own_job": 200,
                "jobs": 403,
                "submit": 403,
                "cancel_other": 403,
            }, seen
            assert (await c.get("/store/kv", params={"key": "job/evil"})).json()["entry"] is None
            tokens = daemon.state_dir / "tokens"
            gone = tokens / "probe.token"  # revoked when its agent ends (just after the job)
            await eventually(lambda: not gone.exists(), 30, "the job's token to be removed")
            live = tokens / "other.token"
            st = live.stat()
            assert st.st_uid == 65534 and st.st_mode & 0o777 == 0o400
            assert (await c.post("/jobs/other/cancel", json={})).status_code == 200
    finally:
        daemon.stop()


@AS_ROOT
async def test_an_identitys_quota_and_preemption_right_hold_on_the_fleet(
    open_tmp: Path, users: Users
) -> None:
    """An identity with slot_quota 2 and no right to preempt: its third slot waits with the
    reason `quota`; its priority-5 job never stops the admin's priority-0 job that fills the
    node; once its own jobs end, the quota frees."""
    dave = users.user()
    token = new_token()
    identities = open_tmp / "identities.toml"
    identities.write_text(
        f'[[identity]]\nname = "dave"\ntoken_sha256 = "{hash_token(token)}"\n'
        f'users = ["{dave.name}"]\nmax_priority = 5\nslot_quota = 2\n'
    )
    daemon = serve(open_tmp, env={"ELASTICD_IDENTITIES_FILE": str(identities)})
    try:
        async with (
            asyncio.timeout(120),
            daemon.client() as admin,
            daemon.client(headers={"Authorization": f"Bearer {token}"}) as c,
        ):
            await daemon.wait_ready()

            async def state(job: str) -> dict[str, Any]:
                return dict((await admin.get(f"/jobs/{job}")).json())

            async def until(job: str, check: Any, what: str) -> dict[str, Any]:
                deadline = time.monotonic() + 60
                while not check(found := await state(job)):
                    assert time.monotonic() < deadline, (what, found)
                    await asyncio.sleep(0.05)
                return found

            two = {**SLEEP_JOB, "nproc_per_node": 2}
            assert (await c.post("/jobs", json={"id": "d1", **two})).status_code == 201
            await until("d1", lambda j: j["state"] == "RUNNING", "d1 running")
            assert (await c.post("/jobs", json={"id": "d2", **SLEEP_JOB})).status_code == 201
            waiting = await until("d2", lambda j: j.get("queue"), "d2 queued")
            assert waiting["queue"]["reason"] == "quota", waiting["queue"]
            assert "2 of its 2 slots" in waiting["queue"]["message"]
            assert (await c.post("/jobs/d1/cancel", json={})).status_code == 200
            await until("d2", lambda j: j["state"] == "RUNNING", "d2 runs once d1 ended")
            assert (await c.post("/jobs/d2/cancel", json={})).status_code == 200
            # The admin's job fills the node's 8 slots; dave's priority 5 may not preempt it.
            full = {**SLEEP_JOB, "nproc_per_node": 8}
            assert (await admin.post("/jobs", json={"id": "big", **full})).status_code == 201
            await until("big", lambda j: j["state"] == "RUNNING", "big running")
            r = await c.post("/jobs", json={"id": "urgent", **SLEEP_JOB, "priority": 5})
            assert r.status_code == 201
            queued = await until("urgent", lambda j: j.get("queue"), "urgent queued")
            assert queued["queue"]["reason"] == "capacity"
            assert (await state("big"))["state"] == "RUNNING"
            events = (await admin.get("/jobs/big/events")).json()
            assert "job.preempted" not in [e["kind"] for e in events]
            for job in ("urgent", "big"):
                assert (await admin.post(f"/jobs/{job}/cancel", json={})).status_code == 200
    finally:
        daemon.stop()


async def _until_state(admin: Any, job: str, states: tuple[str, ...], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while (await admin.get(f"/jobs/{job}")).json().get("state") not in states:
        assert time.monotonic() < deadline, (await admin.get(f"/jobs/{job}")).text
        await asyncio.sleep(0.1)


@AS_ROOT
async def test_a_reused_job_id_never_reads_the_previous_owners_logs(
    open_tmp: Path, users: Users
) -> None:
    """alice's job `reused` prints a secret and is deleted (its logs stay on disk); bob takes
    the id. Neither while his job waits in the queue nor once it ran here does bob read alice's
    output through /jobs/reused/logs (any attempt, followed or not): those files were another
    job's. His own run starts at attempt 0 with only his own output."""
    alice, bob = users.user(), users.user()
    sock = open_tmp / "run" / "elasticd.sock"
    daemon = serve(open_tmp, "--unix-socket", str(sock), env={"ELASTICD_ALLOW_ROOT": "false"})
    try:
        async with asyncio.timeout(150), daemon.client() as admin:
            await daemon.wait_ready()
            target = str(sock)
            secret = {"entrypoint": "/bin/sh", "args": ["-c", "echo alice-secret"], "cwd": "/"}
            made = request(alice, target, "POST", "/jobs", {"id": "reused", **secret})
            assert made["status"] == 201, made
            await _until_state(admin, "reused", ("SUCCEEDED", "FAILED"))
            mine = request(alice, target, "GET", "/jobs/reused/logs?attempt=0")
            assert "alice-secret" in mine["body"], mine
            assert request(alice, target, "DELETE", "/jobs/reused")["status"] == 204
            # bob takes the id; his job waits in the queue (no node has that label).
            waiting = {"id": "reused", **SLEEP_JOB, "node_selector": {"nowhere": "at-all"}}
            taken = request(bob, target, "POST", "/jobs", waiting)
            assert taken["status"] == 201, taken
            for path in ("/jobs/reused/logs", "/jobs/reused/logs?attempt=0"):
                answer = request(bob, target, "GET", path)
                assert "alice-secret" not in answer.get("body", ""), (path, answer)
                assert answer["status"] == 404, (path, answer)
            assert request(bob, target, "POST", "/jobs/reused/cancel", {})["status"] == 200
            assert request(bob, target, "DELETE", "/jobs/reused")["status"] == 204
            # Now bob's job runs here: its own attempt 0, with his output only.
            own = {"entrypoint": "/bin/sh", "args": ["-c", "echo bob-output"], "cwd": "/"}
            assert request(bob, target, "POST", "/jobs", {"id": "reused", **own})["status"] == 201
            await _until_state(admin, "reused", ("SUCCEEDED", "FAILED"))
            for path in (
                "/jobs/reused/logs",
                "/jobs/reused/logs?attempt=0",
                "/jobs/reused/logs?attempt=0&follow=true",
            ):
                answer = request(bob, target, "GET", path)
                assert answer["status"] == 200, (path, answer)
                assert answer["body"] == "bob-output\n", (path, answer)
            gone = request(bob, target, "GET", "/jobs/reused/logs?attempt=1")
            assert gone["status"] == 404 and "alice-secret" not in gone["body"], gone
    finally:
        daemon.stop()


@AS_ROOT
async def test_a_local_user_named_like_an_identity_is_not_that_identity(
    open_tmp: Path, users: Users
) -> None:
    """An identity's name and a local user's name live in different name spaces: bob, a local
    user whose Unix name happens to be the name of carol's CI identity, neither reads that
    identity's job's env nor cancels it, and his jobs do not count toward its quota."""
    carol, bob = users.user(), users.user()
    token = new_token()
    identities = open_tmp / "identities.toml"
    identities.write_text(
        f'[[identity]]\nname = "{bob.name}"\ntoken_sha256 = "{hash_token(token)}"\n'
        f'users = ["{carol.name}"]\n'
    )
    sock = open_tmp / "run" / "elasticd.sock"
    daemon = serve(
        open_tmp,
        "--unix-socket",
        str(sock),
        env={"ELASTICD_ALLOW_ROOT": "false", "ELASTICD_IDENTITIES_FILE": str(identities)},
    )
    try:
        async with (
            asyncio.timeout(90),
            daemon.client() as admin,
            daemon.client(headers={"Authorization": f"Bearer {token}"}) as ci,
        ):
            await daemon.wait_ready()
            job = {"id": "ci", **SLEEP_JOB, "env": {"API_KEY": "carols-secret"}}
            assert (await ci.post("/jobs", json=job)).status_code == 201
            target = str(sock)
            seen = request(bob, target, "GET", "/jobs/ci")
            assert seen["status"] == 200, seen
            assert "carols-secret" not in seen["body"], seen
            for method, path in [
                ("POST", "/jobs/ci/cancel"),
                ("GET", "/jobs/ci/logs"),
                ("GET", "/jobs/ci/events"),
            ]:
                answer = request(bob, target, method, path, {} if method == "POST" else None)
                assert answer["status"] == 403, (method, path, answer)
            assert (await admin.get("/jobs/ci")).json()["state"] in ("PENDING", "RUNNING")
            # And the other way round: the identity does not own bob's job.
            his = request(bob, target, "POST", "/jobs", {"id": "his", **SLEEP_JOB})
            assert his["status"] == 201, his
            assert (await ci.post("/jobs/his/cancel", json={})).status_code == 403
            for name in ("ci", "his"):
                assert (await admin.post(f"/jobs/{name}/cancel", json={})).status_code == 200
    finally:
        daemon.stop()


#: mallory's fake daemon on the default address: records the Authorization header it is sent.
SQUATTER = r"""
import socket, sys
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", int(sys.argv[1])))
srv.listen(8)
print("listening", flush=True)
srv.settimeout(60)
conn, _ = srv.accept()
conn.settimeout(10)
head = b""
while b"\r\n\r\n" not in head:
    chunk = conn.recv(65536)
    if not chunk:
        break
    head += chunk
body = b'{"jobs": [], "total": 0}'
conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
             + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)
conn.close()
print("HEAD " + head.decode("latin-1").replace("\r\n", " | "), flush=True)
"""


@AS_ROOT
def test_the_cli_never_sends_your_own_token_to_a_guessed_address(
    open_tmp: Path, users: Users
) -> None:
    """alice's own daemon is stopped (its token stays in her state folder) and no socket
    exists; mallory listens on the default address 127.0.0.1:7070. alice's `elasticd jobs`
    reaches mallory (it is only a guess) but without alice's token: with it, mallory would
    be alice's daemon's admin the moment it runs again."""
    alice, mallory = users.user(), users.user()
    command = _python_for(alice)
    if command is None:
        pytest.skip("this checkout's packages are not readable by other users")
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", 7070))
        except OSError:
            pytest.skip("127.0.0.1:7070 is in use here")
    state_home = open_tmp / "alice-xdg"
    own = state_home / "elasticd"
    own.mkdir(parents=True)
    token = new_token()
    (own / "token").write_text(token + "\n")
    (own / "token").chmod(0o600)
    for path in (state_home, own, own / "token"):
        os.chown(path, alice.uid, alice.gid)
    squatter = as_user(mallory, SYSTEM_PY, "-I", "-c", SQUATTER, "7070")
    try:
        assert squatter.stdout is not None
        assert squatter.stdout.readline().strip() == b"listening"
        site = _site_packages()
        cli = as_user(
            alice,
            *command,
            "jobs",
            env={"PYTHONPATH": f"{ROOT}:{site}", "XDG_STATE_HOME": str(state_home)},
        )
        cli.communicate(timeout=60)
        seen, _ = squatter.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(squatter.pid, signal.SIGKILL)
    text = seen.decode()
    assert "HEAD GET /jobs" in text, text  # alice's CLI did call the squatter
    assert token not in text
    assert "authorization" not in text.lower(), text
