"""Helpers for the observability tests: a daemon serving real HTTP on loopback, SSE reading."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx

from elasticd.client import ServerSentEvent, SSEParser
from elasticd.config import load_config
from elasticd.node.daemon import Daemon
from elasticd.testing import MemoryStore

CRASH_ONCE = """
import os, sys, time
print("rank", os.environ["RANK"], "attempt", os.environ["TORCHELASTIC_RESTART_COUNT"], flush=True)
if os.environ["LOCAL_RANK"] == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    time.sleep(0.2)
    print("crashing", file=sys.stderr, flush=True)
    sys.exit(3)
"""


def live_daemon(tmp_path: Path, *, token: str | None = None, **overrides: Any) -> Daemon:
    """A daemon with its HTTP server on a free loopback port (in this event loop)."""
    flags: dict[str, Any] = {
        "state_dir": str(tmp_path / "state"),
        "node_name": "node-a",
        "slots": 8,
        "port": 0,
        "host": "127.0.0.1",
        **overrides,
    }
    environ = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICD_")}
    if token is not None:
        environ["ELASTICD_TOKEN"] = token
    return Daemon(
        load_config(flags, environ={}), store=MemoryStore(), serve_http=True, environ=environ
    )


def url_of(daemon: Daemon) -> str:
    return f"http://127.0.0.1:{daemon.config.port}"


def auth(daemon: Daemon) -> dict[str, str]:
    """The headers of the daemon's admin (its own token): every caller has an identity."""
    return {"Authorization": f"Bearer {daemon.token}"}


async def read_sse(response: httpx.Response) -> list[ServerSentEvent]:
    """Every SSE message of a response, until the server ends the stream."""
    parser = SSEParser()
    messages: list[ServerSentEvent] = []
    async for text in response.aiter_text():
        messages.extend(parser.feed(text))
    return messages
