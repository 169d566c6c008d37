"""The dashboard in a real headless Chromium (Debian's, driven by Playwright; nothing downloaded).

Skipped when chromium or Playwright is missing, unless ``CI`` is set: then it
fails, so CI cannot silently stop testing the page. The screenshot goes to
``$ELASTICD_ARTIFACTS`` (CI keeps it) or the test's temporary folder.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import shutil
import signal
from pathlib import Path

import httpx
import pytest

from tests.conftest import PY, script
from tests.observability.support import live_daemon, url_of

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
    pytestmark = pytest.mark.skip(reason=f"needs {', '.join(MISSING)}")

CHROMIUM_ARGS = [
    "--no-sandbox",  # CI runs as root
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

# Attempt 0 runs until killed; attempt 1 keeps running (a healthy grid for the screenshot).
WORKER = "import time\nprint('training', flush=True)\ntime.sleep(60)\n"


async def test_dashboard_shows_workers_and_the_restart(tmp_path):
    """Token prompt, job list, HEALTHY grid, a killed worker's restart on the timeline, live."""
    assert not MISSING, f"CI is set but the browser test needs {', '.join(MISSING)}"
    from playwright.async_api import async_playwright

    token = "s3cret-token"
    auth = {"Authorization": f"Bearer {token}"}
    d = live_daemon(tmp_path, token=token)
    artifacts = Path(os.environ.get("ELASTICD_ARTIFACTS") or tmp_path)
    os.makedirs(artifacts, exist_ok=True)
    problems: list[str] = []
    async with asyncio.timeout(90):
        await d.start()
        try:
            async with (
                httpx.AsyncClient(base_url=url_of(d), headers=auth, timeout=30) as api,
                async_playwright() as pw,
            ):
                browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
                try:
                    page = await browser.new_page(viewport={"width": 1280, "height": 1000})
                    page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
                    page.on(
                        "console",
                        lambda msg: problems.append(msg.text) if msg.type == "error" else None,
                    )
                    await page.goto(url_of(d) + "/")
                    assert page.url.endswith("/ui")
                    # No token yet: the API answers 401 and the page asks for one.
                    await page.wait_for_selector("#token-dialog[open]", timeout=10_000)
                    await page.fill("#token-input", token)
                    await page.click("#token-form button[type=submit]")
                    # Connected with the token: the 401s before it (and their console errors,
                    # which may arrive late) are expected; only later ones are problems.
                    await page.wait_for_selector("#conn.live")
                    problems.clear()

                    path = script(tmp_path, "train.py", WORKER)
                    r = await api.post(
                        "/jobs",
                        json={
                            "id": "resnet-demo",
                            "entrypoint": PY,
                            "args": [path],
                            "nproc_per_node": 4,
                            "termination_grace": 1,
                        },
                    )
                    assert r.status_code == 201
                    await page.wait_for_selector('tr.job-row[data-job="resnet-demo"]')
                    await page.click('tr.job-row[data-job="resnet-demo"]')
                    # Selectors only: the page's CSP forbids the eval that wait_for_function uses.
                    healthy = page.locator('#workers .worker[data-state="HEALTHY"]')
                    await healthy.nth(3).wait_for()

                    view = (await api.get("/jobs/resnet-demo/workers")).json()
                    victim = next(w for w in view["groups"][0]["workers"] if w["rank"] == 2)
                    os.kill(victim["pid"], signal.SIGKILL)

                    await page.wait_for_selector('#event-rows tr[data-kind="group.restarting"]')
                    await page.wait_for_selector('#timeline li[data-phase="workers spawned"]')
                    await page.wait_for_selector('#workers .group-head:has-text("attempt 1")')
                    await healthy.nth(3).wait_for()
                    await page.wait_for_selector('#job-head:has-text("1 / 3")')
                    timeline = await page.inner_text("#timeline")
                    for phase in ("failure detected", "workers stopped", "rendezvous complete"):
                        assert phase in timeline
                    assert "signal 9" in timeline or "SIGKILL" in timeline
                    jobs_table = await page.inner_text("#jobs")
                    assert "resnet-demo" in jobs_table and "RUNNING" in jobs_table
                    # A job that needs more slots than are free waits, and the page says why.
                    r = await api.post(
                        "/jobs", json={"id": "waiting", "entrypoint": PY, "nproc_per_node": 8}
                    )
                    assert r.status_code == 201
                    await page.wait_for_selector('tr.queue-row[data-job="waiting"]')
                    queue_text = await page.inner_text("#queue")
                    assert "needs 1 node with 8 free slots" in queue_text
                    await page.screenshot(path=str(artifacts / "dashboard.png"), full_page=True)
                finally:
                    await browser.close()
        finally:
            await d.shutdown()
    assert problems == []
