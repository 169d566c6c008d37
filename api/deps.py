"""How routes reach the daemon: through ``app.state``, set by ``create_app``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import Request

if TYPE_CHECKING:
    from api.streams import StreamLimit
    from elasticd.node.daemon import Daemon
    from elasticd.node.jobs import JobService


def daemon_of(request: Request) -> Daemon:
    daemon: Daemon = request.app.state.daemon
    return daemon


def jobs_of(request: Request) -> JobService:
    return daemon_of(request).jobs


def streams_of(request: Request) -> StreamLimit:
    """The app's limit on live streams (log follows, SSE)."""
    limit: StreamLimit = request.app.state.streams
    return limit
