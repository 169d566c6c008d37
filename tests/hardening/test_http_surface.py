"""The daemon's HTTP surface against hostile clients (issue 11, findings 2, 9 and 12).

Real `elasticd serve` processes on loopback, real sockets: misdirected
(Host), cross-origin (Origin) and non-JSON state-changing requests are
refused with problem+json and change nothing; request heads are bounded in
size and time before authentication; the embedded daemon of `elasticd run`
and `elasticd.launch` refuses other local users; no page loads anything from
elsewhere and /openapi.json needs the token. The browser attacks are in
``test_browser_attacks.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.guard import Refusal, refusal
from api.protocol import HEAD_TIMEOUT, MAX_HEAD_BYTES
from tests.hardening.support import PY, Served, make_token_file, script, serve

ROOT = Path(__file__).resolve().parents[2]
SLEEP = {"entrypoint": "/bin/sleep", "args": ["600"], "termination_grace": 1}


# -- the rules, as a pure function ------------------------------------------------------


def _decide(
    method: str,
    headers: dict[str, str],
    *,
    tokenless: bool = True,
    unix_socket: bool = False,
) -> Refusal | None:
    return refusal(
        method=method,
        path="/jobs",
        headers=[(k.lower().encode(), v.encode()) for k, v in headers.items()],
        scheme="http",
        tokenless=tokenless,
        unix_socket=unix_socket,
    )


JSON = {"Content-Type": "application/json", "Content-Length": "2"}


@pytest.mark.parametrize(
    ("method", "headers", "tokenless", "status"),
    [
        # Host, without a token: loopback names only, with or without the port.
        ("GET", {"Host": "127.0.0.1:7070"}, True, None),
        ("GET", {"Host": "127.8.9.10:7070"}, True, None),
        ("GET", {"Host": "localhost:7070"}, True, None),
        ("GET", {"Host": "LOCALHOST"}, True, None),
        ("GET", {"Host": "[::1]:7070"}, True, None),
        ("GET", {"Host": "attacker.example:7070"}, True, 421),
        ("GET", {"Host": "localhost.attacker.example"}, True, 421),
        ("GET", {"Host": "127.0.0.1.nip.io:7070"}, True, 421),
        ("GET", {"Host": "10.0.0.1:7070"}, True, 421),
        ("GET", {"Host": "::1"}, True, 421),  # unbracketed IPv6: malformed
        ("GET", {"Host": "127.0.0.1:99999"}, True, 421),
        ("GET", {}, True, 421),
        ("GET", {"Host": "attacker.example"}, False, None),  # the page has no token
        # Origin on a state-changing request, token or not.
        ("POST", {"Host": "127.0.0.1:7070", "Origin": "http://127.0.0.1:7070", **JSON}, True, None),
        ("POST", {"Host": "127.0.0.1:80", "Origin": "http://127.0.0.1", **JSON}, True, None),
        ("POST", {"Host": "127.0.0.1:7070", "Origin": "http://127.0.0.1:8000", **JSON}, True, 403),
        ("POST", {"Host": "127.0.0.1:7070", "Origin": "http://evil.example", **JSON}, True, 403),
        ("POST", {"Host": "127.0.0.1:7070", "Origin": "null", **JSON}, True, 403),
        ("POST", {"Host": "node1:7070", "Origin": "http://evil.example", **JSON}, False, 403),
        ("DELETE", {"Host": "127.0.0.1:7070", "Origin": "http://evil.example"}, True, 403),
        ("GET", {"Host": "127.0.0.1:7070", "Origin": "http://evil.example"}, True, None),
        # Content-Type: JSON only, a body always for POST, PUT, PATCH.
        ("POST", {"Host": "127.0.0.1:7070"}, True, 415),
        ("POST", {"Host": "127.0.0.1:7070", "Content-Length": "0"}, True, 415),
        ("POST", {"Host": "127.0.0.1:7070", "Content-Type": "text/plain"}, True, 415),
        (
            "POST",
            {"Host": "127.0.0.1:7070", "Content-Type": "application/x-www-form-urlencoded"},
            True,
            415,
        ),
        ("POST", {"Host": "127.0.0.1:7070", "Content-Type": "multipart/form-data"}, True, 415),
        ("PUT", {"Host": "127.0.0.1:7070", "Content-Type": "text/plain"}, False, 415),
        ("POST", {"Host": "h", "Content-Type": "application/json; charset=utf-8"}, False, None),
        ("DELETE", {"Host": "127.0.0.1:7070"}, True, None),
        ("DELETE", {"Host": "127.0.0.1:7070", "Content-Length": "3"}, True, 415),
    ],
)
def test_the_rules(
    method: str, headers: dict[str, str], tokenless: bool, status: int | None
) -> None:
    """Each row: the rule of api.guard that serves or refuses it, with which status."""
    found = _decide(method, headers, tokenless=tokenless)
    assert (found.status if found else None) == status, found
    if found is not None:
        assert found.detail and found.title


def test_unix_socket_connections_need_no_loopback_host() -> None:
    """No browser reaches a unix socket: its Host is not checked (Origin and type still are)."""
    assert _decide("GET", {"Host": "anything"}, unix_socket=True) is None
    assert _decide("POST", {"Host": "x"}, unix_socket=True) is not None


# -- against a real daemon --------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenless(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    daemon = serve(tmp_path_factory.mktemp("surface"))
    try:
        asyncio.run(daemon.wait_ready())
        yield daemon
    finally:
        daemon.stop()
    assert "Exception in ASGI application" not in daemon.output(), daemon.output()[-3000:]


@pytest.fixture(scope="module")
def with_token(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("surface-token")
    token_file, _ = make_token_file(root)
    daemon = serve(root, token_file=token_file)
    try:
        asyncio.run(daemon.wait_ready())
        yield daemon
    finally:
        daemon.stop()


def _problem(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"] == "application/problem+json", r.headers
    body: dict[str, Any] = r.json()
    assert body["status"] == status and body["detail"], body
    return body


def _job_ids(daemon: Served) -> list[str]:
    r = httpx.get(f"{daemon.url}/jobs", headers=daemon.headers, timeout=10)
    return [j["id"] for j in r.json()["jobs"]]


@pytest.fixture
def running(tokenless: Served) -> Iterator[str]:
    """A running job of the tokenless daemon, cancelled afterwards."""
    job_id = f"victim-{time.monotonic_ns()}"
    with httpx.Client(base_url=tokenless.url, headers=tokenless.headers, timeout=10) as c:
        assert c.post("/jobs", json={"id": job_id, **SLEEP}).status_code == 201
        # Running before the tests check that their requests left it running.
        deadline = time.monotonic() + 30
        while c.get(f"/jobs/{job_id}").json()["state"] != "RUNNING":
            assert time.monotonic() < deadline, f"{job_id} never RUNNING"
            time.sleep(0.02)
        yield job_id
        c.post(f"/jobs/{job_id}/cancel", json={})


@pytest.mark.slow
def test_a_rebound_page_has_no_identity(tokenless: Served) -> None:
    """A DNS-rebinding page (Host: attacker.example) has neither the token nor the unix
    socket: every request is 401 before anything is read or changed (there is no tokenless
    daemon whose loopback it could borrow); /ui is static and holds no data."""
    evil = {"Host": f"attacker.example:{tokenless.port}"}
    with httpx.Client(base_url=tokenless.url, timeout=10) as c:
        _problem(c.get("/jobs", headers=evil), 401)
        _problem(c.get("/store/list", headers=evil), 401)
        _problem(c.post("/jobs", json={"id": "rebound", **SLEEP}, headers=evil), 401)
        _problem(c.get("/jobs"), 401)  # loopback names are no identity either
    assert "rebound" not in _job_ids(tokenless)


@pytest.mark.slow
def test_a_token_daemon_answers_any_name_but_only_with_the_token(with_token: Served) -> None:
    """With a token the Host is free (a rebound page has no token: 401)."""
    evil = {"Host": f"attacker.example:{with_token.port}"}
    with httpx.Client(base_url=with_token.url, timeout=10) as c:
        _problem(c.get("/jobs", headers=evil), 401)
        assert c.get("/jobs", headers={**evil, **with_token.headers}).status_code == 200


@pytest.mark.slow
def test_cross_origin_state_changes_are_refused(
    tokenless: Served, with_token: Served, running: str
) -> None:
    """A POST or DELETE with another page's Origin gets 403, token or not; nothing changes.
    The daemon's own origin (its /ui page) may."""
    evil = {"Origin": "http://attacker.example:8000"}
    with httpx.Client(base_url=tokenless.url, headers=tokenless.headers, timeout=10) as c:
        body = _problem(c.post("/jobs", json={"id": "xorigin", **SLEEP}, headers=evil), 403)
        assert "attacker.example" in body["detail"]
        _problem(c.post(f"/jobs/{running}/cancel", json={}, headers=evil), 403)
        _problem(c.delete(f"/jobs/{running}", headers=evil), 403)
        _problem(c.put("/store/kv", json={"key": "a", "value": ""}, headers=evil), 403)
        assert c.get(f"/jobs/{running}").json()["state"] == "RUNNING"
        assert "xorigin" not in _job_ids(tokenless)
        own = {"Origin": tokenless.url}
        assert c.post("/jobs", json={"id": "same-origin", **SLEEP}, headers=own).status_code == 201
        assert c.post("/jobs/same-origin/cancel", json={}, headers=own).status_code == 200
    with httpx.Client(base_url=with_token.url, headers=with_token.headers, timeout=10) as c:
        _problem(c.post("/jobs", json={"id": "xorigin", **SLEEP}, headers=evil), 403)
        assert "xorigin" not in _job_ids(with_token)


