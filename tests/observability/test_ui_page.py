"""/ui: one static, self-contained page, served without the token under a strict CSP."""

from __future__ import annotations

import asyncio
import re

import httpx

from api.app import create_app
from tests.conftest import make_daemon


async def test_page_is_public_static_and_locked_down(tmp_path):
    """The page needs no token (it holds no data); / redirects to it; the CSP allows only itself."""
    d = make_daemon(tmp_path, token="s3cret")
    async with asyncio.timeout(30):
        await d.start()
        try:
            transport = httpx.ASGITransport(app=create_app(d))
            async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
                root = await c.get("/")
                assert root.status_code == 307 and root.headers["location"] == "/ui"
                page = await c.get("/ui")
                assert (await c.get("/jobs")).status_code == 401  # the data still needs it
        finally:
            await d.shutdown()
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    assert "frame-ancestors 'none'" in csp and "unsafe" not in csp
    assert re.search(r"script-src 'sha256-[A-Za-z0-9+/=]+'", csp)
    html = page.text
    assert "s3cret" not in html and "node-a" not in html
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", html), "no CDN, no remote assets"
    assert "sessionStorage" in html and "Authorization" in html and "EventSource" not in html
    # What the page shows is job text (names, messages, log lines): never parsed as markup.
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
        assert sink not in html, sink
