"""``/healthz`` (no auth: is the process alive) and ``/readyz`` (is it accepting jobs)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse

from api.deps import daemon_of
from api.schemas import Health
from elasticd import __version__

public = APIRouter(tags=["health"])
private = APIRouter(tags=["health"])


@public.get("/healthz", response_model=Health)
async def healthz(request: Request) -> Health:
    """The daemon process is alive and its event loop answers."""
    return Health(status="ok", node=daemon_of(request).config.node_name, version=__version__)


@private.get("/readyz", response_model=Health, responses={503: {"model": Health}})
async def readyz(request: Request) -> Health | JSONResponse:
    """The daemon accepts jobs.

    503 with the reason while starting, waiting for its store, shutting down, or
    while its disk refuses writes ("storage degraded since T: ...: disk full").
    ``warnings`` names what a ready daemon will refuse (a root daemon with no user
    for the admin's jobs: they are refused at submission, local users' are not).
    """
    daemon = daemon_of(request)
    reason = daemon.not_ready_reason
    health = Health(
        status="ready" if reason is None else "not ready",
        node=daemon.config.node_name,
        version=__version__,
        reason=reason,
        warnings=daemon.warnings,
    )
    if reason is not None:
        return JSONResponse(health.model_dump(), status_code=503)
    return health
