"""Fixtures for the worker-group tests (helpers live in :mod:`.support`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from .support import Workers


@pytest.fixture
async def workers(tmp_path: Path) -> AsyncIterator[Workers]:
    """A `Workers` factory; whatever a test leaves running is killed at teardown."""
    factory = Workers(tmp_path)
    try:
        yield factory
    finally:
        async with asyncio.timeout(30):
            await factory.stop_all()
