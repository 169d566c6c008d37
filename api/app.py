"""``create_app(daemon)``: the FastAPI app, thin over the daemon's service object.

Every route but ``/healthz`` (and the static ``/ui`` page) has a caller with
an identity (:mod:`api.auth`): a local user on the unix socket, or a bearer
token that names one, ``/openapi.json`` included. What that identity may do
is :func:`elasticd.identity.authorize`, asked by the job service. There is no
``/docs`` or ``/redoc``: those pages load their scripts from a CDN, and no
page the daemon serves loads anything from elsewhere. Before any route,
:class:`api.guard.RequestGuard` refuses misdirected (Host), cross-origin
(Origin) and non-JSON state-changing requests, and :class:`api.limits.BodySizeLimit`
too large bodies. Errors are problem+json from one table (:mod:`api.problems`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse

from api.auth import (
    Authenticate,
    require_lister,
    require_principal,
    store_access,
)
from api.guard import SAFE_METHODS, RequestGuard
from api.limits import DEFAULT_MAX_REQUEST_BYTES, BodySizeLimit
from api.problems import PROBLEM_JSON, UNPARSEABLE_BODY, install_error_handlers
from api.routes import health, jobs, nodes, ui
from api.routes.metrics import metrics_router
from api.routes.store import body_limit, store_router
from api.shares import DEFAULT_LONG_POLLS, DEFAULT_PER_PRINCIPAL, DEFAULT_RESERVED, PrincipalShares
from api.store_http import StoreHTTP
from api.streams import DEFAULT_MAX_STREAMS, StreamLimit
from elasticd import __version__
from elasticd.store.base import DEFAULT_MAX_VALUE_BYTES
from elasticd.store.scoped import (
    DEFAULT_JOB_STORE_MAX_BYTES,
    DEFAULT_JOB_STORE_MAX_KEYS,
    PrefixShare,
)

if TYPE_CHECKING:
    from elasticd.node.daemon import Daemon

DESCRIPTION = (
    "elasticd's control plane: submit torchrun-style jobs, watch their worker groups, "
    "events and logs. Every endpoint except /healthz needs an identity: a connection on the "
    "daemon's unix socket (the kernel names the local user) or `Authorization: Bearer <token>` "
    "(the daemon's own token, or an identity's). Jobs, their logs and their cancellation are "
    "their owner's (or an admin's): 403 otherwise. A POST, PUT or PATCH needs "
    "`Content-Type: application/json` and a JSON body (`{}` when there is nothing to say; 415 "
    "otherwise); a state-changing request from a web page of another origin gets 403."
)


def create_app(daemon: Daemon | None) -> FastAPI:
    """The app for ``daemon`` (``None`` only to generate the OpenAPI document)."""
    app = FastAPI(
        title="elasticd",
        version=__version__,
        description=DESCRIPTION,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,  # served below, behind the token
    )
    app.state.daemon = daemon
    app.state.streams = StreamLimit(
        getattr(getattr(daemon, "config", None), "max_streams", DEFAULT_MAX_STREAMS)
    )
    auth = [Depends(require_principal)]
    install_error_handlers(app)
    config = daemon.config if daemon is not None else None
    max_bytes = getattr(config, "max_request_bytes", DEFAULT_MAX_REQUEST_BYTES)
    if daemon is not None:  # /store, answered before routing (innermost), from a principal
        store_limit = getattr(config, "store_max_value_bytes", None)
        app.add_middleware(
            StoreHTTP,
            access=store_access(
                lambda: daemon.store,
                PrefixShare(
                    getattr(config, "job_store_max_keys", DEFAULT_JOB_STORE_MAX_KEYS),
                    getattr(config, "job_store_max_bytes", DEFAULT_JOB_STORE_MAX_BYTES),
                ),
            ),
            body_limit=body_limit(store_limit or DEFAULT_MAX_VALUE_BYTES),
        )
    app.add_middleware(BodySizeLimit, max_bytes=max_bytes)
    if daemon is not None:  # each principal's share of requests, once it is known
        app.add_middleware(
            PrincipalShares,
            total=lambda: getattr(daemon, "max_connections", None),
            per_principal=getattr(config, "principal_max_connections", DEFAULT_PER_PRINCIPAL),
            long_polls=getattr(config, "principal_max_long_polls", DEFAULT_LONG_POLLS),
            reserved=getattr(config, "admin_reserved_connections", DEFAULT_RESERVED),
        )
    if daemon is not None:  # who is asking: from the head alone, before any body is read
        app.add_middleware(
            Authenticate,
            authenticator=daemon.authenticator,
            metrics_public=_metrics_public(daemon),
        )
    app.add_middleware(RequestGuard, tokenless=False)  # added last: runs first

    @app.get("/openapi.json", include_in_schema=False, dependencies=auth)
    async def openapi_document() -> JSONResponse:
        return JSONResponse(app.openapi())

    app.include_router(health.public)
    app.include_router(health.private, dependencies=auth)
    app.include_router(jobs.router, dependencies=auth)
    app.include_router(nodes.router, dependencies=[*auth, Depends(require_lister)])
    app.include_router(metrics_router(metrics_public=_metrics_public(daemon)))
    app.include_router(ui.router)  # static page, no data: served without the token
    app.include_router(store_router())  # described here, answered by StoreHTTP
    _document_problems(app)
    return app


#: Served without the token (see the routes); every other operation may answer 401.
_PUBLIC_PATHS = frozenset({"/healthz", "/slurm/proof", "/ui"})


def _document_problems(app: FastAPI) -> None:
    """Document the errors every route shares as they are sent: problem+json.

    FastAPI describes its 422 as ``application/json`` ``HTTPValidationError``;
    the app sends a problem (:mod:`api.problems`). 400 (a body that cannot be
    decoded), 401 (token), 413 (body
    size, :mod:`api.limits`; ``/store/`` documents its own) and the guard's
    421 (Host), 403 (Origin) and 415 (Content-Type) (:mod:`api.guard`) come
    from outside the routes and are added here.
    """
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = generate()
        content = {PROBLEM_JSON: {"schema": {"$ref": "#/components/schemas/Problem"}}}
        for path, operations in schema.get("paths", {}).items():
            for method, operation in operations.items():
                responses = operation.setdefault("responses", {})
                if method.upper() not in SAFE_METHODS:
                    responses.setdefault(
                        "403",
                        {
                            "description": "Forbidden: not this identity's to do, or sent by "
                            "a page of another origin",
                            "content": content,
                        },
                    )
                if "requestBody" in operation:
                    responses.setdefault(
                        "415",
                        {"description": "The body is not application/json", "content": content},
                    )
                    responses.setdefault(
                        "400",
                        {"description": UNPARSEABLE_BODY, "content": content},
                    )
                if "422" in responses:
                    responses["422"] = {
                        "description": "The request is invalid; `errors` names each field",
                        "content": content,
                    }
                if path not in _PUBLIC_PATHS:
                    responses.setdefault(
                        "401",
                        {
                            "description": "No identity: no valid bearer token and not the "
                            "unix socket",
                            "content": content,
                        },
                    )
                if "requestBody" in operation and not path.startswith("/store/"):
                    responses.setdefault(
                        "413",
                        {"description": "The request body is too large", "content": content},
                    )
        schemas = schema.get("components", {}).get("schemas", {})
        for unused in ("HTTPValidationError", "ValidationError"):
            schemas.pop(unused, None)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def _metrics_public(daemon: Daemon | None) -> bool:
    """Whether loopback scrapers may read /metrics without the token (config option)."""
    return daemon is not None and bool(getattr(daemon.config, "metrics_open_on_loopback", False))
