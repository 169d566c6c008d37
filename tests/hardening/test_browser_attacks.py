"""Web pages attack a tokenless daemon on loopback, in a real headless Chromium (issue 11, 2).

Debian's chromium, driven by Playwright (nothing downloaded), as in
``tests/observability/test_dashboard.py``; skipped when either is missing,
unless ``CI`` is set. The daemon is a real `elasticd serve` process with no
token, bound to 127.0.0.1, running a job ``victim``.

* **Cross-site requests**: a page served by another web server, on
  127.0.0.2 (another origin), sends what a browser lets any page send
  without asking: a ``no-cors`` fetch POSTing a job as ``text/plain``, an
  empty ``no-cors`` POST to ``/jobs/victim/cancel``, and an HTML form
  POSTing to ``/jobs/victim/cancel``.
* **DNS rebinding**: the browser resolves ``attacker.example`` to 127.0.0.1
  (``--host-resolver-rules``), except for the attacker's first answer: the
  page itself, which the test serves as the attacker's DNS and server would
  (Playwright fulfils that one request). The page's origin is then
  ``http://attacker.example:PORT`` with PORT the daemon's, so its fetches to
  ``/jobs`` are same-origin for the browser and reach the daemon: it reads
  the job list and store, submits a job and cancels ``victim``.

Every attack must be refused by the daemon (the test sees each response's
status through Playwright) and change nothing: no job created, ``victim``
still RUNNING.
"""

from __future__ import annotations

import asyncio
import http.server
import importlib.util
import json
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.hardening.support import Served, serve

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
MISSING = [
    what
    for what, ok in (
        ("chromium (apt-get install chromium)", CHROMIUM is not None),
        ("playwright (pip)", importlib.util.find_spec("playwright") is not None),
    )
    if not ok
]
if MISSING and not os.environ.get("CI"):
    pytestmark = [pytest.mark.slow, pytest.mark.skip(reason=f"needs {', '.join(MISSING)}")]
else:
    pytestmark = [pytest.mark.slow]

CHROMIUM_ARGS = [
    "--no-sandbox",  # CI runs as root
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--host-resolver-rules=MAP attacker.example 127.0.0.1",
    # Chromium blocks some requests from public pages to loopback (Private/Local Network
    # Access); other browsers do not, and the daemon must not rely on it.
    "--disable-features=BlockInsecurePrivateNetworkRequests,PrivateNetworkAccessSendPreflights,"
    "PrivateNetworkAccessRespectPreflightResults,LocalNetworkAccessChecks",
]
SLEEP = {"entrypoint": "/bin/sleep", "args": ["600"], "termination_grace": 1}


def _evil(marker: Path) -> dict[str, Any]:
    """A job that would prove code execution (it creates ``marker``): never may it run."""
    return {"entrypoint": "/bin/sh", "args": ["-c", f"touch {marker}"]}


CROSS_SITE = """<!doctype html>
<title>cute cats</title>
<iframe name="sink"></iframe>
<form id="cancel" method="post" target="sink" action="DAEMON/jobs/victim/cancel">
  <input name="x" value="y">
</form>
<pre id="result"></pre>
<script>
(async () => {
  const out = [];
  try {
    await fetch("DAEMON/jobs", {
      method: "POST", mode: "no-cors", headers: {"Content-Type": "text/plain"},
      body: JSON.stringify(Object.assign({id: "csrf-fetch"}, EVIL)),
    });
    out.push("fetch sent");
  } catch (e) { out.push("fetch failed " + e); }
  try {
    await fetch("DAEMON/jobs/victim/cancel", {method: "POST", mode: "no-cors"});
    out.push("cancel sent");
  } catch (e) { out.push("cancel failed " + e); }
  document.getElementById("result").textContent = out.join("\\n");
  document.title = "fetched";
})();
</script>
"""

REBOUND = """<!doctype html>
<title>rebound</title>
<pre id="result"></pre>
<script>
(async () => {
  const out = {};
  async function attempt(name, path, init) {
    try {
      const r = await fetch(path, init);
      out[name] = r.status;
      out[name + "_body"] = (await r.text()).slice(0, 300);
    } catch (e) { out[name] = "error " + e; }
  }
  const json = {"Content-Type": "application/json"};
  await attempt("list", "/jobs", {});
  await attempt("store", "/store/list?prefix=", {});
  await attempt("submit", "/jobs", {
    method: "POST", headers: json,
    body: JSON.stringify(Object.assign({id: "rebound"}, EVIL)),
  });
  await attempt("cancel", "/jobs/victim/cancel", {method: "POST", headers: json, body: "{}"});
  const result = document.getElementById("result");
  result.textContent = JSON.stringify(out);
  result.setAttribute("data-done", "1");
})();
</script>
"""


