"""The real `elasticd serve` process: systemd notify, ordered shutdown on signals, bind refusal."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import PY, script

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


#: The daemons' token (ELASTICD_TOKEN): every caller has an identity.
TOKEN = "daemon-process-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def start_daemon(
    tmp_path: Path, port: int, env_extra: dict[str, str] | None = None, *extra: str
) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICD_")}
    env["ELASTICD_ALLOW_ROOT"] = "true"  # CI runs as root: jobs run as the test's user
    env["ELASTICD_TOKEN"] = TOKEN
    env.update(env_extra or {})
    with (tmp_path / f"daemon-{port}.log").open("wb") as out:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "elasticd",
                "serve",
                "--port",
                str(port),
                "--state-dir",
                str(tmp_path / "state"),
                "--node-name",
                "proc-node",
                *extra,
            ],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def output_of(tmp_path: Path, port: int) -> bytes:
    return (tmp_path / f"daemon-{port}.log").read_bytes()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
async def test_notify_and_ordered_shutdown(tmp_path, sig):
    """READY=1 once serving; on SIGTERM/SIGINT: STOPPING=1, workers killed, events flushed, exit 0."""
    notify_path = tmp_path / "notify.sock"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(notify_path))
    notify.setblocking(False)
    loop = asyncio.get_running_loop()
    port = free_port()
    # The worker ignores SIGTERM, so shutdown must escalate to SIGKILL after the grace.
    stubborn = script(
        tmp_path,
        "stubborn.py",
        """
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ready", flush=True)
        time.sleep(600)
    """,
    )
    proc = start_daemon(tmp_path, port, {"NOTIFY_SOCKET": str(notify_path)})
    try:
        async with asyncio.timeout(60):
            ready = await loop.sock_recv(notify, 4096)
            assert b"READY=1" in ready
            async with httpx.AsyncClient(headers=AUTH, base_url=f"http://127.0.0.1:{port}") as c:
                r = await c.post(
                    "/jobs",
                    json={
                        "id": "j",
                        "entrypoint": PY,
                        "args": [stubborn],
                        "nproc_per_node": 2,
                        "termination_grace": 0.5,
                    },
                )
                assert r.status_code == 201
                pids: list[int] = []
                while not pids:
                    view = (await c.get("/jobs/j/workers")).json()
                    groups = [g for g in view["groups"] if g["state"] == "HEALTHY"]
                    pids = [w["pid"] for w in groups[0]["workers"]] if groups else []
                    if not pids:
                        await c.get("/jobs/j/events", params={"wait": 1, "after": 0})
                log_file = tmp_path / "state" / "logs" / "j" / "attempt_0" / "0" / "stdout.log"
                await wait_until(
                    lambda: log_file.exists() and log_file.read_text() == "ready\n",
                    20,
                    "worker to install its SIGTERM handler",
                )
            started = time.monotonic()
            proc.send_signal(sig)
            stopping = await loop.sock_recv(notify, 4096)
            assert b"STOPPING=1" in stopping
            code = await asyncio.to_thread(proc.wait, 30)
            assert code == 0
            assert time.monotonic() - started < 10
            for pid in pids:
                assert not pid_alive(pid)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        notify.close()
    # The events were flushed: a new daemon on the same state dir shows the end.
    port2 = free_port()
    proc2 = start_daemon(tmp_path, port2)
    try:
        async with (
            asyncio.timeout(30),
            httpx.AsyncClient(headers=AUTH, base_url=f"http://127.0.0.1:{port2}") as c,
        ):
            while True:
                try:
                    job = (await c.get("/jobs/j")).json()
                    break
                except httpx.TransportError:
                    await asyncio.sleep(0.05)
            # Stopped for the daemon's sake, not the job's: it resumes, never FAILED.
            assert job["state"] in ("RESTARTING", "RUNNING"), job
            kinds = [e["kind"] for e in (await c.get("/jobs/j/events")).json()]
            assert "workers.stopped" in kinds and "daemon.stopped" in kinds
    finally:
        proc2.terminate()
        proc2.wait(30)


def test_port_in_use_is_a_clear_error(tmp_path):
    """A port already taken exits 2 naming the address, not a traceback."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = start_daemon(tmp_path, port)
        proc.wait(timeout=30)
    out = output_of(tmp_path, port)
    assert proc.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}".encode() in out
    assert b"Traceback" not in out
