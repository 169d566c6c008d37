"""``python -m api.store_server`` as a real process: start-up, SIGTERM, kill -9 mid-write."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import statistics
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from elasticd.errors import StoreUnavailable
from elasticd.store.http import HttpStore
from elasticd.store.memory import MemoryStore

from .conftest import TOKEN, serving

pytestmark = pytest.mark.timeout(90)

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


class StoreProcess:
    """A store server subprocess and the URL it announced."""

    def __init__(self, process: asyncio.subprocess.Process, url: str) -> None:
        self.process = process
        self.url = url


async def _start(state_dir: Path, token_file: Path, *extra: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "api.store_server",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--state-dir",
        str(state_dir),
        "--token-file",
        str(token_file),
        *extra,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=_env(),
        cwd=ROOT,
    )


@asynccontextmanager
async def store_process(state_dir: Path) -> AsyncIterator[StoreProcess]:
    """Start the server on a free port, wait for its 'listening on' line, kill it at the end."""
    token_file = state_dir / "token"
    token_file.write_text(TOKEN + "\n")
    process = await _start(state_dir, token_file)
    try:
        assert process.stdout is not None
        async with asyncio.timeout(20):
            line = (await process.stdout.readline()).decode()
        if not line.startswith("listening on http://127.0.0.1:"):
            assert process.stderr is not None
            err = (await process.stderr.read()).decode()
            pytest.fail(f"unexpected first line {line!r}; stderr: {err}")
        yield StoreProcess(process, line.split()[-1])
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()


async def test_sigterm_exits_zero(tmp_path: Path) -> None:
    """The server announces its URL, serves, and exits 0 on SIGTERM."""
    async with store_process(tmp_path) as server:
        async with HttpStore(server.url, TOKEN) as client:
            await client.put("/a", b"1")
        server.process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(15):
            assert await server.process.wait() == 0


async def test_refuses_non_loopback_without_token(tmp_path: Path) -> None:
    """Without a token the server refuses to bind a non-loopback address, with exit status 2."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "api.store_server",
        "--host",
        "0.0.0.0",
        "--port",
        "0",
        "--state-dir",
        str(tmp_path),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=_env(),
        cwd=ROOT,
    )
    async with asyncio.timeout(20):
        _, err = await process.communicate()
    assert process.returncode == 2
    assert b"without a token" in err


async def test_empty_token_file_is_refused(tmp_path: Path) -> None:
    """An empty token file stops the server with exit status 2 and names the file."""
    token_file = tmp_path / "token"
    token_file.write_text("\n")
    process = await _start(tmp_path, token_file)
    async with asyncio.timeout(20):
        _, err = await process.communicate()
    assert process.returncode == 2
    assert str(token_file).encode() in err


@pytest.mark.slow
async def test_kill_9_mid_write_loses_no_acknowledged_write(tmp_path: Path) -> None:
    """20 clients write; after kill -9 and a restart every acknowledged write is there."""
    acked: dict[str, bytes] = {}
    chains: dict[str, int] = {}  # CAS chain key -> last acknowledged version
    versions: list[int] = []
    enough = asyncio.Event()

    async with store_process(tmp_path) as server:

        async def writer(client_id: int) -> None:
            async with HttpStore(server.url, TOKEN, timeout=5) as client:
                chain = f"/crash/{client_id}/chain"
                version: int | None = None
                for i in range(1_000_000):
                    try:
                        key = f"/crash/{client_id}/{i}"
                        value = f"{client_id}:{i}".encode()
                        entry = await client.put(key, value)
                        acked[key] = value
                        versions.append(entry.version)
                        result = await client.compare_and_set(chain, value, version)
                        assert result.ok
                        assert result.entry is not None
                        version = chains[chain] = result.entry.version
                    except StoreUnavailable:
                        return
                    if len(acked) >= 400:
                        enough.set()

        writers = [asyncio.create_task(writer(c)) for c in range(20)]
        async with asyncio.timeout(60):
            await enough.wait()
        server.process.kill()  # kill -9 while the writers are mid-request
        async with asyncio.timeout(30):
            await asyncio.gather(*writers)
        assert await server.process.wait() == -signal.SIGKILL

    highest = max(versions + list(chains.values()))
    async with store_process(tmp_path) as again, HttpStore(again.url, TOKEN) as client:
        listing = await client.list("/crash/")
        found = {e.key: e for e in listing.entries}
        missing = [k for k in acked if k not in found or found[k].value != acked[k]]
        assert not missing, f"{len(missing)} acknowledged writes lost, e.g. {missing[:3]}"
        for chain, version in chains.items():
            # The chain may be one write ahead: a CAS can commit just before the kill
            # without its answer reaching the client.
            assert found[chain].version >= version
        assert listing.revision >= highest
        after = await client.put("/after-restart", b"x")
        assert after.version > highest  # revisions never go back
        again.process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(15):
            assert await again.process.wait() == 0

    with sqlite3.connect(tmp_path / "store.sqlite3") as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


async def test_responses_are_not_delayed_by_nagle() -> None:
    """Over real sockets a request takes about a millisecond, not Nagle's ~40 ms."""
    store = MemoryStore()
    async with serving(store) as url, HttpStore(url, TOKEN) as client:
        await client.put("/warm", b"x")
        timings = []
        for i in range(15):
            started = time.perf_counter()
            await client.put("/k", str(i).encode())
            timings.append(time.perf_counter() - started)
    await store.close()
    assert statistics.median(timings) < 0.02, f"median {statistics.median(timings) * 1000:.1f} ms"