def _page(template: str, daemon_url: str, marker: Path) -> str:
    return template.replace("DAEMON", daemon_url).replace("EVIL", json.dumps(_evil(marker)))


@pytest.fixture
def attacker(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """Another web server, on 127.0.0.2: another origin than the daemon's."""
    pages: dict[str, str] = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            body = pages.get(self.path, "").encode()
            self.send_response(200 if body else 404)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.2", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield {"url": f"http://127.0.0.2:{server.server_address[1]}", "pages": pages}
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Served]:
    served = serve(tmp_path)
    try:
        asyncio.run(served.wait_ready())
        with httpx.Client(base_url=served.url, headers=served.headers, timeout=10) as c:
            assert c.post("/jobs", json={"id": "victim", **SLEEP}).status_code == 201
        yield served
    finally:
        served.stop()


def _unharmed(daemon: Served, marker: Path) -> None:
    with httpx.Client(base_url=daemon.url, headers=daemon.headers, timeout=10) as c:
        jobs = {j["id"]: j["state"] for j in c.get("/jobs").json()["jobs"]}
    assert jobs == {"victim": "RUNNING"}, jobs
    assert not marker.exists()


async def test_a_page_of_another_origin_cannot_submit_or_cancel(
    daemon: Served, attacker: dict[str, Any], tmp_path: Path
) -> None:
    """no-cors fetch POSTs (text/plain job, empty cancel) and a form POST to cancel, from a
    page on 127.0.0.2: each reaches the daemon and is refused (403 for the other Origin);
    no job is created and the victim keeps running."""
    assert not MISSING, f"CI is set but the browser test needs {', '.join(MISSING)}"
    from playwright.async_api import async_playwright

    marker = tmp_path / "pwned"
    attacker["pages"]["/cats.html"] = _page(CROSS_SITE, daemon.url, marker)
    seen: dict[str, list[int]] = {}
    async with asyncio.timeout(90), async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = await browser.new_page()
            page.on(
                "response",
                lambda r: (
                    seen.setdefault(f"{r.request.method} {r.url}", []).append(r.status)
                    if r.url.startswith(daemon.url)
                    else None
                ),
            )
            await page.goto(attacker["url"] + "/cats.html")
            await page.wait_for_function("document.title === 'fetched'")
            async with page.expect_response(lambda r: r.url.endswith("/cancel")) as form:
                await page.evaluate("document.getElementById('cancel').submit()")
            assert (await form.value).status == 403
            result = await page.inner_text("#result")
            assert "fetch sent" in result and "cancel sent" in result, result
        finally:
            await browser.close()
    assert seen.get(f"POST {daemon.url}/jobs") == [403], seen
    assert seen.get(f"POST {daemon.url}/jobs/victim/cancel") == [403, 403], seen
    _unharmed(daemon, marker)


async def test_dns_rebinding_cannot_read_submit_or_cancel(daemon: Served, tmp_path: Path) -> None:
    """A page whose origin is attacker.example:PORT, rebound to 127.0.0.1: its same-origin
    fetches reach the daemon and are all refused (401: the page has no identity, neither a
    token nor the unix socket, and loopback is none); it reads nothing, creates nothing and
    cancels nothing."""
    assert not MISSING, f"CI is set but the browser test needs {', '.join(MISSING)}"
    from playwright.async_api import Route, async_playwright

    marker = tmp_path / "pwned"
    origin = f"http://attacker.example:{daemon.port}"
    async with asyncio.timeout(90), async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = await browser.new_page()

            async def first_answer(route: Route) -> None:
                # The attacker's server answers the page itself (before the rebinding);
                # every later request resolves attacker.example to 127.0.0.1: the daemon.
                await route.fulfill(
                    status=200, content_type="text/html", body=_page(REBOUND, daemon.url, marker)
                )

            await page.route(f"{origin}/attack.html", first_answer)
            await page.goto(f"{origin}/attack.html")
            await page.wait_for_selector("#result[data-done]")
            out = json.loads(await page.inner_text("#result"))
        finally:
            await browser.close()
    for name in ("list", "store", "submit", "cancel"):
        assert out[name] == 401, out
    assert "victim" not in out["list_body"] and "victim" not in out["store_body"], out
    _unharmed(daemon, marker)
