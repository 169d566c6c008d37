"""``/ui``: the dashboard, one self-contained page (inline JS and CSS, no build step, no CDN).

The page is served without authentication: it is the same static text for
everyone and holds no data. Everything it shows comes from the API, which
needs the bearer token as usual. The page asks for the token once, keeps it
in the tab's ``sessionStorage`` and sends it only in the ``Authorization``
header: the live event tail is read with ``fetch()`` and a streaming reader
instead of ``EventSource`` (which cannot send headers), so the token never
appears in a URL, a server or proxy access log, or the browser history, and
the daemon needs no second credential (signed query tokens, cookies and the
CSRF protection a cookie would then need).

The response carries a strict Content-Security-Policy: only this page's own
inline script and style (by hash), requests only to this origin, no framing.

Cancelling a job from the page is a ``fetch()`` POST with the same bearer
header as every call, never a form or a cookie, so another site's page can
neither forge it (it has no token) nor ride on a session (there is none).

``/favicon.ico`` is a small inline SVG (public, like the page), so a browser's
request for it gets an icon instead of a 404.
"""

from __future__ import annotations

import base64
import hashlib
import re
from functools import lru_cache
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, RedirectResponse, Response

router = APIRouter(tags=["ui"])

#: The dashboard's icon: a rising line on the header's colour. Served as SVG at the path
#: browsers ask for by default; an SVG is never run as a document here (its own CSP).
FAVICON = (
    '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 32 32">'
    '<rect width="32" height="32" rx="6" fill="#1d2330"/>'
    '<path d="M6 23 L13 13 L18 19 L26 8" fill="none" stroke="#1f9d55" stroke-width="3.5" '
    'stroke-linecap="round" stroke-linejoin="round"/></svg>'
)


#: Where the dashboard is served (``elasticd serve`` and ``run`` print its URL).
DASHBOARD_PATH = "/ui"


def _hash(source: str) -> str:
    digest = hashlib.sha256(source.encode()).digest()
    return "'sha256-" + base64.b64encode(digest).decode() + "'"


@lru_cache(maxsize=1)
def page() -> tuple[str, str]:
    """The dashboard's HTML and the Content-Security-Policy that allows exactly it."""
    html = resources.files("api").joinpath("static/dashboard.html").read_text(encoding="utf-8")
    scripts = [_hash(s) for s in re.findall(r"<script>(.*?)</script>", html, re.S)]
    styles = [_hash(s) for s in re.findall(r"<style>(.*?)</style>", html, re.S)]
    csp = "; ".join(
        [
            "default-src 'none'",
            f"script-src {' '.join(scripts)}",
            f"style-src {' '.join(styles)}",
            "connect-src 'self'",
            "img-src 'self' data:",
            "base-uri 'none'",
            "form-action 'none'",
            "frame-ancestors 'none'",
        ]
    )
    return html, csp


@router.get("/", include_in_schema=False)
async def root() -> RedirectResponse:
    return RedirectResponse(DASHBOARD_PATH, status_code=307)


@router.get(
    DASHBOARD_PATH, response_class=HTMLResponse, summary="Dashboard page (no data, no auth)"
)
async def dashboard() -> HTMLResponse:
    """The dashboard: jobs, worker grids, the last recovery, live events. Static; no auth."""
    html, csp = page()
    return HTMLResponse(
        html,
        headers={
            "Content-Security-Policy": csp,
            "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer",
            "Cache-Control": "no-cache",
        },
    )


@router.get("/favicon.ico", include_in_schema=False)
async def favicon() -> Response:
    """The dashboard's icon (SVG). Static; no auth."""
    return Response(
        FAVICON,
        media_type="image/svg+xml",
        headers={
            "Content-Security-Policy": "default-src 'none'",
            "X-Content-Type-Options": "nosniff",
            "Cache-Control": "max-age=86400",
        },
    )
