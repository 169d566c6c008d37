"""Who may do what: the token file and its comparison, where the token never goes, the unix
socket, the user jobs run as, and the size of what a request may carry."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import pwd
import stat
from pathlib import Path
from typing import Any

import httpx
import pytest

import elasticd.identity
from api.app import create_app
from tests.conftest import asgi_client, make_daemon, wait_job
from tests.hardening.support import (
    PY,
    eventually,
    healthy_pids,
    make_token_file,
    pid_alive,
    proc_uid,
    script,
    serve,
)

AS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")


# -- the token -----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644])
def test_serve_refuses_a_token_file_others_can_read(tmp_path: Path, mode: int) -> None:
    """`elasticd serve` exits 2 before listening, naming the file and the chmod to run."""
    token_file, token = make_token_file(tmp_path)
    token_file.chmod(mode)
    daemon = serve(tmp_path, token_file=token_file)
    assert daemon.proc.wait(30) == 2
    out = daemon.output()
    assert f"chmod 600 {token_file}" in out and f"{mode:04o}" in out
    assert token not in out


async def test_the_token_is_compared_in_constant_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every check goes through hmac.compare_digest, also for a token of the wrong length."""
    calls: list[tuple[bytes, bytes]] = []
    real = elasticd.identity.hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(elasticd.identity.hmac, "compare_digest", spy)
    d = make_daemon(tmp_path, token="the-real-token")
    async with asyncio.timeout(30):
        await d.start()
        try:
            transport = httpx.ASGITransport(app=create_app(d))
            async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
                for given in ("the-real-tokeX", "short", "the-real-token"):
                    r = await c.get("/jobs", headers={"Authorization": f"Bearer {given}"})
                    assert r.status_code == (200 if given == "the-real-token" else 401)
                    assert "the-real-token" not in r.text
        finally:
            await d.shutdown()
    # Each given token is compared with the admin's (and the cluster's) in constant time.
    assert {a for a, _ in calls} == {b"the-real-tokeX", b"short", b"the-real-token"}
    assert {b for _, b in calls} == {b"the-real-token"}


def _cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


LEAKY = """
import json, os, sys
path = os.environ["ELASTICD_TOKEN_FILE"]
assert os.path.isabs(path), path
json.dump(dict(os.environ), open(sys.argv[1], "w"))
print(json.dumps(dict(os.environ)), flush=True)
print("argv", sys.argv, file=sys.stderr, flush=True)
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    raise SystemExit("failing once on purpose, with the env above")
"""


