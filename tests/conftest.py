"""Shared fixtures: a daemon in a temp dir, an HTTP client over ASGI, tiny worker scripts."""

from __future__ import annotations

import asyncio
import os
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.app import create_app
from elasticd.config import load_config
from elasticd.node.daemon import Daemon
from elasticd.testing import MemoryStore
from tests.normal_user import nobody_clone  # noqa: F401  (a fixture: nobody's clone and venv)
from tests.users import users  # noqa: F401  (a fixture: throwaway Unix users)

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}


def script(tmp_path: Path, name: str, body: str) -> str:
    """Write a small worker script and return its path."""
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def make_daemon(
    tmp_path: Path, *, token: str | None = None, persistent: bool = False, **overrides: Any
) -> Daemon:
    """A daemon in ``tmp_path``: an in-memory store, or with ``persistent`` its embedded one."""
    flags: dict[str, Any] = {
        "state_dir": str(tmp_path / "state"),
        "node_name": "node-a",
        "slots": 8,
        "port": 0,
        **overrides,
    }
    environ = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICD_")}
    if token is not None:
        environ["ELASTICD_TOKEN"] = token
    return Daemon(
        load_config(flags, environ={}),
        store=None if persistent else MemoryStore(),
        serve_http=False,
        environ=environ,
    )


@pytest.fixture
async def daemon(tmp_path: Path) -> AsyncIterator[Daemon]:
    d = make_daemon(tmp_path)
    async with asyncio.timeout(30):
        await d.start()
    try:
        yield d
    finally:
        async with asyncio.timeout(60):
            await d.shutdown()


def asgi_client(daemon: Daemon, **kwargs: Any) -> httpx.AsyncClient:
    """An HTTP client of ``daemon``'s app over ASGI, as its admin (the daemon's own token)."""
    headers = {"Authorization": f"Bearer {daemon.token}", **kwargs.pop("headers", {})}
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=create_app(daemon)),
        base_url="http://localhost",
        headers=headers,
        **kwargs,
    )


@pytest.fixture
async def client(daemon: Daemon) -> AsyncIterator[httpx.AsyncClient]:
    async with asgi_client(daemon) as c:
        yield c


async def wait_job(
    client: httpx.AsyncClient, job_id: str, states: set[str] = TERMINAL, timeout: float = 60
) -> dict[str, Any]:
    """Follow the job's events (long-poll) until a ``job.state`` event names one of ``states``."""
    after = 0
    async with asyncio.timeout(timeout):
        while True:
            r = await client.get(f"/jobs/{job_id}/events", params={"after": after, "wait": 10})
            events = r.json()
            for event in events:
                after = event["seq"]
                if event["kind"] == "job.state" and event["state"] in states:
                    return dict((await client.get(f"/jobs/{job_id}")).json())


async def events_of(client: httpx.AsyncClient, job_id: str) -> list[dict[str, Any]]:
    r = await client.get(f"/jobs/{job_id}/events")
    assert r.status_code == 200
    return list(r.json())


async def wait_group(
    client: httpx.AsyncClient, job_id: str, states: set[str], timeout: float = 60
) -> dict[str, Any]:
    """Follow the job's events until every published group is in one of ``states``."""
    after = 0
    async with asyncio.timeout(timeout):
        while True:
            view = (await client.get(f"/jobs/{job_id}/workers")).json()
            if view["groups"] and all(g["state"] in states for g in view["groups"]):
                return dict(view)
            r = await client.get(f"/jobs/{job_id}/events", params={"after": after, "wait": 10})
            events = r.json()
            if events:
                after = events[-1]["seq"]
