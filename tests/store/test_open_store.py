"""open_store: choosing a backend from the store_url setting."""

from __future__ import annotations

from pathlib import Path

import pytest

from elasticd.errors import ConfigError
from elasticd.store import STORE_FILE, open_store
from elasticd.store.embedded import EmbeddedStore
from elasticd.store.etcd import EtcdStore
from elasticd.store.http import HttpStore

pytestmark = pytest.mark.timeout(10)


@pytest.mark.parametrize("url", [None, "", "  "])
async def test_no_url_is_the_embedded_store(tmp_path: Path, url: str | None) -> None:
    """No store_url opens the embedded store in state_dir/store.sqlite3."""
    store = open_store(url, token=None, state_dir=tmp_path)
    try:
        assert isinstance(store, EmbeddedStore)
        assert store.path == tmp_path / STORE_FILE
    finally:
        await store.close()


@pytest.mark.parametrize("url", ["http://node1:7070", "https://node1:7070/", "HTTP://n:1"])
async def test_http_url_is_an_http_store(tmp_path: Path, url: str) -> None:
    """An http(s) URL opens a client of the daemon serving the store there."""
    store = open_store(url, token="t", state_dir=tmp_path)
    try:
        assert isinstance(store, HttpStore)
        assert store.base_url == url.rstrip("/")
    finally:
        await store.close()


@pytest.mark.parametrize(
    ("url", "endpoints"),
    [
        ("etcd://h1:2379,h2:2380", ["http://h1:2379", "http://h2:2380"]),
        ("etcd://h1", ["http://h1:2379"]),
        ("etcd+https://h1:2379, h2", ["https://h1:2379", "https://h2:2379"]),
        ("etcd://[::1]:2379", ["http://[::1]:2379"]),
    ],
)
async def test_etcd_url_is_an_etcd_store(tmp_path: Path, url: str, endpoints: list[str]) -> None:
    """An etcd:// URL lists the endpoints to fail over between, port 2379 by default."""
    store = open_store(url, token=None, state_dir=tmp_path)
    try:
        assert isinstance(store, EtcdStore)
        assert store.endpoints == endpoints
    finally:
        await store.close()


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("node1:7070", "no scheme"),
        ("ftp://node1", "unknown scheme"),
        ("http://", "no host"),
        ("etcd://", "host:port"),
        ("etcd://h1,,h2", "host:port"),
        ("etcd://h1:2379/path", "host:port"),
    ],
)
def test_bad_url_is_a_config_error(tmp_path: Path, url: str, message: str) -> None:
    """Any other store_url is a ConfigError that says what is expected."""
    with pytest.raises(ConfigError, match=message) as caught:
        open_store(url, token=None, state_dir=tmp_path)
    assert "etcd://" in str(caught.value) or "host:port" in str(caught.value)
