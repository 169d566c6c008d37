"""Requests in flight and long-polls per principal, with a reserve for the admin and the
cluster (issue 35, finding 2; :class:`elasticd.shares.ConnectionShares` decides).

The connection cap (:mod:`api.protocol`) closes idle connections to make room, but
not busy ones: a job's workers with thousands of ``/store/watch`` requests, or a
local user with ``/jobs/<id>/events?wait=60``, held every connection and the admin's
``/healthz`` got 503. :class:`PrincipalShares` runs right after
:class:`api.auth.Authenticate` and before any body is read: a request of a
principal past its share, or one that would take the last
``admin_reserved_connections`` of the daemon's connections, is answered 429 at
once (its connection is then idle, so the cap may close it). The admin and the
cluster identity are counted but never refused; requests without a principal
(``/healthz``, ``/ui``) are neither.
"""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import parse_qs

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.auth import PRINCIPAL_KEY
from api.problems import problem
from elasticd.identity import Principal, PrincipalKind
from elasticd.shares import ConnectionShares

#: Defaults of ``principal_max_connections``, ``principal_max_long_polls`` and
#: ``admin_reserved_connections``.
DEFAULT_PER_PRINCIPAL = 128
DEFAULT_LONG_POLLS = 64
DEFAULT_RESERVED = 16


def is_long_poll(scope: Scope) -> bool:
    """Whether the request may be held open for long: a watch, an event wait, a stream."""
    path: str = scope.get("path", "")
    # Parsed as the route parses it (``w%61it=60`` is ``wait``; ``follow=1`` follows): any
    # ``wait`` or ``follow`` asked for counts, whatever its value.
    asked = parse_qs(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
    if path == "/store/watch":
        return True
    if path.endswith("/events"):
        accept = dict(scope.get("headers", [])).get(b"accept", b"")
        return "wait" in asked or b"text/event-stream" in accept
    return path.endswith("/logs") and "follow" in asked


class PrincipalShares:
    """ASGI middleware applying :class:`ConnectionShares` around every authenticated request.

    ``total`` is read per request (the daemon learns its connection cap when its server
    starts).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        total: Callable[[], int | None],
        per_principal: int = DEFAULT_PER_PRINCIPAL,
        long_polls: int = DEFAULT_LONG_POLLS,
        reserved: int = DEFAULT_RESERVED,
    ) -> None:
        self.app = app
        self._total = total
        self.shares = ConnectionShares(per_principal, long_polls, total=0, reserved=reserved)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        principal = scope.get(PRINCIPAL_KEY)
        if scope["type"] != "http" or not isinstance(principal, Principal):
            await self.app(scope, receive, send)
            return
        shares = self.shares
        shares.total = self._total() or shares.per_principal + shares.reserved
        who = (principal.kind.value, principal.name, principal.job_id, principal.uid)
        privileged = principal.admin or principal.kind is PrincipalKind.CLUSTER
        long_poll = is_long_poll(scope)
        refused = shares.admit(who, privileged=privileged, long_poll=long_poll)
        if refused is not None:
            await problem(429, "Over its share", refused, headers={"Retry-After": "1"})(
                scope, receive, send
            )
            return
        done = False

        def release() -> None:
            nonlocal done
            if not done:
                done = True
                shares.release(who, long_poll=long_poll)

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body"):
                release()  # the answer is complete: the connection is free again
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            release()