@pytest.mark.slow
async def test_the_token_never_appears_in_logs_events_api_env_or_state(tmp_path: Path) -> None:
    """A job runs (and fails once) on a daemon with a token and debug logging; the token string
    is nowhere: not in the daemon's output, any API answer, the store, a worker's environment
    (it gets the file's path), the daemon's command line, or the state files on disk."""
    token_file, token = make_token_file(tmp_path)
    leaky = script(tmp_path, "leaky.py", LEAKY)
    env_dump = tmp_path / "env.json"
    daemon = serve(tmp_path, token_file=token_file, verbose=True)
    seen: list[str] = []
    try:
        async with asyncio.timeout(60), daemon.client() as c:
            await daemon.wait_ready()
            r = await c.post(
                "/jobs",
                json={
                    "id": "leak",
                    "entrypoint": PY,
                    "args": [leaky, str(env_dump)],
                    "max_restarts": 1,
                    "env": {"SOMETHING": "else"},
                },
            )
            assert r.status_code == 201
            seen.append(r.text)
            job = await wait_job(c, "leak")
            assert job["state"] == "SUCCEEDED", job
            bad = await c.get("/jobs", headers={"Authorization": f"Bearer x{token}"})
            assert bad.status_code == 401
            seen.append(bad.text + json.dumps(dict(bad.headers)))
            for path, params in [
                ("/jobs", {}),
                ("/jobs/leak", {}),
                ("/jobs/leak/workers", {}),
                ("/jobs/leak/goodput", {}),
                ("/jobs/leak/events", {}),
                ("/jobs/leak/logs", {"stream": "stdout", "attempt": 0}),
                ("/jobs/leak/logs", {"stream": "stderr", "attempt": 0}),
                ("/jobs/leak/logs", {"stream": "stdout"}),
                ("/nodes", {}),
                ("/metrics", {}),
                ("/readyz", {}),
                ("/healthz", {}),
                ("/openapi.json", {}),
                ("/store/list", {"prefix": ""}),
            ]:
                r = await c.get(path, params=params)
                assert r.status_code == 200, (path, r.text)
                seen.append(r.text + json.dumps(dict(r.headers)))
            for entry in (await c.get("/store/list", params={"prefix": ""})).json()["entries"]:
                seen.append(base64.b64decode(entry["value"]).decode(errors="replace"))
            cmdline = _cmdline(daemon.proc.pid)
    finally:
        daemon.stop()
    worker_env = json.loads(env_dump.read_text())
    # A job running as the daemon's own user gets the path of the token its user could
    # read anyway; a job of another user gets its own (test_identities.py).
    assert worker_env["ELASTICD_TOKEN_FILE"] == str(token_file.resolve())
    assert "ELASTICD_TOKEN" not in worker_env
    assert any("failing once on purpose" in s for s in seen)  # the error made it to the API
    for text in seen:
        assert token not in text
    assert token not in json.dumps(worker_env)
    assert token.encode() not in cmdline
    assert token not in daemon.output()
    assert "DEBUG" in daemon.output()  # debug logging was on
    for path in daemon.state_dir.rglob("*"):
        if path.is_file():
            assert token.encode() not in path.read_bytes(), path


# -- the unix socket ------------------------------------------------------------------


@pytest.mark.slow
async def test_unix_socket_modes_its_peer_is_the_caller_and_it_is_removed(tmp_path: Path) -> None:
    """--unix-socket of a root daemon: folder 0755, socket 0666 (every local user may connect
    and is served as the uid the kernel names: root is an admin, no token needed), removed
    at shutdown."""
    token_file, _token = make_token_file(tmp_path)
    sock = tmp_path / "run" / "elasticd" / "api.sock"
    daemon = serve(tmp_path, "--unix-socket", str(sock), token_file=token_file)
    root = os.geteuid() == 0
    try:
        async with asyncio.timeout(30):
            await daemon.wait_ready()
            assert stat.S_IMODE(sock.parent.stat().st_mode) == (0o755 if root else 0o700)
            assert stat.S_ISSOCK(sock.stat().st_mode)
            assert stat.S_IMODE(sock.stat().st_mode) == (0o666 if root else 0o600)
            transport = httpx.AsyncHTTPTransport(uds=str(sock))
            async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
                assert (await c.get("/healthz")).status_code == 200
                assert (await c.get("/jobs")).status_code == 200  # the kernel named the caller
    finally:
        daemon.stop()
    assert daemon.proc.returncode == 0
    assert not sock.exists()


@pytest.mark.slow
def test_unix_socket_path_that_is_not_a_socket_is_refused(tmp_path: Path) -> None:
    """An existing regular file at the socket path is never replaced: exit 2, clear message."""
    path = tmp_path / "sockdir" / "api.sock"
    path.parent.mkdir()
    path.write_text("not a socket")
    daemon = serve(tmp_path, "--unix-socket", str(path))
    assert daemon.proc.wait(30) == 2
    assert "exists and is not a socket" in daemon.output()
    assert path.read_text() == "not a socket"


# -- the user jobs run as --------------------------------------------------------------

IDENTIFY = "id -u; echo $HOME; echo x > $(dirname $TORCHELASTIC_ERROR_FILE)/mine; exec sleep 600"


