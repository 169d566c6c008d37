"""Who may talk to the daemon at all: Host, Origin and Content-Type rules, before routing.

A web page the daemon's user visits is hostile (docs/hardening.md). A browser
lets any page send *simple* requests to any address (a form POST, or
``fetch(..., {mode: "no-cors"})`` with a ``text/plain`` body) and, through DNS
rebinding, lets a page whose name resolves to 127.0.0.1 read the answers as
its own origin. So every request passes three rules, decided by the pure
function :func:`refusal` and applied by the ASGI middleware
:class:`RequestGuard` (outermost, before the body limit, authentication and
routing):

1. **Host (daemon without a token).** Only requests addressed to a loopback
   name are served: ``127.0.0.0/8``, ``localhost`` or ``[::1]``, with or
   without a port. A rebinding page's requests carry its own name
   (``Host: attacker.example:7070``) and get ``421``. Connections on the
   unix socket are exempt (no browser reaches one). With a token the daemon
   may be reached by any name: the page has no token.
2. **Origin (always).** A state-changing request (any method but GET, HEAD
   and OPTIONS) that carries an ``Origin`` other than the daemon's own (the
   scheme and ``Host`` the request was sent to) gets ``403``, token or not.
   Browsers send ``Origin`` on every cross-origin POST, PUT and DELETE;
   programs (the CLI, the client, peer daemons) send none.
3. **Content-Type (always).** A POST, PUT or PATCH needs
   ``Content-Type: application/json`` and a JSON body (``{}`` when there is
   nothing to say); a DELETE may have no body, else a JSON one. Anything
   else gets ``415``. A browser cannot send ``application/json`` to another
   origin without a CORS preflight, which the daemon never grants, so no
   simple request changes anything.

Every response also gets ``X-Content-Type-Options: nosniff`` and, unless the
route set its own (``/ui``), ``Content-Security-Policy: default-src 'none';
frame-ancestors 'none'``: nothing the daemon serves may load, run or be framed.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.problems import problem

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
DEFAULT_PORTS = {"http": 80, "https": 443}
#: For every response that did not set its own policy (the API's JSON and streams).
API_CSP = "default-src 'none'; frame-ancestors 'none'"


@dataclass(frozen=True)
class Refusal:
    """Why a request is not served: the problem's status, title and an actionable detail."""

    status: int
    title: str
    detail: str


def split_host(value: str) -> tuple[str, int | None] | None:
    """``Host``-style ``name[:port]`` as (lower-case name, port); None when malformed."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            return None
        name, rest = value[1:end], value[end + 1 :]
        if rest and not rest.startswith(":"):
            return None
        port_text = rest[1:] if rest else None
    elif value.count(":") == 1:
        name, port_text = value.split(":")
    elif ":" in value:
        return None  # an IPv6 address must be bracketed
    else:
        name, port_text = value, None
    if not name:
        return None
    if port_text is None:
        return name, None
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        return None
    return name, int(port_text)


def is_loopback_name(name: str) -> bool:
    """``localhost`` or a loopback address (127.0.0.0/8, ::1)."""
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _origin_of(value: str) -> tuple[str, str, int] | None:
    """A serialized origin (``scheme://host[:port]``) as (scheme, host, port)."""
    scheme, sep, rest = value.strip().lower().partition("://")
    if not sep or scheme not in DEFAULT_PORTS or "/" in rest:
        return None
    parsed = split_host(rest)
    if parsed is None:
        return None
    name, port = parsed
    return scheme, name, port if port is not None else DEFAULT_PORTS[scheme]


def _media_type(value: str | None) -> str:
    return (value or "").split(";", 1)[0].strip().lower()


def refusal(
    *,
    method: str,
    path: str,
    headers: Iterable[tuple[bytes, bytes]],
    scheme: str,
    tokenless: bool,
    unix_socket: bool,
) -> Refusal | None:
    """Whether to refuse a request, and why; None to serve it. Pure: no IO, no clock."""
    seen: dict[bytes, list[str]] = {}
    for name, value in headers:
        seen.setdefault(name.lower(), []).append(value.decode("latin-1"))
    hosts = seen.get(b"host", [])
    host = split_host(hosts[0]) if len(hosts) == 1 else None
    if tokenless and not unix_socket and (host is None or not is_loopback_name(host[0])):
        given = ", ".join(repr(h) for h in hosts) or "none"
        return Refusal(
            421,
            "Misdirected request",
            f"this daemon has no token, so it answers only requests addressed to a loopback "
            f"name (127.0.0.1, localhost or [::1], with the port); the Host header was {given}. "
            "Use http://127.0.0.1:PORT, or give the daemon a token (--token-file) to serve "
            "other names.",
        )
    if method in SAFE_METHODS:
        return None
    origins = seen.get(b"origin", [])
    if origins:
        own = None
        if host is not None:
            host_name, port = host
            own = (scheme, host_name, port if port is not None else DEFAULT_PORTS.get(scheme, 0))
        if len(origins) != 1 or own is None or _origin_of(origins[0]) != own:
            return Refusal(
                403,
                "Cross-origin request refused",
                f"{method} {path} came from the web page at {origins[0]!r}, not from this "
                "daemon's own pages; a page from another origin may not change anything here. "
                "Programs send no Origin header; use the CLI or the API client.",
            )
    lengths = seen.get(b"content-length", [])
    has_body = bool(seen.get(b"transfer-encoding")) or any(
        v.strip() not in ("", "0") for v in lengths
    )
    if method not in BODY_METHODS and not has_body:
        return None  # a DELETE without a body
    types = seen.get(b"content-type", [])
    media = _media_type(types[0]) if len(types) == 1 else ""
    if media != "application/json":
        what = f"Content-Type {types[0]!r}" if types else "no Content-Type"
        return Refusal(
            415,
            "Unsupported media type",
            f"{method} {path} needs 'Content-Type: application/json' and a JSON body "
            f"(send {{}} when there is nothing to say); it had {what}.",
        )
    return None


class RequestGuard:
    """ASGI middleware applying :func:`refusal`, and the security headers on every response."""

    def __init__(self, app: ASGIApp, *, tokenless: bool) -> None:
        self.app = app
        self.tokenless = tokenless

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        server = scope.get("server")
        found = refusal(
            method=str(scope["method"]).upper(),
            path=str(scope.get("path", "")),
            headers=scope.get("headers", []),
            scheme=str(scope.get("scheme", "http")),
            tokenless=self.tokenless,
            # uvicorn names a unix socket's server (path, None); TCP has a port.
            unix_socket=server is not None and server[1] is None,
        )
        if found is not None:
            response = problem(found.status, found.title, found.detail)
            await response(scope, receive, _with_security_headers(send))
            return
        await self.app(scope, receive, _with_security_headers(send))


def _with_security_headers(send: Send) -> Send:
    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", []))
            names = {name.lower() for name, _ in headers}
            if b"content-security-policy" not in names:
                headers.append((b"content-security-policy", API_CSP.encode()))
            if b"x-content-type-options" not in names:
                headers.append((b"x-content-type-options", b"nosniff"))
            message = {**message, "headers": headers}
        await send(message)

    return sending
