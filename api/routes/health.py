"""``/healthz`` (no auth: is the process alive) and ``/readyz`` (is it accepting jobs)."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request
from starlette.responses import JSONResponse

from api.auth import principal_of
from api.deps import daemon_of
from api.schemas import Empty, Health
from elasticd import __version__
from elasticd.identity import Action, Deny, authorize

public = APIRouter(tags=["health"])
private = APIRouter(tags=["health"])


@public.get("/healthz", response_model=Health)
async def healthz(request: Request) -> Health:
    """The daemon process is alive and its event loop answers; its pid, and when the running
    program image started (``started_at`` changes at a re-exec, ``pid`` does not)."""
    return _alive(request, "ok")


def _alive(request: Request, status: str, **more: object) -> Health:
    """The daemon's health record: its node, version, pid and image's start, and ``more``."""
    daemon = daemon_of(request)
    return Health.model_validate(
        {
            "status": status,
            "node": daemon.config.node_name,
            "version": __version__,
            "pid": daemon.pid,
            "started_at": daemon.started_at,
            **more,
        }
    )


@private.post(
    "/reload",
    status_code=202,
    response_model=Health,
    responses={403: {"description": "Not an admin"}},
)
async def reload(body: Empty, request: Request) -> Health:
    """Re-execute the daemon in place: the installed program, the same pid; workers run on.

    Admins only. ``202``: the pre-flight check and the re-exec follow; the jobs'
    events ``daemon.reexec`` or ``daemon.reexec_refused`` say how it went, and
    ``/healthz``'s ``started_at`` changes. The body is ``{}``.
    """
    decision = authorize(principal_of(request), Action.RELOAD)
    if isinstance(decision, Deny):
        raise HTTPException(403, decision.reason)
    daemon_of(request).request_reload()
    return _alive(request, "reloading")


@private.get("/readyz", response_model=Health, responses={503: {"model": Health}})
async def readyz(request: Request) -> Health | JSONResponse:
    """The daemon accepts jobs; its pid and image's start, as ``/healthz``'s.

    503 with the reason while starting, waiting for its store, shutting down, or
    while its disk refuses writes ("storage degraded since T: ...: disk full").
    ``warnings`` names what a ready daemon will refuse (a root daemon with no user
    for the admin's jobs: they are refused at submission, local users' are not).
    """
    daemon = daemon_of(request)
    reason = daemon.not_ready_reason
    status = "ready" if reason is None else "not ready"
    health = _alive(request, status, reason=reason, warnings=daemon.warnings)
    if reason is not None:
        return JSONResponse(health.model_dump(), status_code=503)
    return health
