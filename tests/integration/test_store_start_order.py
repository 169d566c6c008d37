"""Daemons of a cluster start in any order (issue 12, defect 8).

``elasticd serve --store-url URL`` started before its store waits for it:
``/healthz`` answers, ``/readyz`` is 503 and says what is awaited, the log
says so once, SIGTERM still stops it cleanly, and it joins the cluster by
itself the moment the store comes up.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.cluster import TOKEN, LocalCluster, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

AUTH = {"Authorization": f"Bearer {TOKEN}"}


def serve(tmp_path: Path, name: str, store_url: str, token_file: Path) -> subprocess.Popen[bytes]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICD_")}
    env["ELASTICD_ALLOW_ROOT"] = "true"
    with (tmp_path / f"{name}.log").open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "elasticd", "serve", "--port", str(port), "--node-name", name,
             "--state-dir", str(tmp_path / name), "--token-file", str(token_file),
             "--store-url", store_url],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    proc.port = port  # type: ignore[attr-defined]
    return proc


async def poll(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = await predicate()
        except httpx.TransportError:
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def test_a_daemon_started_before_its_store_waits_then_joins(tmp_path):
    cluster = LocalCluster(tmp_path)
    store_port = free_port()
    late = serve(tmp_path, "late", f"http://127.0.0.1:{store_port}", cluster.token_file)
    try:
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{late.port}", headers=AUTH, timeout=10
        ) as c:

            async def waiting():
                r = await c.get("/readyz")
                return (
                    r
                    if r.status_code == 503
                    and "waiting for the store" in (r.json().get("reason") or "")
                    else None
                )

            await poll(waiting, 30, "/readyz to say it waits for the store")
            assert (await c.get("/healthz")).status_code == 200
            assert late.poll() is None
            # The store comes up on the port the late daemon was told about.
            cluster.start("n0", port=store_port)

            async def joined():
                ready = (await c.get("/readyz")).status_code == 200
                names = {n["name"] for n in (await c.get("/nodes")).json()} if ready else set()
                return "late" in names

            await poll(joined, 30, "the late daemon to be ready and registered")
        log = (tmp_path / "late.log").read_text()
        assert log.count("not reachable yet") == 1, log
        assert "Traceback" not in log, log
    finally:
        late.send_signal(signal.SIGTERM)
        late.wait(30)
        cluster.stop_all()
    assert late.returncode == 0


async def test_sigterm_while_waiting_for_the_store_exits_cleanly(tmp_path):
    cluster = LocalCluster(tmp_path)
    late = serve(tmp_path, "late", f"http://127.0.0.1:{free_port()}", cluster.token_file)
    try:
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{late.port}", headers=AUTH, timeout=10
        ) as c:

            async def waiting():
                return (await c.get("/readyz")).status_code == 503

            await poll(waiting, 30, "the daemon to answer /readyz")
        late.send_signal(signal.SIGTERM)
        assert late.wait(15) == 0
        log = (tmp_path / "late.log").read_text()
        assert "Traceback" not in log, log
    finally:
        if late.poll() is None:
            late.kill()
            late.wait()
