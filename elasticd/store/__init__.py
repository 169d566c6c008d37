"""The cluster store: the only state daemons share.

See :mod:`elasticd.store.base` for the interface and its semantics. The
backends, all passing one conformance suite (``tests/store``):

* :mod:`~elasticd.store.memory` — in-memory, the reference and the test fake;
* :mod:`~elasticd.store.embedded` — the in-memory store journaled to SQLite,
  what a daemon serves at ``/store/...`` by default;
* :mod:`~elasticd.store.http` — a client of a daemon serving the store;
* :mod:`~elasticd.store.etcd` — etcd v3 through its JSON gateway.

:func:`open_store` picks one from the ``store_url`` setting. The backends are
imported when chosen, so importing this package stays cheap (worker processes
import the interface).
"""

from __future__ import annotations

from pathlib import Path

from elasticd.errors import ConfigError
from elasticd.store.base import (
    DEFAULT_MAX_LIST_BYTES,
    DEFAULT_MAX_VALUE_BYTES,
    CasResult,
    Entry,
    Listing,
    Store,
    WatchEvent,
)

__all__ = [
    "DEFAULT_MAX_LIST_BYTES",
    "DEFAULT_MAX_VALUE_BYTES",
    "STORE_FILE",
    "CasResult",
    "Entry",
    "Listing",
    "Store",
    "WatchEvent",
    "open_store",
]

#: The embedded store's file under the daemon's state directory.
STORE_FILE = "store.sqlite3"

_URL_HELP = (
    "expected nothing (embedded store), http(s)://host:port of a daemon that serves "
    "the store, or etcd://host:port[,host:port...] (etcd+https:// for TLS)"
)


def open_store(
    url: str | None,
    *,
    token: str | None,
    state_dir: Path,
    timeout: float = 10.0,
    max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
    max_list_bytes: int = DEFAULT_MAX_LIST_BYTES,
) -> Store:
    """The store that ``url`` (the ``store_url`` setting) names.

    * ``None`` or ``""``: the embedded store in ``state_dir/store.sqlite3``;
    * ``http://host:port`` / ``https://...``: the store served by that daemon,
      authenticated with ``token``;
    * ``etcd://h1:2379,h2:2379`` (``etcd+https://`` for TLS): etcd, failing
      over between the endpoints in order.

    Raises :class:`~elasticd.errors.ConfigError` for any other URL.
    """
    if url is None or not url.strip():
        from elasticd.store.embedded import EmbeddedStore

        return EmbeddedStore(
            Path(state_dir) / STORE_FILE,
            max_value_bytes=max_value_bytes,
            max_list_bytes=max_list_bytes,
        )
    url = url.strip()
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if not sep:
        raise ConfigError(f"store_url {url!r} has no scheme; {_URL_HELP}")
    if scheme in ("http", "https"):
        host = rest.split("/", 1)[0]
        if not host or host.startswith(":"):
            raise ConfigError(f"store_url {url!r} has no host; {_URL_HELP}")
        from elasticd.store.http import HttpStore

        return HttpStore(
            url,
            token,
            timeout=timeout,
            max_value_bytes=max_value_bytes,
            max_list_bytes=max_list_bytes,
        )
    if scheme in ("etcd", "etcd+http", "etcd+https"):
        endpoint_scheme = "https" if scheme == "etcd+https" else "http"
        hosts = [h.strip() for h in rest.rstrip("/").split(",")]
        if not hosts or any(not h or "/" in h or h.startswith(":") for h in hosts):
            raise ConfigError(
                f"store_url {url!r}: etcd endpoints must be host:port separated by commas"
            )
        endpoints = [f"{endpoint_scheme}://{h if _has_port(h) else h + ':2379'}" for h in hosts]
        from elasticd.store.etcd import EtcdStore

        return EtcdStore(
            endpoints,
            timeout=timeout,
            max_value_bytes=max_value_bytes,
            max_list_bytes=max_list_bytes,
        )
    raise ConfigError(f"store_url {url!r} has an unknown scheme {scheme!r}; {_URL_HELP}")


def _has_port(host: str) -> bool:
    if host.startswith("["):  # [::1]:2379
        return "]:" in host
    return ":" in host
