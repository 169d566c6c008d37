"""What a job, or a writer of the store, can make the daemon read, touch or hold.

Each test performs the attack against a real `elasticd serve` on loopback:
a worker that swaps its log for a link to a root-only file or for a FIFO
while the logs API is hammered; job documents written straight into the
store with ids that name other folders; node records that would send the
caller's token elsewhere; and the bounds on live streams, store values,
store listings and restarts.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import secrets
import shutil
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from elasticd.errors import StoreCompacted
from elasticd.store.memory import MemoryStore
from elasticd.supervise.errorfile import read_error_file
from elasticd.supervise.files import UnsafeWorkerFile, open_worker_file
from tests.conftest import wait_job
from tests.hardening.support import Served, eventually, healthy_pids, make_token_file, serve

AS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")
#: The swapping worker runs as `nobody`, who cannot run the test's virtualenv Python.
SYSTEM_PY = shutil.which("python3", path="/usr/bin:/bin")
NEEDS_SYSTEM_PY = pytest.mark.skipif(SYSTEM_PY is None, reason="needs /usr/bin/python3")

#: Renames the worker's stdout.log away and puts a link (or a FIFO) in its place, and back,
#: as fast as it can. Every rename is atomic, so the log is by turns the real file, absent,
#: and the planted thing.
SWAPPER = """
import os, sys, time
kind, target = sys.argv[1], sys.argv[2]
here = os.path.dirname(os.environ["TORCHELASTIC_ERROR_FILE"])
log, kept, bad = (os.path.join(here, n) for n in ("stdout.log", "kept.log", "bad"))
print("REAL-LOG-LINE", flush=True)
deadline = time.monotonic() + 10
while os.path.getsize(log) == 0 and time.monotonic() < deadline:
    time.sleep(0.01)
if kind == "symlink":
    os.symlink(target, bad)
else:
    os.mkfifo(bad)
open(os.path.join(here, "swapping"), "w").close()
while True:
    os.rename(log, kept)
    os.rename(bad, log)
    os.rename(log, bad)
    os.rename(kept, log)
