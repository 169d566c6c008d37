"""Who is asking: every request gets a principal before anything reads its body.

:class:`Authenticate` is an ASGI middleware (inside the request guard, before
the body limit, the store fast path and routing). It never reads the body:

* a connection on the unix socket carries its peer's uid (``SO_PEERCRED``,
  read by :mod:`api.protocol` when the connection is made, under
  :data:`PEER_KEY` in the scope): the principal is that local user, or the
  request is refused (``403``) on a daemon that serves its own user only;
* otherwise ``Authorization: Bearer <token>`` must name an identity
  (:class:`elasticd.identity.Authenticator`): the admin, the cluster, an
  identity of the identities file, or a job's own token; else ``401`` at
  once, so an unauthenticated client can never make the daemon wait for a
  body (a thousand unfinished bodies used to hold every connection).

The principal is put in the scope (:func:`principal_of`) and in a context
variable (:data:`current_principal`) for the store's key scoping. Only
``/healthz``, the static ``/ui`` page and, where the operator opened it to
loopback scrapers, ``/metrics`` are served without one.

:func:`bearer_auth` is the plain single-token check of the standalone store
server (``python -m api.store_server``).
"""

from __future__ import annotations

import contextvars
import hmac
from collections.abc import Awaitable, Callable

from fastapi import HTTPException, Request
from starlette.types import ASGIApp, Receive, Scope, Send

from api.problems import problem
from api.protocol import PEER_KEY
from elasticd.config import is_loopback
from elasticd.identity import Action, Authenticator, Deny, Principal, authorize

#: Where :class:`Authenticate` puts the request's principal.
PRINCIPAL_KEY = "elasticd.principal"
#: The request's principal, for code below the routes (the store's key scope).
current_principal: contextvars.ContextVar[Principal | None] = contextvars.ContextVar(
    "elasticd_principal", default=None
)

#: Served to anyone: no data (``/favicon.ico``, which browsers ask for by themselves, is 404).
PUBLIC_PATHS = frozenset({"/healthz", "/ui", "/", "/favicon.ico"})


def principal_of(request: Request) -> Principal:
    """The request's principal (set by :class:`Authenticate`; 401 if there is none)."""
    principal = request.scope.get(PRINCIPAL_KEY)
    if not isinstance(principal, Principal):
        raise HTTPException(
            401,
            "this endpoint needs 'Authorization: Bearer <token>' or the daemon's unix socket",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return principal


async def require_principal(request: Request) -> None:
    """A route dependency: the request has a principal (documents the 401)."""
    principal_of(request)


async def require_lister(request: Request) -> None:
    """A route dependency: the caller may list jobs, the queue and the nodes (not a job)."""
    decision = authorize(principal_of(request), Action.LIST)
    if isinstance(decision, Deny):
        raise HTTPException(403, decision.reason)


async def require_store_access(request: Request) -> None:
    """A route dependency of ``/store``: the daemons, admins, and a job's token (its keys)."""
    decision = authorize(principal_of(request), Action.STORE)
    if isinstance(decision, Deny):
        raise HTTPException(403, decision.reason)


def _bearer(scope: Scope) -> str | None | bool:
    """The bearer token of the request; None without one; False when malformed."""
    found: str | None = None
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            if found is not None:
                return False
            found = value.decode("latin-1")
    if found is None:
        return None
    scheme, _, secret = found.partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        return False
    return secret.strip()


class Authenticate:
    """ASGI middleware: find the request's principal from headers alone, or refuse it."""

    def __init__(
        self, app: ASGIApp, *, authenticator: Authenticator, metrics_public: bool = False
    ) -> None:
        self.app = app
        self.auth = authenticator
        self.metrics_public = metrics_public

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        principal, refusal = self._principal(scope)
        path = str(scope.get("path", ""))
        if principal is None and not self._public(path, scope):
            assert refusal is not None
            await refusal(scope, receive, send)
            return
        scope[PRINCIPAL_KEY] = principal
        reset = current_principal.set(principal)
        try:
            await self.app(scope, receive, send)
        finally:
            current_principal.reset(reset)

    def _public(self, path: str, scope: Scope) -> bool:
        if path in PUBLIC_PATHS:
            return True
        if path == "/metrics" and self.metrics_public:
            client = scope.get("client")
            return client is not None and is_loopback(str(client[0]))
        return False

    def _principal(
        self, scope: Scope
    ) -> tuple[Principal | None, Callable[..., Awaitable[None]] | None]:
        peer = scope.get(PEER_KEY)
        if peer is not None:
            _pid, uid, _gid = peer
            principal = self.auth.from_peer(uid)
            if principal is None:
                return None, problem(
                    403,
                    "Forbidden",
                    f"this daemon runs as uid {self.auth.table.local.daemon_uid} and serves "
                    f"that user only; you are uid {uid}. Start your own daemon "
                    "(elasticd serve), or use the node's shared daemon",
                )
            return principal, None
        token = _bearer(scope)
        if token is None:
            return None, problem(
                401,
                "Unauthorized",
                "this endpoint needs 'Authorization: Bearer <token>' (an identity's token; "
                "the daemon's own is in its --token-file, or <state_dir>/token), or a "
                "connection on the daemon's unix socket",
                headers={"WWW-Authenticate": "Bearer"},
            )
        principal = None if token is False else self.auth.from_token(str(token))
        if principal is None:
            return None, problem(
                401,
                "Unauthorized",
                "the bearer token is not valid for this daemon",
                headers={"WWW-Authenticate": 'Bearer error="invalid_token"'},
            )
        return principal, None


def bearer_auth(token: str | None) -> Callable[[Request], Awaitable[None]]:
    """A FastAPI dependency that requires ``Authorization: Bearer <token>`` (the store server).

    With ``token=None`` it lets every request through (the store server then
    binds loopback only, and no daemon that runs jobs as other users uses it).
    The comparison is constant-time.
    """
    expected = token.encode() if token else None

    async def check(request: Request) -> None:
        if expected is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not given:
            raise HTTPException(
                401,
                "this endpoint needs 'Authorization: Bearer <token>' "
                "(the token is in the daemon's --token-file)",
                headers={"WWW-Authenticate": "Bearer"},
            )
        if not hmac.compare_digest(given.strip().encode(), expected):
            raise HTTPException(
                401,
                "the bearer token is not valid for this daemon",
                headers={"WWW-Authenticate": 'Bearer error="invalid_token"'},
            )

    return check
