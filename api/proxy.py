"""Forwarding a request to the daemon of another node (logs live where they were written).

The caller was authorized here; the other daemon is asked with the cluster
credential (a local caller has no token, and an identity's token is this
daemon's to check). So the address comes only
from a live node's record (bound to its lease, ``http(s)://host:port``, see
``JobService.node_url``); redirects are not followed, and of the answer only
the status, the body and the headers in :data:`RELAYED` come back.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Mapping

import httpx
from fastapi import Request
from starlette.background import BackgroundTask
from starlette.responses import StreamingResponse

from elasticd.errors import StoreUnavailable

#: The only upstream response headers relayed: what the body is and what streaming needs.
#: Anything else (``Set-Cookie``, ``Location``, ...) is the other daemon's business, never
#: the caller's.
RELAYED = ("content-type", "cache-control", "x-accel-buffering")


async def forward(
    request: Request,
    base_url: str,
    *,
    token: str | None,
    drop: Iterable[str] = (),
    add: Mapping[str, str] | None = None,
) -> StreamingResponse:
    """Send ``request`` (same method, path, query less ``drop``) to ``base_url`` with ``token``
    and the headers ``add``."""
    dropped = set(drop)
    params = httpx.QueryParams(
        [(k, v) for k, v in request.query_params.multi_items() if k not in dropped]
    )
    headers = {}
    for name in ("accept", "last-event-id"):
        if name in request.headers:
            headers[name] = request.headers[name]
    headers.update(add or {})
    if token is not None:
        headers["authorization"] = f"Bearer {token}"
    client = httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(10.0, read=None))
    try:
        upstream = await client.send(
            client.build_request(request.method, request.url.path, params=params, headers=headers),
            stream=True,
        )
    except httpx.HTTPError as exc:
        await client.aclose()
        raise StoreUnavailable(f"the daemon at {base_url} is unreachable: {exc}") from None

    async def body() -> AsyncIterator[bytes]:
        async for chunk in upstream.aiter_raw():
            yield chunk

    async def close() -> None:
        await upstream.aclose()
        await client.aclose()

    return StreamingResponse(
        body(),
        status_code=upstream.status_code,
        headers={k: upstream.headers[k] for k in RELAYED if k in upstream.headers},
        background=BackgroundTask(close),
    )