"""


def test_open_worker_file_reads_only_the_workers_own_regular_file(tmp_path: Path) -> None:
    """open_worker_file opens a regular file; a link (to the file or in place of the rank
    folder), a FIFO (without blocking), a folder or a hard link is UnsafeWorkerFile."""
    secret = tmp_path / "secret"
    secret.write_text("not the worker's")
    rank = tmp_path / "attempt_0" / "0"
    rank.mkdir(parents=True)
    (rank / "stdout.log").write_text("mine\n")
    fd = open_worker_file(rank, "stdout.log")
    try:
        assert os.read(fd, 100) == b"mine\n"
    finally:
        os.close(fd)
    (rank / "link").symlink_to(secret)
    os.mkfifo(rank / "fifo")
    (rank / "folder").mkdir()
    os.link(secret, rank / "hard")
    for name in ("link", "fifo", "folder", "hard"):
        with pytest.raises(UnsafeWorkerFile):
            open_worker_file(rank, name)
    with pytest.raises(FileNotFoundError):
        open_worker_file(rank, "absent")
    (tmp_path / "attempt_0" / "1").symlink_to(rank)
    with pytest.raises(UnsafeWorkerFile):
        open_worker_file(tmp_path / "attempt_0" / "1", "stdout.log")


def _secret_file(folder: Path) -> tuple[Path, str]:
    """A root-only file (0600 in a 0700 folder) holding a random secret."""
    private = folder / "private"
    private.mkdir(mode=0o700)
    secret = "SECRET-" + secrets.token_hex(16)
    path = private / "shadow"
    path.write_text(secret + "\n")
    path.chmod(0o600)
    return path, secret


async def _hammer_logs(daemon: Served, job_id: str, secret: str, rounds: int) -> dict[int, int]:
    """Read the log ``rounds`` times (whole, tail, follow); returns the count of each status."""
    statuses: dict[int, int] = {}
    real = 0
    async with daemon.client() as c:

        async def once(i: int) -> None:
            nonlocal real
            params: dict[str, Any] = {"attempt": 0}
            if i % 3 == 1:
                params["tail"] = 5
            if i % 3 == 2:
                params.update(follow="true", tail=5)
                async with c.stream("GET", f"/jobs/{job_id}/logs", params=params) as r:
                    body = b""
                    if r.status_code == 200:
                        with_deadline = time.monotonic() + 0.2
                        async for chunk in r.aiter_raw():
                            body += chunk
                            if b"REAL-LOG-LINE" in body or time.monotonic() > with_deadline:
                                break
                    else:
                        body = await r.aread()
                    text = body.decode(errors="replace")
            else:
                r = await c.get(f"/jobs/{job_id}/logs", params=params)
                text = r.text
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert secret not in text, f"the secret leaked through {params}"
            if r.status_code == 200:
                real += "REAL-LOG-LINE" in text
            else:
                assert r.headers["content-type"] == "application/problem+json", text
            assert r.status_code in (200, 404), text

        for start in range(0, rounds, 10):
            async with asyncio.timeout(10):  # a stalled read fails the test, fast
                await asyncio.gather(*(once(i) for i in range(start, min(rounds, start + 10))))
        started = time.monotonic()
        assert (await c.get("/healthz")).status_code == 200
        assert time.monotonic() - started < 2.0
    assert real > 0, f"no read saw the real log: {statuses}"
    return statuses


@AS_ROOT
@NEEDS_SYSTEM_PY
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["symlink", "fifo"])
@pytest.mark.parametrize("as_user", ["nobody", "daemon-user"])
async def test_a_worker_swapping_its_log_never_leaks_a_root_file_or_stalls_the_api(
    open_tmp: Path, kind: str, as_user: str
) -> None:
    """A worker (as nobody through --run-as, or as the daemon's own user) swaps its stdout.log
    for a link to a root-only file, or for a FIFO, in a tight loop while the logs API is read
    300 times (whole, tail, follow): never the secret, never a 500, every answer prompt."""
    secret_path, secret = _secret_file(open_tmp)
    swapper = open_tmp / "swapper.py"
    swapper.write_text(SWAPPER)
    swapper.chmod(0o644)
    extra = ["--run-as", "nobody"] if as_user == "nobody" else []
    env = {"ELASTICD_ALLOW_ROOT": "false" if as_user == "nobody" else "true"}
    daemon = serve(open_tmp, *extra, env=env)
    try:
        async with asyncio.timeout(100), daemon.client() as c:
            await daemon.wait_ready()
            spec = {
                "id": "swap",
                "entrypoint": SYSTEM_PY,
                "args": [str(swapper), kind, str(secret_path)],
                "max_restarts": 0,
            }
            assert (await c.post("/jobs", json=spec)).status_code == 201
            await healthy_pids(c, "swap", 1)
            folder = open_tmp / "state" / "logs" / "swap" / "attempt_0" / "0"
            await eventually(lambda: (folder / "swapping").exists(), 20, "the swap loop")
            statuses = await _hammer_logs(daemon, "swap", secret, 300)
            assert statuses.get(200, 0) > 0, statuses
            await c.post("/jobs/swap/cancel", json={})
            await wait_job(c, "swap")
    finally:
        daemon.stop()
    assert secret not in daemon.output()


@AS_ROOT
@pytest.mark.slow
async def test_a_fifo_planted_as_the_log_gets_a_prompt_answer(open_tmp: Path) -> None:
    """A worker (as nobody) replaces its stdout.log with a FIFO: reading, tailing and following
    the log answer at once with a 404 problem that says why, and the daemon keeps serving."""
    daemon = serve(open_tmp, "--run-as", "nobody", env={"ELASTICD_ALLOW_ROOT": "false"})
    plant = (
        'cd "$(dirname "$TORCHELASTIC_ERROR_FILE")" && rm -f stdout.log && mkfifo stdout.log '
        "&& touch planted && exec sleep 600"
    )
    try:
        async with asyncio.timeout(60), daemon.client() as c:
            await daemon.wait_ready()
            spec = {"id": "fifo", "entrypoint": "/bin/sh", "args": ["-c", plant]}
            assert (await c.post("/jobs", json=spec)).status_code == 201
            folder = open_tmp / "state" / "logs" / "fifo" / "attempt_0" / "0"
            await eventually(lambda: (folder / "planted").exists(), 20, "the FIFO")
            for params in ({}, {"tail": 3}, {"attempt": 0, "follow": "true"}):
                started = time.monotonic()
                r = await c.get("/jobs/fifo/logs", params=params)
                assert time.monotonic() - started < 2.0, params
                assert r.status_code == 404, r.text
                assert r.headers["content-type"] == "application/problem+json"
                assert "not a regular file" in r.json()["detail"]
            assert (await c.get("/healthz")).status_code == 200
            await c.post("/jobs/fifo/cancel", json={})
    finally:
        daemon.stop()


# -- job documents written straight into the store -------------------------------------


def _job_document(job_id: str, ran: Path, **changes: Any) -> dict[str, Any]:
    """A job document as elasticd writes one, with ``changes``; its worker touches ``ran``."""
    doc: dict[str, Any] = {
        "id": job_id,
        "spec": {"entrypoint": "/bin/sh", "args": ["-c", f"touch {ran}"], "max_restarts": 0},
        "state": "PENDING",
        "max_restarts": 0,
        "created_at": time.time(),
    }
    doc.update(changes)
    return doc


async def _put(c: httpx.AsyncClient, key: str, value: bytes, lease: int | None = None) -> None:
    body = {"key": key, "value": base64.b64encode(value).decode(), "lease": lease}
    r = await c.put("/store/kv", json=body)
    assert r.status_code == 200, r.text


def _snapshot(folder: Path) -> tuple[int, int, int, list[str]]:
    st = folder.stat()
    return (st.st_mode, st.st_uid, st.st_gid, sorted(os.listdir(folder)))


@AS_ROOT
@pytest.mark.slow
async def test_job_documents_with_ids_that_name_other_folders_are_refused(open_tmp: Path) -> None:
    """Job documents put into the store directly with an absolute id, a relative id that climbs
    out of the log folder, an id that is not their key's, or max_restarts of 10**6: none runs,
    the folders they name are untouched (mode, owner, contents), and the refusal is said (a
    job.refused event of the key's job, or a record under refused/, and a log line)."""
    target = open_tmp / "target"
    target.mkdir(mode=0o755)
    (target / "marker").write_text("mine")
    before = _snapshot(target)
    ran = open_tmp / "ran"
    logs = open_tmp / "state" / "logs"
    relative = str(Path("..") / ".." / target.name)  # from <open_tmp>/state/logs
    assert relative.startswith("..")
    daemon = serve(open_tmp, "--run-as", "nobody", env={"ELASTICD_ALLOW_ROOT": "false"})
    bad = {
        f"job/{target}/.": _job_document(f"{target}/.", ran),
        "job/climb": _job_document(relative, ran),
        "job/mismatch": _job_document("other-id", ran),
        "job/restarts": _job_document("restarts", ran, max_restarts=10**6),
    }
    try:
        async with asyncio.timeout(60), daemon.client() as c:
            await daemon.wait_ready()
            for key, doc in bad.items():
                await _put(c, key, json.dumps(doc).encode())
            # A job submitted after them ends only once the daemon has seen every document.
            r = await c.post("/jobs", json={"id": "after", "entrypoint": "/bin/true"})
            assert r.status_code == 201
            assert (await wait_job(c, "after"))["state"] == "SUCCEEDED"
            for job_id in ("climb", "mismatch", "restarts"):
                # Every route on the job answers 409 naming the key; its events are in the store.
                r = await c.get(f"/jobs/{job_id}")
                assert r.status_code == 409 and "refused" in r.json()["detail"]
                listing = (await c.get("/store/list", params={"prefix": f"ev/{job_id}/"})).json()
                events = [json.loads(base64.b64decode(e["value"])) for e in listing["entries"]]
                assert [e["kind"] for e in events] == ["job.refused"], events
                assert "nothing on disk is touched" in events[0]["message"]
            listing = (await c.get("/store/list", params={"prefix": "refused/"})).json()
            records = [json.loads(base64.b64decode(e["value"])) for e in listing["entries"]]
            assert [r["key"] for r in records] == [f"job/{target}/."]
    finally:
        daemon.stop()
    assert _snapshot(target) == before
    assert not ran.exists()
    assert not (logs / "other-id").exists()
    assert sorted(p.name for p in logs.iterdir()) == ["after"]
    assert f"refusing the job document 'job/{target}/.'" in daemon.output()


# -- the log proxy -----------------------------------------------------------------------


class Capture:
    """A tiny HTTP server on loopback that records every request and sets a cookie."""

    def __init__(self) -> None:
        self.requests: list[bytes] = []
        self.server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with_head = await reader.readuntil(b"\r\n\r\n")
        self.requests.append(with_head)
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; charset=utf-8\r\n"
            b"Set-Cookie: session=stolen; Path=/\r\nX-Upstream: yes\r\n"
            b"Content-Length: 5\r\nConnection: close\r\n\r\nhello"
        )
        await writer.drain()
        writer.close()

    async def __aenter__(self) -> Capture:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


def _node_record(name: str, url: str) -> bytes:
    return json.dumps(
        {
            "name": name,
            "url": url,
            "addr": "127.0.0.1",
            "labels": {},
            "slots": 1,
            "free_slots": 1,
            "version": "0",
            "started_at": time.time(),
        }
    ).encode()


@pytest.mark.slow
async def test_the_log_proxy_sends_the_token_only_to_live_nodes_and_relays_no_cookie(
    tmp_path: Path,
) -> None:
    """`?node=` names a record without a lease, or one whose URL has a path, a query, user
    info, or another node's name: 404 problem, and the capture server those records point to
    receives nothing (the token never leaves). A live, well-formed record is proxied, and its
    Set-Cookie and other headers are not relayed."""
    token_file, token = make_token_file(tmp_path)
    daemon = serve(tmp_path, token_file=token_file)
    try:
        async with asyncio.timeout(60), Capture() as capture, daemon.client() as c:
            await daemon.wait_ready()
            # The caller is authorized for the job here first: it must exist.
            job = {"id": "any", "entrypoint": "/bin/true"}
            assert (await c.post("/jobs", json=job)).status_code == 201
            r = await c.post("/store/leases", json={"ttl": 60})
            lease = r.json()["lease"]
            port = capture.url.rsplit(":", 1)[1]
            await _put(c, "nodes/nolease", _node_record("nolease", capture.url))
            refused = {
                "nolease": None,
                "path": f"{capture.url}/steal",
                "query": f"{capture.url}?x=1",
                "userinfo": f"http://user:pw@127.0.0.1:{port}",
                "noport": "http://127.0.0.1",
                "scheme": f"ftp://127.0.0.1:{port}",
            }
            for name, url in refused.items():
                if url is not None:
                    await _put(c, f"nodes/{name}", _node_record(name, url), lease)
            await _put(c, "nodes/renamed", _node_record("someone-else", capture.url), lease)
            for name in [*refused, "renamed"]:
                r = await c.get("/jobs/any/logs", params={"node": name})
                assert r.status_code == 404, (name, r.text)
                assert r.headers["content-type"] == "application/problem+json"
            assert capture.requests == []
            await _put(c, "nodes/good", _node_record("good", capture.url), lease)
            r = await c.get("/jobs/any/logs", params={"node": "good"})
            assert (r.status_code, r.text) == (200, "hello")
            assert "set-cookie" not in r.headers and "x-upstream" not in r.headers
            assert r.headers["content-type"].startswith("text/plain")
            assert len(capture.requests) == 1
            # The cluster credential (here the token), only to the live, well-formed node.
            assert token.encode() in capture.requests[0]
    finally:
        daemon.stop()


# -- bounds ------------------------------------------------------------------------------


@pytest.mark.slow
async def test_live_streams_are_bounded_and_healthz_stays_fast(tmp_path: Path) -> None:
    """With max_streams = 16, 16 log follows are served, the 17th follow and an SSE stream get
    a 429 problem naming max_streams while /healthz answers at once; a stream that ends gives
    its slot back."""
    daemon = serve(tmp_path, env={"ELASTICD_MAX_STREAMS": "16"})
    try:
        async with asyncio.timeout(90), daemon.client() as c:
            await daemon.wait_ready()
            spec = {"id": "s", "entrypoint": "/bin/sh", "args": ["-c", "echo up; exec sleep 600"]}
            assert (await c.post("/jobs", json=spec)).status_code == 201
            await healthy_pids(c, "s", 1)
            params = {"follow": "true", "attempt": 0}
            async with contextlib.AsyncExitStack() as streams:
                for _ in range(16):
                    r = await streams.enter_async_context(
                        c.stream("GET", "/jobs/s/logs", params=params)
                    )
                    assert r.status_code == 200
                over = await c.get("/jobs/s/logs", params=params)
                assert over.status_code == 429, over.text
                assert over.headers["content-type"] == "application/problem+json"
                assert "max_streams" in over.json()["detail"]
                sse = await c.get("/jobs/s/events", headers={"Accept": "text/event-stream"})
                assert sse.status_code == 429
                took = []
                for _ in range(10):
                    started = time.monotonic()
                    assert (await c.get("/healthz")).status_code == 200
                    took.append(time.monotonic() - started)
                assert sorted(took)[5] < 0.5, took
            # The 16 streams are closed: their slots come back.
            deadline = time.monotonic() + 10
            while True:
                async with c.stream("GET", "/jobs/s/logs", params=params) as r:
                    if r.status_code == 200:
                        break
                assert time.monotonic() < deadline, "the closed streams kept their slots"
                await asyncio.sleep(0.05)
            await c.post("/jobs/s/cancel", json={})
    finally:
        daemon.stop()


@pytest.mark.slow
async def test_store_values_and_listings_are_bounded(tmp_path: Path) -> None:
    """A store value over 1 MiB is a 413 problem naming the limit and is not written; a listing
    over store_max_list_bytes is a 413 problem naming the prefix and the setting; the daemon
    keeps serving, and a narrower listing still works."""
    daemon = serve(tmp_path, env={"ELASTICD_STORE_MAX_LIST_BYTES": str(1 << 20)})
    try:
        async with asyncio.timeout(60), daemon.client() as c:
            await daemon.wait_ready()
            huge = base64.b64encode(b"x" * ((1 << 20) + 1)).decode()
            r = await c.put("/store/kv", json={"key": "huge", "value": huge})
            assert r.status_code == 413, r.text[:300]
            assert r.headers["content-type"] == "application/problem+json"
            assert str(1 << 20) in r.json()["detail"]
            assert (await c.get("/store/kv", params={"key": "huge"})).json() == {"entry": None}
            for i in range(3):
                await _put(c, f"bulk/{i}", b"y" * (512 * 1024))
            r = await c.get("/store/list", params={"prefix": "bulk/"})
            assert r.status_code == 413, r.text
            assert r.headers["content-type"] == "application/problem+json"
            assert "bulk/" in r.json()["detail"] and "store_max_list_bytes" in r.json()["detail"]
            r = await c.get("/store/list", params={"prefix": "bulk/1"})
            assert r.status_code == 200 and len(r.json()["entries"]) == 1
            assert (await c.get("/healthz")).status_code == 200
    finally:
        daemon.stop()


async def test_the_watch_history_is_bounded_in_bytes() -> None:
    """Large values do not pile up in the in-memory watch history: past max_list_bytes the
    oldest changes are compacted (a watch from before them is StoreCompacted), and a watch
    answer stays under the limit."""
    store = MemoryStore(max_list_bytes=1 << 20)
    async with asyncio.timeout(10):
        first = await store.put("big", b"a" * (400 * 1024))
        for _ in range(4):
            last = await store.put("big", b"b" * (400 * 1024))
        with pytest.raises(StoreCompacted):
            await store.watch("big", first.version - 1, 0)
        events = await store.watch("big", last.version - 2, 0)
        assert sum(len(e.value or b"") for e in events) <= 1 << 20
        assert events[-1].revision == last.version


def test_a_huge_error_file_is_cut_to_fit_the_store(tmp_path: Path) -> None:
    """A worker's 450 KB message and 450 KB traceback are cut (the traceback keeps its end), so the
    failure still fits a job document under the store's 1 MiB value limit."""
    rank = tmp_path / "attempt_0" / "0"
    rank.mkdir(parents=True)
    body = {
        "message": {"message": "m" * 450_000, "extraInfo": {"py_callstack": "t" * 450_000 + "END"}}
    }
    (rank / "error.json").write_text(json.dumps(body))
    error = read_error_file(rank / "error.json", default_timestamp=1.0)
    assert error is not None and error.traceback is not None
    assert len(error.message) < 17_000 and error.message.endswith("[... cut]")
    assert len(error.traceback) < 66_000 and error.traceback.endswith("END")


async def test_max_restarts_is_bounded(client: httpx.AsyncClient) -> None:
    """max_restarts over 1000 is a 422 problem naming the field; 1000 is accepted."""
    r = await client.post("/jobs", json={"entrypoint": "/bin/true", "max_restarts": 1001})
    assert r.status_code == 422, r.text
    assert r.headers["content-type"] == "application/problem+json"
    assert "max_restarts" in [e["field"] for e in r.json()["errors"]]
    r = await client.post(
        "/jobs", json={"entrypoint": "/bin/true", "max_restarts": 1000, "node_selector": {"x": "y"}}
    )
    assert r.status_code == 201, r.text
