"""Fixtures of the hardening tests."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def open_tmp() -> Iterator[Path]:
    """A temporary folder other users can reach (pytest's own is 0700 under a 0700 parent)."""
    path = Path(tempfile.mkdtemp(prefix="elasticd-hardening-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
