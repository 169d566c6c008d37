"""``create_app(daemon)``: the FastAPI app, thin over the daemon's service object.

Every route but ``/healthz`` requires the bearer token when one is
configured. Errors are problem+json from one table (:mod:`api.problems`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import Depends, FastAPI

from api.auth import bearer_auth
from api.problems import install_error_handlers
from api.routes import health, jobs, nodes, ui
from api.routes.metrics import metrics_router
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
    token = daemon.token if daemon is not None else None
    auth = [Depends(bearer_auth(token))]
    install_error_handlers(app)
    app.include_router(health.public)
    app.include_router(health.private, dependencies=auth)
    app.include_router(jobs.router, dependencies=auth)
    app.include_router(nodes.router, dependencies=auth)
    app.include_router(metrics_router(token, metrics_public=_metrics_public(daemon)))
    app.include_router(ui.router)  # static page, no data: served without the token
    _include_store(app, daemon, auth)
    return app


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

    app.include_router(store_router(get_store), dependencies=auth)  # type: ignore[arg-type]