@AS_ROOT
@pytest.mark.slow
async def test_serve_runs_jobs_as_run_as_with_private_state(open_tmp: Path) -> None:
    """--run-as nobody: the worker's uid is nobody's and its log folder its own; the daemon's
    state folder becomes traverse-only and its database files stay 0600."""
    nobody = pwd.getpwnam("nobody")
    daemon = serve(open_tmp, "--run-as", "nobody", env={"ELASTICD_ALLOW_ROOT": "false"})
    try:
        async with asyncio.timeout(60), daemon.client() as c:
            await daemon.wait_ready()
            r = await c.post(
                "/jobs", json={"id": "u", "entrypoint": "/bin/sh", "args": ["-c", IDENTIFY]}
            )
            assert r.status_code == 201
            (pid,) = await healthy_pids(c, "u", 1)
            assert proc_uid(pid) == nobody.pw_uid
            log = open_tmp / "state" / "logs" / "u" / "attempt_0" / "0"
            await eventually(lambda: (log / "mine").exists(), 10, "the worker's own file")
            r = await c.get("/jobs/u/logs")
            assert r.text.split() == [str(nobody.pw_uid), nobody.pw_dir]
            assert (log / "mine").stat().st_uid == nobody.pw_uid
            await c.post("/jobs/u/cancel", json={})
            await eventually(lambda: not pid_alive(pid), 10, "the worker to stop")
    finally:
        daemon.stop()
    state = open_tmp / "state"
    assert stat.S_IMODE(state.stat().st_mode) == 0o711
    assert stat.S_IMODE((state / "logs").stat().st_mode) == 0o711
    for name in ("elasticd.sqlite3", "store.sqlite3"):
        assert stat.S_IMODE((state / name).stat().st_mode) == 0o600, name


@AS_ROOT
@pytest.mark.slow
async def test_serve_as_root_refuses_root_jobs_unless_allowed(tmp_path: Path) -> None:
    """Root, no run_as, no 'elasticd' user, no allow_root: the admin's job (no user) is refused
    at submission (403) saying how to fix it, instead of being accepted and failed."""
    try:
        pwd.getpwnam("elasticd")
        pytest.skip("an 'elasticd' user exists here: jobs would run as it")
    except KeyError:
        pass
    daemon = serve(tmp_path, env={"ELASTICD_ALLOW_ROOT": "false"})
    try:
        async with asyncio.timeout(60), daemon.client() as c:
            await daemon.wait_ready()
            ready = (await c.get("/readyz")).json()
            assert "allow_root = true" in ready["warnings"][0]
            r = await c.post("/jobs", json={"id": "r", "entrypoint": "/bin/true"})
            assert r.status_code == 403
            assert (await c.get("/jobs/r")).status_code == 404  # nothing was accepted
    finally:
        daemon.stop()
    assert "refusing to run the job as root" in r.json()["detail"]
    assert "allow_root = true" in r.json()["detail"]
    assert "every job sent to this node will fail" in daemon.output()


# -- sizes -----------------------------------------------------------------------------


