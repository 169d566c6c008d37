"""Fixtures shared by the end-to-end tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.etcd_cluster import EtcdCluster


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdCluster]:
    """A 3-member etcd cluster on loopback for one test."""
    with EtcdCluster(tmp_path / "etcd") as cluster:
        yield cluster
