"""``/metrics``: the daemon's Prometheus metrics (see :mod:`elasticd.node.metrics`).

For any identity, like every other endpoint (:mod:`api.auth`). With
``metrics_public`` a scraper on the same host (a loopback client address)
needs none; anything else still does. Behind a reverse proxy on the same host every request looks
local, so leave it off there.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response

from api.auth import require_principal
from api.deps import daemon_of
from elasticd.config import is_loopback
from elasticd.node.metrics import CONTENT_TYPE


def metrics_router(*, metrics_public: bool = False) -> APIRouter:
    """The ``/metrics`` route; ``metrics_public`` opens it to loopback clients."""

    async def auth(request: Request) -> None:
        client = request.client
        if metrics_public and client is not None and is_loopback(client.host):
            return
        await require_principal(request)

    router = APIRouter(tags=["metrics"])

    @router.get(
        "/metrics",
        response_class=Response,
        dependencies=[Depends(auth)],
        responses={200: {"content": {CONTENT_TYPE: {}}, "description": "Prometheus text format"}},
    )
    async def metrics(request: Request) -> Response:
        """Prometheus metrics: jobs, worker groups, restarts, exits, rendezvous, store."""
        return Response(await daemon_of(request).metrics_text(), media_type=CONTENT_TYPE)

    return router