@pytest.mark.slow
def test_state_changes_need_a_json_body(tokenless: Served, running: str) -> None:
    """Form, text/plain and empty POSTs (what a page may send without a preflight) get 415
    saying to send JSON; the job keeps running and nothing is created."""
    with httpx.Client(base_url=tokenless.url, headers=tokenless.headers, timeout=10) as c:
        body = _problem(c.post(f"/jobs/{running}/cancel"), 415)
        assert "application/json" in body["detail"] and "{}" in body["detail"]
        _problem(c.post(f"/jobs/{running}/cancel", data={"a": "b"}), 415)
        _problem(
            c.post(
                f"/jobs/{running}/cancel",
                files={"f": ("x", b"y")},
            ),
            415,
        )
        spec = json.dumps({"id": "plain", **SLEEP})
        _problem(c.post("/jobs", content=spec, headers={"Content-Type": "text/plain"}), 415)
        assert c.get(f"/jobs/{running}").json()["state"] == "RUNNING"
        assert "plain" not in _job_ids(tokenless)
        # The same requests as JSON are served: {} is the body of a cancel.
        assert c.post(f"/jobs/{running}/cancel", json={}).json()["state"] in (
            "CANCELLED",
            "RUNNING",
        )


@pytest.mark.slow
def test_cli_and_client_cancel_still_work(tokenless: Served) -> None:
    """`elasticd cancel` (the client sends {}) cancels a job."""
    with httpx.Client(base_url=tokenless.url, headers=tokenless.headers, timeout=10) as c:
        assert c.post("/jobs", json={"id": "by-cli", **SLEEP}).status_code == 201
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICD_")}
    token_file = tokenless.state_dir.parent / "cli-token"
    token_file.write_text(str(tokenless.token))
    token_file.chmod(0o600)
    done = subprocess.run(
        [
            PY,
            "-m",
            "elasticd",
            "cancel",
            "by-cli",
            "--url",
            tokenless.url,
            "--token-file",
            str(token_file),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "cancel requested" in done.stdout


@pytest.mark.slow
def test_no_page_loads_anything_from_elsewhere_and_openapi_needs_the_token(
    with_token: Served, tokenless: Served
) -> None:
    """No /docs or /redoc (CDN scripts); /openapi.json needs the token; every response
    carries a CSP that forbids loading from elsewhere."""
    with httpx.Client(base_url=with_token.url, timeout=10) as c:
        for path in ("/docs", "/redoc", "/docs/oauth2-redirect"):
            assert c.get(path, headers=with_token.headers).status_code in (401, 404), path
            assert c.get(path, headers=with_token.headers).status_code != 200
        _problem(c.get("/openapi.json"), 401)
        document = c.get("/openapi.json", headers=with_token.headers)
        assert document.status_code == 200 and "/jobs" in document.json()["paths"]
        for path in ("/healthz", "/jobs", "/openapi.json"):
            r = c.get(path, headers=with_token.headers)
            policy = r.headers["content-security-policy"]
            assert "default-src 'none'" in policy and "frame-ancestors 'none'" in policy
            assert r.headers["x-content-type-options"] == "nosniff"
        ui = c.get("/ui")
        assert ui.status_code == 200
        policy = ui.headers["content-security-policy"]
        assert "default-src 'none'" in policy and "connect-src 'self'" in policy
        for attribute in ('src="http', "src='http", 'href="http', "//cdn", "@import"):
            assert attribute not in ui.text, attribute
    assert httpx.get(f"{tokenless.url}/openapi.json", timeout=10).status_code == 401


# -- request heads: bounded in size and time, before authentication ----------------------


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _daemon_pid(daemon: Served) -> int:
    return daemon.proc.pid  # `python -m elasticd serve` is the daemon itself


async def _healthz_seconds(daemon: Served) -> float:
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=10) as c:
        assert (await c.get(f"{daemon.url}/healthz")).status_code == 200
    return time.monotonic() - started


async def _send_huge_head(port: int, total: int) -> tuple[int, bytes]:
    """Send a request line and one header line of ``total`` bytes without end; returns the
    bytes sent before the daemon closed the connection, and what it answered."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    sent = 0
    chunk = b"a" * 65536
    try:
        writer.write(b"GET /jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ")
        while sent < total:
            writer.write(chunk)
            await writer.drain()
            sent += len(chunk)
    except (ConnectionError, OSError):
        pass
    answer = b""
    try:
        async with asyncio.timeout(10):
            answer = await reader.read()
    except (ConnectionError, OSError, TimeoutError):
        pass
    writer.close()
    return sent, answer


@pytest.mark.slow
async def test_huge_request_heads_are_cut_off_and_memory_stays_bounded(tmp_path: Path) -> None:
    """8 connections each sending a 64 MiB header line (finding 9: +512 MiB before): each is
    answered 431 and closed after MAX_HEAD_BYTES, the daemon's RSS grows by under 40 MiB, and
    /healthz answers fast meanwhile."""
    daemon = serve(tmp_path)
    try:
        async with asyncio.timeout(110):
            await daemon.wait_ready()
            pid = _daemon_pid(daemon)
            before = _rss_kib(pid)
            attacks = [
                asyncio.create_task(_send_huge_head(daemon.port, 64 << 20)) for _ in range(8)
            ]
            peak = before
            while not all(a.done() for a in attacks):
                peak = max(peak, _rss_kib(pid))
                assert await _healthz_seconds(daemon) < 2
                await asyncio.sleep(0.05)
            for sent, answer in [a.result() for a in attacks]:
                assert sent < 16 << 20, sent  # cut off long before 64 MiB
                if answer:  # the 431 may be lost to the reset of a connection still sending
                    assert answer.startswith(b"HTTP/1.1 431"), answer[:200]
            assert (peak - before) < 40 * 1024, (before, peak)
            assert await _healthz_seconds(daemon) < 2
    finally:
        daemon.stop()


@pytest.mark.slow
async def test_a_head_just_under_the_limit_is_served(tmp_path: Path) -> None:
    """A request whose headers take most of MAX_HEAD_BYTES (large cookies) is still served."""
    daemon = serve(tmp_path)
    try:
        async with asyncio.timeout(60):
            await daemon.wait_ready()
            async with httpx.AsyncClient(timeout=10) as c:
                big = {"X-Big": "a" * (MAX_HEAD_BYTES - 2048)}
                assert (await c.get(f"{daemon.url}/healthz", headers=big)).status_code == 200
    finally:
        daemon.stop()


async def _slow_head(port: int, opened: list[float], closed: list[float]) -> bytes:
    """Open a connection and send a header byte a second forever (slowloris)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    opened.append(time.monotonic())
    answer = b""
    try:
        writer.write(b"GET /jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        while True:
            try:
                async with asyncio.timeout(1):
                    data = await reader.read(65536)
            except TimeoutError:
                writer.write(b"a")
                await writer.drain()
                continue
            answer += data
            if not data:
                break
    except (ConnectionError, OSError):
        pass
    closed.append(time.monotonic())
    writer.close()
    return answer


async def _silent(port: int, closed: list[float]) -> bytes:
    """Open a connection and send nothing."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    answer = b""
    try:
        answer = await reader.read()
    except (ConnectionError, OSError):
        pass
    closed.append(time.monotonic())
    writer.close()
    return answer


@pytest.mark.slow
async def test_slow_and_silent_connections_are_closed_after_the_head_timeout(
    tmp_path: Path,
) -> None:
    """A header sent a byte a second, and a connection that sends nothing, are answered 408
    and closed within HEAD_TIMEOUT (plus slack); /healthz answers fast meanwhile."""
    daemon = serve(tmp_path)
    try:
        async with asyncio.timeout(110):
            await daemon.wait_ready()
            opened: list[float] = []
            closed: list[float] = []
            slow = [asyncio.create_task(_slow_head(daemon.port, opened, closed)) for _ in range(8)]
            silent = [asyncio.create_task(_silent(daemon.port, closed)) for _ in range(8)]
            while not all(t.done() for t in slow + silent):
                assert await _healthz_seconds(daemon) < 2
                await asyncio.sleep(0.2)
            assert len(closed) == 16
            assert max(closed) - min(opened) < HEAD_TIMEOUT + 10
            assert min(closed) - min(opened) >= HEAD_TIMEOUT - 1  # no one cut off early
            for task in slow + silent:
                assert task.result().startswith(b"HTTP/1.1 408"), task.result()[:200]
    finally:
        daemon.stop()


# -- the embedded daemon of `elasticd run` and `elasticd.launch` -------------------------

#: What a worker does: note the daemon's URL and token file, check that its own user's
#: client gets in with the token, then wait until told to finish.
WORKER = """
import json, os, pathlib, sys, time
from elasticd.client import Client
out = pathlib.Path(sys.argv[1])
url, token_file = os.environ["ELASTICD_URL"], os.environ.get("ELASTICD_TOKEN_FILE")
with Client(url, token_file=token_file) as client:
    jobs = [j.id for j in client.list_jobs().jobs]
note = {"url": url, "token_file": token_file, "jobs": jobs}
(out / "note.json").write_text(json.dumps(note))
while not (out / "go").exists():
    time.sleep(0.05)
"""

LAUNCHER = """
import sys
import elasticd
from embedded_target import work
if __name__ == "__main__":
    print(elasticd.launch(work, run_id="launched", timeout=100)(sys.argv[1]), flush=True)
"""

TARGET = """
import runpy, sys
def work(out):
    sys.argv = ["worker", out]
    runpy.run_path({worker!r}, run_name="__worker__")
    return "done"
"""

#: Run as nobody with the system Python (the venv lives under /root): every request to the
#: embedded daemon, without and with a guessed token, and an attempt to read its token file.
AS_NOBODY = """
import json, sys, urllib.error, urllib.request
url, job, token_file = sys.argv[1], sys.argv[2], sys.argv[3]
result = {}
def call(method, path, body=None, headers=None):
    data = None if body is None else json.dumps(body).encode()
    h = {"Content-Type": "application/json"} if body is not None else {}
    h.update(headers or {})
    req = urllib.request.Request(url + path, data=data, method=method, headers=h)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
for name, (method, path, body) in {
    "list": ("GET", "/jobs", None),
    "get": ("GET", "/jobs/" + job, None),
    "logs": ("GET", "/jobs/" + job + "/logs", None),
    "events": ("GET", "/jobs/" + job + "/events", None),
    "store": ("GET", "/store/list", None),
    "cancel": ("POST", "/jobs/" + job + "/cancel", {}),
    "delete": ("DELETE", "/jobs/" + job, None),
}.items():
    result[name] = call(method, path, body)
result["guessed"] = call("POST", "/jobs/" + job + "/cancel", {}, {"Authorization": "Bearer x"})
try:
    open(token_file).read()
    result["token_file"] = "read"
except OSError as e:
    result["token_file"] = type(e).__name__
print(json.dumps(result))
"""


def _as_nobody(folder: Path, url: str, job: str, token_file: str) -> dict[str, Any]:
    path = folder / "as_nobody.py"
    path.write_text(AS_NOBODY)
    path.chmod(0o644)
    done = subprocess.run(
        ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--reset-env"]
        + ["/usr/bin/python3", str(path), url, job, token_file],
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def _wait_for(condition: Any, timeout: float, what: str) -> None:
    """Poll ``condition`` every 50 ms until it holds, under a deadline."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as the user nobody")
@pytest.mark.parametrize("how", ["elasticd run", "elasticd.launch"])
def test_another_local_user_cannot_reach_the_embedded_daemon(how: str, open_tmp: Path) -> None:
    """As nobody, listing, reading, cancelling and deleting the embedded daemon's job are all
    401, and its token file cannot be read; the worker (its owner's client, with the token)
    gets in, and the job ends as it would have."""
    pwd.getpwnam("nobody")
    out = open_tmp / "out"
    out.mkdir()
    worker = script(open_tmp, "worker.py", WORKER)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICD_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(open_tmp)])
    if how == "elasticd run":
        args = [PY, "-m", "elasticd", "run", "--run-id", "embedded", "--", PY, worker, str(out)]
        job = "embedded"
    else:
        (open_tmp / "embedded_target.py").write_text(TARGET.format(worker=worker))
        launcher = script(open_tmp, "launcher.py", LAUNCHER)
        args = [PY, launcher, str(out)]
        job = "launched"
    log = open_tmp / "embedded.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(args, env=env, stdout=sink, stderr=subprocess.STDOUT, cwd=open_tmp)
    try:
        note_file = out / "note.json"
        _wait_for(lambda: note_file.exists() or proc.poll() is not None, 60, "the worker's note")
        assert note_file.exists(), log.read_text()
        note = json.loads(note_file.read_text())
        assert note["jobs"] == [job]  # the owner's client, with the run's token
        token_file = Path(note["token_file"] or "/nonexistent")
        result = _as_nobody(open_tmp, note["url"], job, str(token_file))
        assert result == {
            "list": 401,
            "get": 401,
            "logs": 401,
            "events": 401,
            "store": 401,
            "cancel": 401,
            "delete": 401,
            "guessed": 401,
            "token_file": "PermissionError",
        }, result
        assert token_file.stat().st_mode & 0o077 == 0
        (out / "go").write_text("")
        _wait_for(lambda: proc.poll() is not None, 60, "the run to end")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, log.read_text()[-3000:]
    if how == "elasticd run":
        assert "SUCCEEDED" in log.read_text()
        assert str(token_file) in log.read_text()  # the run says where its token is
    else:
        assert "{0: 'done'}" in log.read_text()


