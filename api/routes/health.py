"""``/healthz`` (no auth: is the process alive), ``/readyz`` (is it accepting jobs), and
``/slurm/proof`` (no auth: a Slurm step's store host proves it holds the step's token)."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Query, Request
from starlette.responses import JSONResponse

from api.auth import principal_of
from api.deps import daemon_of
from api.schemas import Empty, Health, SlurmProof
from elasticd import __version__
from elasticd.identity import Action, Deny, authorize
from elasticd.slurm.allocation import NONCE_PATTERN, store_proof

public = APIRouter(tags=["health"])
private = APIRouter(tags=["health"])


@public.get("/healthz", response_model=Health)
async def healthz(request: Request) -> Health:
    """The daemon process is alive and its event loop answers; its pid, and when the running
    program image started (``started_at`` changes at a re-exec, ``pid`` does not)."""
    return _alive(request, "ok")


@public.get(
    "/slurm/proof",
    response_model=SlurmProof,
    responses={404: {"description": "Not a Slurm step's store host"}},
)
async def slurm_proof(request: Request, nonce: str = Query(pattern=NONCE_PATTERN)) -> SlurmProof:
    """The store host of a Slurm step (``elasticd run --nnodes``) proves it holds the step's
    token before the other tasks send it: HMAC-SHA256 of the token over
    ``elasticd-slurm-proof:<nonce>``. 404 on any other daemon."""
    daemon = daemon_of(request)
    if not daemon.slurm_store_host:
        raise HTTPException(404, "this daemon is not a Slurm step's store host")
    return SlurmProof(proof=store_proof(daemon.cluster_token, nonce))


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
