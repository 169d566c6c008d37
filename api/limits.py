"""Request size limits: a body larger than the daemon accepts is refused with 413 before it is read.

A job spec is a few kilobytes; ``max_request_bytes`` (1 MiB by default)
leaves ample room and keeps a client from making the daemon buffer and
parse megabytes of JSON. The check is a plain ASGI middleware, so it runs
before routing, authentication and parsing:

* a ``Content-Length`` over the limit is answered at once, without reading;
* a body without one (chunked) is counted as it arrives and refused as soon
  as it passes the limit.

``/store/...`` is exempt: its handler (:mod:`api.store_http`) keeps its own,
larger limit derived from the store's maximal value size
(:func:`api.routes.store.body_limit`).
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.problems import problem

DEFAULT_MAX_REQUEST_BYTES = 1 << 20
EXEMPT_PREFIXES = ("/store/",)


def _too_large(limit: int) -> str:
    return (
        f"the request body is larger than {limit} bytes, the most this daemon accepts "
        "(max_request_bytes in its config)"
    )


class BodySizeLimit:
    """ASGI middleware: refuse request bodies over ``max_bytes`` with a 413 problem."""

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        exempt_prefixes: tuple[str, ...] = EXEMPT_PREFIXES,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.exempt_prefixes = exempt_prefixes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or str(scope.get("path", "")).startswith(self.exempt_prefixes):
            await self.app(scope, receive, send)
            return
        length = _content_length(scope)
        if length is not None and length > self.max_bytes:
            response = problem(413, "Request too large", _too_large(self.max_bytes))
            await response(scope, receive, send)
            return
        limit = self.max_bytes
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    # Raised into the route's body read: the app's error table turns it
                    # into the same 413 problem as above.
                    raise HTTPException(413, _too_large(limit))
            return message

        await self.app(scope, counted, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