@pytest.mark.slow
async def test_connections_beyond_the_cap_evict_the_longest_idle_then_are_refused() -> None:
    """With the cap (here 4) held by idle connections, a new one is served, and the one that
    waited longest for a request head is closed to make room (issue 23: a flood of idle
    connections kept /healthz from being answered). With the cap running requests, the next
    connection is answered 503 and closed at once."""
    import uvicorn

    from api.protocol import uvicorn_settings

    release = asyncio.Event()
    running = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["path"] == "/slow":
            running.append(scope)
            await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    settings = uvicorn_settings(max_connections=4)
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", **settings)
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve())
    try:
        async with asyncio.timeout(30):
            while not server.started:
                await asyncio.sleep(0.01)
            port = server.servers[0].sockets[0].getsockname()[1]
            url = f"http://127.0.0.1:{port}"
            held = []
            for _ in range(4):  # idle: connected, nothing sent
                held.append(await asyncio.open_connection("127.0.0.1", port))
                await asyncio.sleep(0.01)  # distinct ages
            async with httpx.AsyncClient(timeout=10) as c:
                assert (await c.get(url + "/")).status_code == 200
            assert await held[0][0].read() == b""  # the oldest was closed, saying nothing
            for reader, writer in held[1:]:
                assert not reader.at_eof()
                writer.close()
            held[0][1].close()

            # Every connection runs a request: the next one is refused at once.
            async with httpx.AsyncClient(timeout=10, limits=httpx.Limits(max_connections=8)) as c:
                busy = [asyncio.create_task(c.get(url + "/slow")) for _ in range(4)]
                deadline = time.monotonic() + 10
                while len(running) < 4:  # the four requests are in the app
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.02)
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                answer = await reader.read()
                writer.close()
                assert answer.startswith(b"HTTP/1.1 503"), answer
                release.set()
                assert [(await b).status_code for b in busy] == [200] * 4
    finally:
        server.should_exit = True
        await serving
