"""``create_app(daemon)``: the FastAPI app, thin over the daemon's service object.

Every route but ``/healthz`` requires the bearer token when one is
configured. Errors are problem+json from one table (:mod:`api.problems`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI

from api.auth import bearer_auth
from api.limits import DEFAULT_MAX_REQUEST_BYTES, BodySizeLimit
from api.problems import PROBLEM_JSON, install_error_handlers
from api.routes import health, jobs, nodes, ui
from api.routes.metrics import metrics_router
from api.streams import DEFAULT_MAX_STREAMS, StreamLimit
from elasticd import __version__

if TYPE_CHECKING:
    from elasticd.daemon import Daemon

DESCRIPTION = (
    "elasticd's control plane: submit torchrun-style jobs, watch their worker groups, "
    "events and logs. Every endpoint except /healthz needs `Authorization: Bearer <token>` "
    "when the daemon has a token."
)


def create_app(daemon: Daemon | None) -> FastAPI:
    """The app for ``daemon`` (``None`` only to generate the OpenAPI document)."""
    app = FastAPI(title="elasticd", version=__version__, description=DESCRIPTION)
    app.state.daemon = daemon
    app.state.streams = StreamLimit(
        getattr(getattr(daemon, "config", None), "max_streams", DEFAULT_MAX_STREAMS)
    )
    token = daemon.token if daemon is not None else None
    auth = [Depends(bearer_auth(token))]
    install_error_handlers(app)
    config = daemon.config if daemon is not None else None
    max_bytes = getattr(config, "max_request_bytes", DEFAULT_MAX_REQUEST_BYTES)
    app.add_middleware(BodySizeLimit, max_bytes=max_bytes)
    app.include_router(health.public)
    app.include_router(health.private, dependencies=auth)
    app.include_router(jobs.router, dependencies=auth)
    app.include_router(nodes.router, dependencies=auth)
    app.include_router(metrics_router(token, metrics_public=_metrics_public(daemon)))
    app.include_router(ui.router)  # static page, no data: served without the token
    _include_store(app, daemon, auth)
    _document_problems(app)
    return app


#: Served without the token (see the routes); every other operation may answer 401.
_PUBLIC_PATHS = frozenset({"/healthz", "/ui"})


def _document_problems(app: FastAPI) -> None:
    """Document the errors every route shares as they are sent: problem+json.

    FastAPI describes its 422 as ``application/json`` ``HTTPValidationError``;
    the app sends a problem (:mod:`api.problems`). 401 (token) and 413 (body
    size, :mod:`api.limits`; ``/store/`` documents its own) come from outside
    the routes and are added here.
    """
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = generate()
        content = {PROBLEM_JSON: {"schema": {"$ref": "#/components/schemas/Problem"}}}
        for path, operations in schema.get("paths", {}).items():
            for operation in operations.values():
                responses = operation.setdefault("responses", {})
                if "422" in responses:
                    responses["422"] = {
                        "description": "The request is invalid; `errors` names each field",
                        "content": content,
                    }
                if path not in _PUBLIC_PATHS:
                    responses.setdefault(
                        "401", {"description": "No valid bearer token", "content": content}
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


def _include_store(app: FastAPI, daemon: Daemon | None, auth: list[object]) -> None:
    """Daemon-to-daemon store routes, served when this daemon hosts the embedded store."""
    try:
        from api.routes.store import store_router
    except ImportError:  # pragma: no cover - the store routes ship with the package
        return

    def get_store():  # type: ignore[no-untyped-def]
        assert daemon is not None
        return daemon.store

    limit = getattr(getattr(daemon, "config", None), "store_max_value_bytes", None)
    if limit is None:
        router = store_router(get_store)
    else:
        router = store_router(get_store, max_value_bytes=limit)
    app.include_router(router, dependencies=auth)  # type: ignore[arg-type]
