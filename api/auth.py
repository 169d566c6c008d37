"""Bearer-token authentication for every endpoint but ``/healthz``."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from fastapi import HTTPException, Request


def bearer_auth(token: str | None) -> Callable[[Request], Awaitable[None]]:
    """A FastAPI dependency that requires ``Authorization: Bearer <token>``.

    With ``token=None`` it lets every request through (the daemon then binds
    loopback only). The comparison is constant-time.
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