async def test_request_bodies_over_the_limit_get_413(client: httpx.AsyncClient) -> None:
    """Over 1 MiB: 413 problem+json, by Content-Length or while streaming a chunked body."""
    big = {"entrypoint": "x", "args": ["a" * 60_000] * 20}
    r = await client.post("/jobs", json=big)
    assert r.status_code == 413
    assert r.headers["content-type"] == "application/problem+json"
    assert "max_request_bytes" in r.json()["detail"]

    async def chunks():
        yield b'{"entrypoint": "x", "args": ["'
        for _ in range(40):
            yield b"a" * 32_768
        yield b'"]}'

    r = await client.post("/jobs", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert r.headers["content-type"] == "application/problem+json"
    assert (await client.get("/healthz")).status_code == 200


async def test_the_body_limit_is_configurable_and_store_routes_keep_their_own(
    tmp_path: Path,
) -> None:
    """max_request_bytes applies to /jobs; /store/ is governed by the store's own value limit."""
    d = make_daemon(tmp_path, max_request_bytes=4096)
    async with asyncio.timeout(30):
        await d.start()
        try:
            async with asgi_client(d) as c:
                r = await c.post("/jobs", json={"entrypoint": "x", "args": ["a" * 5000]})
                assert r.status_code == 413
                value = base64.b64encode(b"v" * 8000).decode()
                r = await c.put("/store/kv", json={"key": "big", "value": value})
                assert r.status_code == 200, r.text
        finally:
            await d.shutdown()


def _spec(**fields: Any) -> dict[str, Any]:
    return {"entrypoint": "/bin/true", **fields}


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"args": ["x"] * 4097}, "args"),
        ({"args": ["a" * 65_537]}, "args.0"),
        ({"env": {f"V{i}": "x" for i in range(1025)}}, "env"),
        ({"env": {"V": "a" * 65_537}}, "env.V"),
        ({"env": {"A=B": "x"}}, "env"),
        ({"env": {"N": 5}}, "env.N"),
        ({"entrypoint": "p" * 4097}, "entrypoint"),
        ({"entrypoint": "   "}, "entrypoint"),
        ({"cwd": "/" * 4097}, "cwd"),
        ({"id": "../etc"}, "id"),
        ({"id": "a" * 129}, "id"),
        ({"node_selector": {f"k{i}": "v" for i in range(65)}}, "node_selector"),
        ({"nproc_per_node": 1025}, "nproc_per_node"),
        ({"role": "r" * 129}, "role"),
        ({"unknown_field": 1}, "unknown_field"),
    ],
)
async def test_job_specs_are_limited_in_fields_args_and_env(
    client: httpx.AsyncClient, fields: dict[str, Any], field: str
) -> None:
    """Each limit of the job spec is a 422 problem naming the field."""
    r = await client.post("/jobs", json=_spec(**fields))
    assert r.status_code == 422, r.text
    assert r.headers["content-type"] == "application/problem+json"
    assert field in [e["field"] for e in r.json()["errors"]], r.json()


@AS_ROOT
@pytest.mark.slow
async def test_a_job_may_ask_only_for_an_allowed_user(open_tmp: Path) -> None:
    """spec.user from allowed_users runs as that user; any other user is a 403 at submit."""
    nobody = pwd.getpwnam("nobody")
    daemon = serve(open_tmp, "--allowed-users", "nobody", env={"ELASTICD_ALLOW_ROOT": "true"})
    try:
        async with asyncio.timeout(60), daemon.client() as c:
            await daemon.wait_ready()
            refused = await c.post("/jobs", json={"entrypoint": "/bin/true", "user": "daemon"})
            assert refused.status_code == 403
            assert "allowed_users" in refused.json()["detail"]
            r = await c.post(
                "/jobs",
                json={
                    "id": "as-nobody",
                    "entrypoint": "/bin/sh",
                    "args": ["-c", IDENTIFY],
                    "user": "nobody",
                },
            )
            assert r.status_code == 201
            (pid,) = await healthy_pids(c, "as-nobody", 1)
            assert proc_uid(pid) == nobody.pw_uid
            await c.post("/jobs/as-nobody/cancel", json={})
            await eventually(lambda: not pid_alive(pid), 10, "the worker to stop")
    finally:
        daemon.stop()


@pytest.mark.timeout(60)
@AS_ROOT
async def test_a_daemon_that_runs_jobs_as_other_users_is_never_tokenless(tmp_path: Path) -> None:
    """Loopback is no boundary between the operator and the jobs: a job's processes could
    use a tokenless API as the daemon's client. A daemon given no token makes its own
    (<state_dir>/token, 0600) and answers 401 to a client without it."""
    daemon = serve(tmp_path, "--run-as", "nobody", token_file=False)
    try:
        token_file = daemon.state_dir / "token"
        deadline = asyncio.get_running_loop().time() + 30
        while not token_file.exists():
            assert daemon.proc.poll() is None, daemon.output()
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.05)
        assert token_file.stat().st_mode & 0o777 == 0o600
        daemon.token = token_file.read_text().strip()
        await daemon.wait_ready()
        async with httpx.AsyncClient(base_url=daemon.url, timeout=30) as anonymous:
            assert (await anonymous.get("/jobs")).status_code == 401
            r = await anonymous.post("/jobs", json={"entrypoint": "/bin/true"})
            assert r.status_code == 401
    finally:
        daemon.stop()
