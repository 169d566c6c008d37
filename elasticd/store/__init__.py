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
import the interface). :func:`store_endpoints` parses the URL without
opening anything, for the daemon's start-up checks (a plaintext,
unauthenticated store beyond loopback is refused before any connection, see
:func:`elasticd.config.check_store`); :class:`EtcdOptions` carries etcd's
user, TLS files and key prefix. A URL never holds credentials: one with a
``user@`` part is refused, and shown with that part replaced by ``***``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

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
    "EtcdOptions",
    "Listing",
    "Store",
    "WatchEvent",
    "StoreEndpoints",
    "open_store",
    "redact_url",
    "store_endpoints",
]

#: The embedded store's file under the daemon's state directory.
STORE_FILE = "store.sqlite3"

_URL_HELP = (
    "expected nothing (embedded store), http(s)://host:port of a daemon that serves "
    "the store, or etcd://host:port[,host:port...] (etcds:// for TLS)"
)

_ETCD_PLAIN = ("etcd", "etcd+http")
_ETCD_TLS = ("etcds", "etcd+https")


@dataclass(frozen=True)
class EtcdOptions:
    """How elasticd reaches etcd securely (the ``store_*`` settings).

    ``username``/``password``: an etcd user (password authentication through
    the gateway's ``/v3/auth/authenticate``); ``ca_file``: the CA that signed
    etcd's server certificate (default: the system's CAs); ``cert_file`` and
    ``key_file``: this daemon's client certificate, for etcd's
    ``--client-cert-auth``; ``prefix``: every key lives under it.
    """

    username: str | None = None
    password: str | None = field(default=None, repr=False)
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    prefix: str = ""


@dataclass(frozen=True)
class StoreEndpoints:
    """What a ``store_url`` names: its kind, endpoint URLs, and whether it uses TLS."""

    kind: str  # "embedded", "http" (a daemon's store) or "etcd"
    urls: list[str]
    tls: bool

    @property
    def hosts(self) -> list[str]:
        """The host of each endpoint (no brackets, no port)."""
        return [urlsplit(u).hostname or "" for u in self.urls]


def redact_url(url: str) -> str:
    """``url`` with any ``user:password@`` part shown as ``***@``, safe to print."""
    scheme, sep, rest = url.partition("://")
    if "@" not in rest:
        return url
    # Everything up to the last "@": a password may itself hold "/", "@" or ":".
    return f"{scheme}{sep}***@{rest.rpartition('@')[2]}"


def store_endpoints(url: str | None) -> StoreEndpoints:
    """Parse ``url`` (the ``store_url`` setting) without connecting anywhere.

    Raises :class:`~elasticd.errors.ConfigError` for a URL that is not one
    of those :func:`open_store` takes, or that has credentials in it.
    """
    if url is None or not url.strip():
        return StoreEndpoints("embedded", [], tls=False)
    url = url.strip()
    shown = redact_url(url)
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if not sep:
        raise ConfigError(f"store_url {shown!r} has no scheme; {_URL_HELP}")
    if "@" in rest:
        raise ConfigError(
            f"store_url {shown!r} has credentials in it: they would show wherever the URL is "
            "printed. For etcd set store_username and store_password_file; for a daemon's "
            "store, token_file"
        )
    if scheme in ("http", "https"):
        host = rest.split("/", 1)[0]
        if not host or host.startswith(":"):
            raise ConfigError(f"store_url {shown!r} has no host; {_URL_HELP}")
        return StoreEndpoints("http", [url], tls=scheme == "https")
    if scheme in _ETCD_PLAIN + _ETCD_TLS:
        tls = scheme in _ETCD_TLS
        hosts = [h.strip() for h in rest.rstrip("/").split(",")]
        if not hosts or any(not h or "/" in h or h.startswith(":") for h in hosts):
            raise ConfigError(
                f"store_url {shown!r}: etcd endpoints must be host:port separated by commas"
            )
        endpoint_scheme = "https" if tls else "http"
        urls = [f"{endpoint_scheme}://{h if _has_port(h) else h + ':2379'}" for h in hosts]
        return StoreEndpoints("etcd", urls, tls=tls)
    raise ConfigError(f"store_url {shown!r} has an unknown scheme {scheme!r}; {_URL_HELP}")


def open_store(
    url: str | None,
    *,
    token: str | None,
    state_dir: Path,
    timeout: float = 10.0,
    max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
    max_list_bytes: int = DEFAULT_MAX_LIST_BYTES,
    etcd: EtcdOptions | None = None,
    lease_ttl: float | None = None,
    history_keep: float | None = None,
) -> Store:
    """The store that ``url`` (the ``store_url`` setting) names.

    * ``None`` or ``""``: the embedded store in ``state_dir/store.sqlite3``;
    * ``http://host:port`` / ``https://...``: the store served by that daemon,
      authenticated with ``token``;
    * ``etcd://h1:2379,h2:2379`` (``etcds://`` or ``etcd+https://`` for TLS):
      etcd, failing over between the endpoints in order, as ``etcd`` says.
      With ``lease_ttl`` every etcd call is bounded as
      :func:`etcd_call_timeouts` says, not by ``timeout``; with ``lease_ttl`` every
      call to another daemon's store (its wait for a turn included) is bounded by
      the second of those, two thirds of the lease.

    ``history_keep``: the embedded store's ``history_keep`` (seconds; default its own).

    Raises :class:`~elasticd.errors.ConfigError` for any other URL.
    """
    target = store_endpoints(url)
    if target.kind == "embedded":
        from elasticd.store.embedded import EmbeddedStore
        from elasticd.store.memory import DEFAULT_HISTORY_KEEP

        return EmbeddedStore(
            Path(state_dir) / STORE_FILE,
            max_value_bytes=max_value_bytes,
            max_list_bytes=max_list_bytes,
            history_keep=DEFAULT_HISTORY_KEEP if history_keep is None else history_keep,
        )
    if target.kind == "http":
        from elasticd.store.http import HttpStore

        # Every call for the API, the lease and the agents answers within two thirds of
        # the lease (503 naming the wait), also on a link that accepts and never answers.
        return HttpStore(
            target.urls[0],
            token,
            timeout=timeout if lease_ttl is None else etcd_call_timeouts(lease_ttl, timeout)[1],
            max_value_bytes=max_value_bytes,
            max_list_bytes=max_list_bytes,
        )
    from elasticd.store.etcd import EtcdStore

    attempt, deadline = (
        (timeout, None) if lease_ttl is None else etcd_call_timeouts(lease_ttl, timeout)
    )
    return EtcdStore(
        target.urls,
        timeout=attempt,
        deadline=deadline,
        max_value_bytes=max_value_bytes,
        max_list_bytes=max_list_bytes,
        options=etcd,
    )


def etcd_call_timeouts(lease_ttl: float, longest: float = 10.0) -> tuple[float, float]:
    """How long one request to one etcd member, and one call with fail-over, may take.

    A third and two thirds of the node lease, at least 1 s and 2 s (with the
    default 3 s lease: 1 s, 2 s), at most ``longest`` each.

    Without quorum, etcd holds a read or a write for its own request timeout
    (5 s plus two election timeouts) before it says so. A node must keep its
    lease alive within ``lease_ttl`` and fence when it cannot, and API calls
    must answer (503) while the store is away, so no call may take longer than
    a fraction of the lease. A healthy etcd answers in milliseconds.
    """
    return min(longest, max(1.0, lease_ttl / 3)), min(longest, max(2.0, lease_ttl * 2 / 3))


def _has_port(host: str) -> bool:
    if host.startswith("["):  # [::1]:2379
        return "]:" in host
    return ":" in host
