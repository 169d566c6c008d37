"""Fixtures of the observability tests: a live (real-socket) daemon."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from elasticd.node.daemon import Daemon
from tests.observability.support import live_daemon


@pytest.fixture
async def live(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Daemon]:
    d = live_daemon(tmp_path)
    async with asyncio.timeout(30):
        await d.start()
    # The CLI and clients of these tests are the daemon's admin: they use its own token.
    monkeypatch.setenv("ELASTICD_TOKEN_FILE", str(d.token_path))
    try:
        yield d
    finally:
        async with asyncio.timeout(60):
            await d.shutdown()
