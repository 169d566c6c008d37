"""The backend's settings from torchrun's rendezvous parameters, and who this torchrun is."""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from elasticd.models import valid_job_id
from elasticd.rendezvous import Settings

#: The name torchrun knows the backend by (``--rdzv-backend``).
BACKEND = "elasticd"
#: A daemon's default port, for an endpoint given without one.
DEFAULT_PORT = 7070


@dataclass(frozen=True)
class BackendConfig:
    """Everything the backend takes from torchrun's rendezvous parameters."""

    url: str
    run_id: str
    settings: Settings
    token_file: str | None
    lease_ttl: float
    store_timeout: float
    local_addr: str | None


def endpoint_url(endpoint: str) -> str:
    """torchrun's ``--rdzv-endpoint`` as a daemon's base URL.

    ``host[:port]`` means ``http://host:port`` (port 7070 if absent, as the
    daemon's default); an ``http://`` or ``https://`` URL is kept as given.
    """
    endpoint = endpoint.strip()
    if not endpoint:
        raise ValueError("--rdzv-endpoint is required: a daemon's host:port")
    if "://" in endpoint:
        parts = urlsplit(endpoint)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"--rdzv-endpoint {endpoint!r}: expected host:port or an http URL")
        return endpoint.rstrip("/")
    parts = urlsplit(f"//{endpoint}")
    try:
        port = parts.port or DEFAULT_PORT
    except ValueError as exc:
        raise ValueError(f"--rdzv-endpoint {endpoint!r}: {exc}") from None
    host = parts.hostname
    if not host or parts.path:
        raise ValueError(f"--rdzv-endpoint {endpoint!r}: expected host:port")
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


def _number(conf: Mapping[str, Any], key: str, default: float) -> float:
    value = conf.get(key, default)
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"--rdzv-conf {key}={value!r} is not a number") from None
    if number <= 0:
        raise ValueError(f"--rdzv-conf {key}={value!r} must be positive")
    return number


def backend_config(
    *,
    endpoint: str,
    run_id: str,
    min_nodes: int,
    max_nodes: int,
    local_addr: str | None,
    conf: Mapping[str, Any],
    environ: Mapping[str, str],
) -> BackendConfig:
    """The backend's settings from torchrun's parameters (pure; tested as a table).

    The run id names store keys, so it must be a valid job id. The token
    file comes from ``--rdzv-conf token_file=`` first, then
    ``ELASTICD_TOKEN_FILE``; without either, requests carry no token (a
    loopback daemon without a token file).
    """
    if not valid_job_id(run_id):
        raise ValueError(
            f"--rdzv-id {run_id!r} must be letters, digits, '.', '_' or '-' (at most 128), "
            "as an elasticd job id"
        )
    settings = Settings(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        join_timeout=_number(conf, "join_timeout", 600.0),
        last_call_timeout=_number(conf, "last_call_timeout", 30.0),
    )
    token_file = conf.get("token_file") or environ.get("ELASTICD_TOKEN_FILE") or None
    return BackendConfig(
        url=endpoint_url(endpoint),
        run_id=run_id,
        settings=settings,
        token_file=None if token_file is None else str(token_file),
        lease_ttl=_number(conf, "lease_ttl", 3.0),
        store_timeout=_number(conf, "store_timeout", 300.0),
        local_addr=local_addr or None,
    )


def node_name(host: str, pid: int, suffix: str) -> str:
    """This torchrun's node name: ``<host>-<pid>-<suffix>``, in node-name characters."""
    clean = re.sub(r"[^A-Za-z0-9._-]", "-", host).strip(".-_")[:200] or "node"
    return f"{clean}-{pid}-{suffix}"


def address_towards(url: str) -> str:
    """The local address this host reaches ``url``'s host from (no packet is sent)."""
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    try:
        info = socket.getaddrinfo(host, parts.port or DEFAULT_PORT, type=socket.SOCK_DGRAM)
        family, _, _, _, address = info[0]
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect(address)
            local: str = sock.getsockname()[0]
    except OSError:
        return socket.getfqdn()
    if ipaddress.ip_address(local.split("%", 1)[0]).is_loopback:
        # A daemon on this host: a loopback address would name every node's own host to
        # the others' workers. torch's c10d takes the host's name then; so does this.
        return socket.getfqdn()
    return local
