"""Who is asking: every request gets a principal before anything reads its body.

:class:`Authenticate` is an ASGI middleware (inside the request guard, before
the body limit, the ``/store`` handler and routing). It never reads the body:

* a connection on the unix socket carries its peer's uid (``SO_PEERCRED``,
  read by :mod:`api.protocol` when the connection is made, under
  :data:`PEER_KEY` in the scope): the principal is that local user, or the
  request is refused (``403``) on a daemon that serves its own user only;
* otherwise ``Authorization: Bearer <token>`` must name an identity
  (:class:`elasticd.identity.Authenticator`): the admin, the cluster, an
  identity of the identities file, or a job's own token; else ``401`` at
  once, so an unauthenticated client can never make the daemon wait for a
  body (a thousand unfinished bodies used to hold every connection).

The principal is put in the scope (:func:`principal_of`). Only
``/healthz``, the static ``/ui`` page and, where the operator opened it to
loopback scrapers, ``/metrics`` are served without one.

``/store`` asks :func:`store_access` (the daemon) or :func:`bearer_store`
(the standalone store server, ``python -m api.store_server``: one token).
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from fastapi import HTTPException, Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from api.problems import problem
from api.protocol import PEER_KEY
from elasticd.config import is_loopback
from elasticd.identity import Action, Authenticator, Deny, Principal, authorize
from elasticd.store.base import Store
from elasticd.store.scoped import PrefixLedger, PrefixShare, ScopedStore

#: Where :class:`Authenticate` puts the request's principal.
PRINCIPAL_KEY = "elasticd.principal"

#: Served to anyone: no data (``/favicon.ico``, which browsers ask for by themselves, is 404).
PUBLIC_PATHS = frozenset({"/healthz", "/slurm/proof", "/ui", "/", "/favicon.ico"})


_NO_PRINCIPAL = "this endpoint needs 'Authorization: Bearer <token>' or the daemon's unix socket"
_NO_TOKEN = (
    "this endpoint needs 'Authorization: Bearer <token>' "
    "(the token is in the daemon's --token-file)"
)
_BAD_TOKEN = "the bearer token is not valid for this daemon"


def principal_of(request: Request) -> Principal:
    """The request's principal (set by :class:`Authenticate`; 401 if there is none)."""
    principal = request.scope.get(PRINCIPAL_KEY)
    if not isinstance(principal, Principal):
        raise HTTPException(401, _NO_PRINCIPAL, headers={"WWW-Authenticate": "Bearer"})
    return principal


async def require_principal(request: Request) -> None:
    """A route dependency: the request has a principal (documents the 401)."""
    principal_of(request)


async def require_lister(request: Request) -> None:
    """A route dependency: the caller may list jobs, the queue and the nodes (not a job)."""
    decision = authorize(principal_of(request), Action.LIST)
    if isinstance(decision, Deny):
        raise HTTPException(403, decision.reason)


def store_access(
    store: Callable[[], Store], share: PrefixShare | None = None
) -> Callable[[Scope], Store | Response]:
    """Who may use the daemon's ``/store`` (:class:`api.store_http.StoreHTTP`'s ``access``).

    The daemons and admins use the whole store; a job's token only its
    job's keys (:class:`elasticd.store.scoped.ScopedStore`), within ``share``
    (kept in one ledger for all of this daemon's requests); anyone else gets 403.
    """
    ledger = PrefixLedger()

    def access(scope: Scope) -> Store | Response:
        principal = scope.get(PRINCIPAL_KEY)
        if not isinstance(principal, Principal):
            return problem(
                401, "Unauthorized", _NO_PRINCIPAL, headers={"WWW-Authenticate": "Bearer"}
            )
        decision = authorize(principal, Action.STORE)
        if isinstance(decision, Deny):
            return problem(403, "Forbidden", decision.reason)
        if principal.store_prefix is not None:
            return ScopedStore(store(), principal.store_prefix, share=share, ledger=ledger)
        return store()

    return access


def first_header(scope: Scope, name: bytes) -> bytes | None:
    """The first value of a header (as ``starlette.datastructures.Headers.get``), raw."""
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


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
        await self.app(scope, receive, send)

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


def bearer_refusal(scope: Scope, expected: bytes | None) -> Response | None:
    """The 401 of a request without ``Authorization: Bearer <expected>``; None when it has it.

    With no ``expected`` token every request passes (the store server then
    binds loopback only). The comparison is constant-time.
    """
    if expected is None:
        return None
    header = first_header(scope, b"authorization") or b""
    scheme, _, given = header.decode("latin-1").partition(" ")
    if scheme.lower() != "bearer" or not given:
        return problem(401, "Unauthorized", _NO_TOKEN, headers={"WWW-Authenticate": "Bearer"})
    if not hmac.compare_digest(given.strip().encode(), expected):
        return problem(
            401,
            "Unauthorized",
            _BAD_TOKEN,
            headers={"WWW-Authenticate": 'Bearer error="invalid_token"'},
        )
    return None


def bearer_store(store: Store, token: str | None) -> Callable[[Scope], Store | Response]:
    """The store server's ``access``: ``store`` to a request with the token (see above)."""
    expected = token.encode() if token else None

    def access(scope: Scope) -> Store | Response:
        return bearer_refusal(scope, expected) or store

    return access
