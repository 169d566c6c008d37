"""Helpers for the worker-side library tests: tiny Python workers and a real store server.

Workers are ``sys.executable -c <code>`` children that import ``elasticd.worker``
but not torch, so they start in well under a second. The store server is the
real ``/store`` app under uvicorn on a loopback port, run in a thread with its
own event loop, so that synchronous clients (as used inside workers) can be
tested from plain test functions.
"""

from __future__ import annotations

import asyncio
import os
import queue
import sys
import textwrap
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from api.store_server import serve_store
from elasticd.store.memory import MemoryStore

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The test's environment minus anything elasticd-specific, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTICD_", "TORCHELASTIC_"))}
    env["PYTHONPATH"] = str(ROOT)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone: it cannot act)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


async def spawn(code: str, env: Mapping[str, str], **kwargs: object) -> asyncio.subprocess.Process:
    """Start ``python -c code`` with stdout/stderr piped."""
    return await asyncio.create_subprocess_exec(
        PY,
        "-c",
        textwrap.dedent(code),
        env=dict(env),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        **kwargs,  # type: ignore[arg-type]
    )


async def read_line(proc: asyncio.subprocess.Process, prefix: bytes) -> bytes:
    """Wait until the child prints a stdout line starting with ``prefix``; return it."""
    assert proc.stdout is not None
    while True:
        line = await proc.stdout.readline()
        if not line:
            raise AssertionError(f"child exited before printing {prefix!r}")
        if line.startswith(prefix):
            return line


async def finish(proc: asyncio.subprocess.Process) -> None:
    """Kill the child if it still runs, and reap it."""
    if proc.returncode is None:
        try:
            proc.kill()
        except ProcessLookupError:
            pass
    await proc.wait()


@contextmanager
def store_server(token: str | None = None, store: MemoryStore | None = None) -> Iterator[str]:
    """Serve ``store`` (default: a fresh in-memory one) on a free loopback port from a
    thread; yields its URL."""
    urls: queue.Queue[str | BaseException] = queue.Queue()
    ready: queue.Queue[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = queue.Queue()

    async def main() -> None:
        stop = asyncio.Event()
        ready.put((asyncio.get_running_loop(), stop))
        await serve_store(
            MemoryStore() if store is None else store,
            host="127.0.0.1",
            port=0,
            token=token,
            stop=stop,
            on_listening=urls.put,
        )

    def run() -> None:
        try:
            asyncio.run(main())
        except BaseException as exc:  # surface start-up errors to the test
            urls.put(exc)

    thread = threading.Thread(target=run, name="store-server", daemon=True)
    thread.start()
    loop, stop = ready.get(timeout=10)
    url = urls.get(timeout=10)
    if isinstance(url, BaseException):
        raise url
    try:
        yield url
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(timeout=10)
