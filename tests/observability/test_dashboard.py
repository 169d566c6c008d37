"""The dashboard in a real headless Chromium (Debian's, driven by Playwright; nothing downloaded).

The first test runs an in-process daemon; the others run ``elasticd serve`` subprocesses
(tests/hardening/support.py) with real jobs: the log viewer, cancel (confirmed, and
refused for another identity's job), the grid and event tail after a cancel, hash routing
with back and forward, the wording of a job that succeeded after a failure, a failed job's
log pane on its failed rank's stderr, the attempt picker, the goodput panel, a phone-width
layout and the favicon; and, on two `elasticd serve` nodes (tests/e2e/cluster.py), the culprit of a
failed job shown first, with its stderr, and its collateral apart.

Skipped when chromium or Playwright is missing, unless ``CI`` is set: then it
fails, so CI cannot silently stop testing the page. The screenshots go to
``$ELASTICD_ARTIFACTS`` (CI keeps them) or the test's temporary folder. The cancel, the
failed job's stderr and the attempt picker each photograph the state they assert
(:func:`snapshot`); with ``ELASTICD_DOCS_SCREENSHOTS=docs`` (``make screenshots``) those
pictures also replace ``docs/dashboard-cancelled.png``, ``-failed-stderr.png`` and
``-attempt-picker.png``.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import shutil
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from elasticd.identity import hash_token, new_token
from tests.conftest import PY, script
from tests.e2e.cluster import TOKEN, LocalCluster, follow_until, job_ended
from tests.hardening.support import Served, serve
from tests.observability.support import CRASH_ONCE, live_daemon, url_of
from tests.observability.test_goodput import HOLD_AT, JOB_ENV, STEP_S
from tests.observability.test_goodput import WORKER as GOODPUT_WORKER

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
                    # The timeline's numbers are the recovery events' (same source, same format).
                    events = (await api.get("/jobs/resnet-demo/events")).json()
                    took = {
                        e["kind"]: e["duration_s"] for e in events if e["duration_s"] is not None
                    }
                    for phase, kind in (
                        ("workers stopped", "recovery.stop_workers"),
                        ("rendezvous complete", "recovery.rendezvous"),
                        ("workers spawned", "recovery.spawn"),
                    ):
                        shown = f"{took[kind]:.3f}s"
                        assert f"+{shown}" in await page.inner_text(
                            f'#timeline li[data-phase="{phase}"]'
                        )
                        row = await page.inner_text(f'#event-rows tr[data-kind="{kind}"]')
                        assert f"[{shown}]" in row
                    assert f"total: {took['recovery.total']:.3f}s" in timeline
                    # RUNNING again: the header says so, not the failure's "restarting the group",
                    # and the failure it survived is its "last failure", not a root cause.
                    await page.wait_for_selector('#job-head .badge[data-state="RUNNING"]')
                    await page.wait_for_selector(
                        '#reason:has-text("running again after 1 restart")'
                    )
                    reason = await page.inner_text("#reason")
                    assert "restarting the group" not in reason
                    assert "last failure: rank 2" in reason and "root cause" not in reason
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


# --- the page against `elasticd serve` ---------------------------------------------------

#: Prints a line the page must show as text, waits for the test's go file, prints again.
TALKER = """
import os, pathlib, sys, time
rank = os.environ["RANK"]
print(f"hello from rank {rank} <b>not bold</b>", flush=True)
go = pathlib.Path(sys.argv[1])
while not go.exists():
    time.sleep(0.05)
print(f"rank {rank} saw the go file", flush=True)
time.sleep(600)
"""


ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Session:
    """A served daemon, an admin client of its API, and a Chromium page with its problems."""

    daemon: Served
    api: httpx.AsyncClient
    page: Any
    problems: list[str]
    folder: Path

    async def snapshot(self, name: str, height: int) -> None:
        """A picture of the state the test just asserted: the page's top ``height`` px (the
        viewport, that tall), ``dashboard-NAME.png`` in ``$ELASTICD_ARTIFACTS`` (else the
        test's folder) and, given ``$ELASTICD_DOCS_SCREENSHOTS`` (a folder; relative: to the
        checkout), there too: how the docs' pictures are made."""
        width = self.page.viewport_size["width"]
        await self.page.set_viewport_size({"width": width, "height": height})
        await self.page.evaluate("window.scrollTo(0, 0)")
        folders = [Path(os.environ.get("ELASTICD_ARTIFACTS") or self.folder)]
        if docs := os.environ.get("ELASTICD_DOCS_SCREENSHOTS"):
            folders.append(ROOT / docs)
        for folder in folders:
            folder.mkdir(parents=True, exist_ok=True)
            await self.page.screenshot(path=str(folder / f"dashboard-{name}.png"))

    async def submit(self, job_id: str, args: list[str], n: int = 1) -> None:
        spec = {"id": job_id, "entrypoint": PY, "args": args, "nproc_per_node": n}
        r = await self.api.post("/jobs", json={**spec, "termination_grace": 1})
        assert r.status_code == 201, r.text

    async def sign_in(self, fragment: str = "", token: str | None = None) -> None:
        """Open the dashboard (at ``#fragment``) and give it the token when it asks."""
        await self.page.goto(self.daemon.url + "/ui" + fragment)
        await self.page.wait_for_selector("#token-dialog[open]")
        await self.page.fill("#token-input", token or self.daemon.token or "")
        await self.page.click("#token-form button[type=submit]")
        await self.page.wait_for_selector("#conn.live")


@contextlib.asynccontextmanager
async def browser_page(width: int = 1280, height: int = 900) -> AsyncIterator[tuple[Any, list]]:
    """A fresh headless Chromium's page, and the script errors and 404s it meets."""
    assert not MISSING, f"CI is set but the browser test needs {', '.join(MISSING)}"
    from playwright.async_api import async_playwright

    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = await browser.new_page(viewport={"width": width, "height": height})
            problems: list[str] = []
            page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
            page.on(
                "response",
                lambda r: problems.append(f"404: {r.url}") if r.status == 404 else None,
            )
            yield page, problems
        finally:
            await browser.close()


@contextlib.asynccontextmanager
async def session(
    tmp_path: Path, *, width: int = 1280, height: int = 900, env: dict[str, str] | None = None
) -> AsyncIterator[Session]:
    """`elasticd serve` and a fresh headless Chromium; afterwards the page met no script
    error and no 404."""
    daemon = serve(tmp_path, env=env)
    try:
        async with (
            asyncio.timeout(60),
            daemon.client() as api,
            browser_page(width, height) as (page, problems),
        ):
            await daemon.wait_ready()
            yield Session(daemon, api, page, problems, tmp_path)
    finally:
        daemon.stop()
    assert problems == []


async def test_the_log_viewer_shows_a_workers_lines_as_text_and_follows_them(tmp_path):
    """Rank 1's stdout appears, its markup shown as text, and a later line arrives live."""
    go = tmp_path / "go"
    async with session(tmp_path) as s:
        await s.submit("talker", [script(tmp_path, "talk.py", TALKER), str(go)], n=2)
        await s.sign_in("#talker")
        await s.page.wait_for_selector('#log-worker option[data-local="1"]', state="attached")
        await s.page.select_option("#log-worker", label="rank 1 (hard-node, local 1)")
        log = s.page.locator("#log-text")
        await log.filter(has_text="hello from rank 1 <b>not bold</b>").wait_for()
        assert await s.page.locator("#log-text b").count() == 0
        assert "rank 0" not in await log.inner_text()
        go.touch()
        await log.filter(has_text="rank 1 saw the go file").wait_for()
        assert await s.page.text_content("#log-note") == "(following)"


async def test_cancel_asks_first_then_cancels_the_job(tmp_path):
    """Cancel opens a confirmation; 'keep' changes nothing; confirming ends the job CANCELLED."""
    async with session(tmp_path) as s:
        await s.submit("sleeper", ["-c", "import time; time.sleep(600)"])
        await s.sign_in("#sleeper")
        button = s.page.locator('#job-head button[data-action="cancel"]')
        await button.click()
        await s.page.wait_for_selector("#cancel-dialog[open]")
        assert await s.page.inner_text("#cancel-job") == "sleeper"
        await s.page.click("#cancel-keep")
        await s.page.wait_for_selector("#cancel-dialog", state="hidden")
        assert (await s.api.get("/jobs/sleeper")).json()["state"] == "RUNNING"
        await button.click()
        await s.page.click("#cancel-confirm")
        await s.page.wait_for_selector('#job-head .badge[data-state="CANCELLED"]')
        assert (await s.api.get("/jobs/sleeper")).json()["state"] == "CANCELLED"
        assert await button.count() == 0  # an ended job has nothing to cancel
        assert await s.page.inner_text("#job-error") == ""


async def test_after_a_cancel_the_grid_and_the_event_tail_follow_the_job_to_its_end(tmp_path):
    """Cancelled while shown: the grid leaves HEALTHY and the event tail goes on past the job's
    end to its workers' exits and the agent's ``agent.finished``."""
    async with session(tmp_path) as s:
        await s.submit("doomed", ["-c", "import time; time.sleep(600)"], n=2)
        await s.sign_in("#doomed")
        await s.page.locator('#workers .worker[data-state="HEALTHY"]').nth(1).wait_for()
        await s.page.click('#job-head button[data-action="cancel"]')
        await s.page.click("#cancel-confirm")
        await s.page.wait_for_selector('#job-head .badge[data-state="CANCELLED"]')
        for kind in ("worker.exited", "workers.stopped", "agent.finished"):
            await s.page.wait_for_selector(f'#event-rows tr[data-kind="{kind}"]', state="attached")
        await s.page.wait_for_selector('#events-note:has-text("job ended")')
        await s.page.wait_for_selector('#workers .group-head .badge:not([data-state="HEALTHY"])')
        assert await s.page.locator('#workers [data-state="HEALTHY"]').count() == 0
        await s.snapshot("cancelled", 1250)


async def test_a_refused_cancel_shows_the_apis_error(tmp_path):
    """Another identity's cancel of the admin's job: the page shows the 403 and its reason."""
    token = new_token()
    identities = tmp_path / "identities.toml"
    identities.write_text(
        f'[[identity]]\nname = "viewer"\ntoken_sha256 = "{hash_token(token)}"\nusers = ["nobody"]\n'
    )
    async with session(tmp_path, env={"ELASTICD_IDENTITIES_FILE": str(identities)}) as s:
        await s.submit("admins", ["-c", "import time; time.sleep(600)"])
        await s.sign_in("#admins", token=token)
        await s.page.click('#job-head button[data-action="cancel"]')
        await s.page.click("#cancel-confirm")
        error = s.page.locator("#job-error")
        await error.filter(has_text="(403)").wait_for()
        text = await error.inner_text()
        assert text.startswith("cancel refused: ")
        assert "only its owner or an admin may cancel it" in text
        assert (await s.api.get("/jobs/admins")).json()["state"] == "RUNNING"


async def test_the_hash_and_back_and_forward_choose_the_job(tmp_path):
    """A click adds a history entry; back, forward and an edited #fragment switch the job."""

    async def shown(page: Any, job_id: str, seconds: str) -> None:
        await page.wait_for_selector(f'#job-head .id[data-job="{job_id}"]')
        await page.wait_for_selector(f'#cmd:has-text("time.sleep({seconds})")')

    async with session(tmp_path) as s:
        await s.submit("alpha", ["-c", "import time; time.sleep(600)"])
        await s.submit("beta", ["-c", "import time; time.sleep(601)"])
        await s.sign_in("#alpha")
        await shown(s.page, "alpha", "600")
        await s.page.click('tr.job-row[data-job="beta"]')
        await shown(s.page, "beta", "601")
        assert s.page.url.endswith("/ui#beta")
        await s.page.go_back()
        await shown(s.page, "alpha", "600")
        await s.page.go_forward()
        await shown(s.page, "beta", "601")
        await s.page.goto(s.daemon.url + "/ui#alpha")  # the user edits the fragment
        await shown(s.page, "alpha", "600")
        selected = s.page.locator("tr.job-row.selected")
        assert await selected.get_attribute("data-job") == "alpha"


async def test_a_job_that_succeeded_after_a_failure_shows_its_last_failure(tmp_path):
    """SUCCEEDED after a crash and a restart: 'last failure' (as the CLI says), no root cause."""
    async with session(tmp_path) as s:
        await s.submit("flaky", [script(tmp_path, "crash.py", CRASH_ONCE)], n=2)
        await s.sign_in("#flaky")
        await s.page.wait_for_selector('#job-head .badge[data-state="SUCCEEDED"]')
        await s.page.wait_for_selector('#reason details[data-label="last failure"]')
        reason = await s.page.inner_text("#reason")
        assert "every worker exited 0" in reason
        assert "last failure: rank 1" in reason and "root cause" not in reason


#: Rank 1 writes its failure to stderr and exits 3; rank 0 prints to stdout and waits.
FAILS_ON_RANK_1 = """
import os, sys, time
print("rank", os.environ["RANK"], "is fine", flush=True)
if os.environ["RANK"] == "1":
    print("rank 1 fell over", file=sys.stderr, flush=True)
    sys.exit(3)
time.sleep(600)
"""


async def test_a_failed_jobs_log_pane_opens_on_the_failed_ranks_stderr(tmp_path):
    """A FAILED job's log pane shows the failed rank's stderr (its attempt), not rank 0's
    stdout."""
    async with session(tmp_path) as s:
        spec = {
            "id": "broken", "entrypoint": PY, "args": [script(tmp_path, "f.py", FAILS_ON_RANK_1)],
            "nproc_per_node": 2, "max_restarts": 0, "termination_grace": 1,
        }  # fmt: skip
        assert (await s.api.post("/jobs", json=spec)).status_code == 201
        await follow_until(s.api, "broken", job_ended, 30)
        await s.sign_in("#broken")
        await s.page.wait_for_selector('#job-head .badge[data-state="FAILED"]')
        log = s.page.locator("#log-text")
        await log.filter(has_text="rank 1 fell over").wait_for()
        assert await log.get_attribute("data-key") == "hard-node/1"
        assert await log.get_attribute("data-stream") == "stderr"
        assert await s.page.input_value("#log-stream") == "stderr"
        assert await s.page.input_value("#log-worker") == "hard-node/1"
        await s.snapshot("failed-stderr", 740)


async def test_the_attempt_picker_shows_an_earlier_attempts_log(tmp_path):
    """Rank 1 crashed in attempt 0 and not in attempt 1: its stderr's attempt 0 shows the
    crash, the latest does not."""
    async with session(tmp_path) as s:
        await s.submit("twice", [script(tmp_path, "crash.py", CRASH_ONCE)], n=2)
        await s.sign_in("#twice")
        await s.page.wait_for_selector('#job-head .badge[data-state="SUCCEEDED"]')
        await s.page.wait_for_selector('#log-attempt option[value="1"]', state="attached")
        await s.page.select_option("#log-worker", value="hard-node/1")
        await s.page.select_option("#log-stream", value="stderr")
        log = s.page.locator("#log-text")
        await s.page.wait_for_selector('#log-text[data-key="hard-node/1"][data-stream="stderr"]')
        await s.page.select_option("#log-attempt", value="0")
        await log.filter(has_text="crashing").wait_for()
        assert await log.get_attribute("data-attempt") == "0"
        await s.page.wait_for_selector('#log-note:not(:has-text("loading"))')
        await s.snapshot("attempt-picker", 600)
        await s.page.select_option("#log-attempt", value="1")
        await s.page.wait_for_selector('#log-text[data-attempt="1"]')
        await s.page.wait_for_selector('#log-note:not(:has-text("loading"))')
        assert "crashing" not in await log.inner_text()


async def test_at_phone_width_nothing_overflows_sideways(tmp_path):
    """At 375 px, with a long job id, a 4-worker grid, events and a long log line, the page
    is no wider than the screen (wide content scrolls in its own box)."""
    job_id = "a-rather-long-job-name-" + "x" * 60
    long_line = "print('y' * 400 + ' ' + 'z ' * 200, flush=True); import time; time.sleep(600)"
    async with session(tmp_path, width=375, height=800) as s:
        await s.submit(job_id, ["-c", long_line], n=4)
        await s.sign_in("#" + job_id)
        await s.page.locator('#workers .worker[data-state="HEALTHY"]').nth(3).wait_for()
        await s.page.locator("#log-text").filter(has_text="yyyy").wait_for()
        await s.page.wait_for_selector('#event-rows tr[data-kind="workers.started"]')
        width = await s.page.evaluate("document.documentElement.scrollWidth")
        inner = await s.page.evaluate("window.innerWidth")
        assert inner == 375
        assert width <= inner, f"the page is {width} px wide on a {inner} px screen"


async def test_the_favicon_is_served(tmp_path):
    """No 404 while the page loads, and /favicon.ico answers an SVG icon without a token."""
    async with session(tmp_path) as s:
        await s.sign_in()
        icon = await s.page.goto(s.daemon.url + "/favicon.ico")
        assert icon is not None and icon.status == 200
        assert icon.headers["content-type"].startswith("image/svg+xml")
        assert (await icon.text()).startswith("<svg")


async def test_the_goodput_panel_shows_where_the_time_went(tmp_path):
    """A job with checkpoints and one crash: the bar has its productive and lost-work parts
    (the API's seconds), the step chart one line per attempt, its checkpoints and the failure."""
    work = tmp_path / "work"
    work.mkdir()
    worker = script(tmp_path, "steps.py", GOODPUT_WORKER.format(step_s=STEP_S, hold_at=HOLD_AT))
    artifacts = Path(os.environ.get("ELASTICD_ARTIFACTS") or tmp_path)
    async with session(tmp_path) as s:
        spec = {"id": "steps", "entrypoint": PY, "args": [worker, str(work)], "env": JOB_ENV}
        assert (await s.api.post("/jobs", json=spec)).status_code == 201
        await s.sign_in("#steps")
        await s.page.wait_for_selector('#job-head .badge[data-state="SUCCEEDED"]')
        g = (await s.api.get("/jobs/steps/goodput")).json()
        await s.page.wait_for_selector('#goodput .bar .seg[data-kind="lost_work"]')
        for kind in ("productive", "lost_work", "recovery", "startup"):
            shown = await s.page.get_attribute(f'#goodput li[data-kind="{kind}"]', "data-seconds")
            expected = g["productive_s"] if kind == "productive" else g["badput_s"][kind]
            assert float(shown or "nan") == pytest.approx(expected, abs=0.5), kind
        assert "lost 15 over 1 failure(s)" in await s.page.inner_text("#goodput .steps")
        assert await s.page.locator("#goodput svg polyline").count() == 2  # two attempts
        assert await s.page.locator("#goodput svg circle.ckpt").count() >= 5
        assert await s.page.locator('#goodput svg line.fail[data-end="failed"]').count() == 1
        await s.page.locator("#goodput").screenshot(path=str(artifacts / "goodput.png"))


# --- the culprit, on two nodes ------------------------------------------------------------

#: What the culprit raises: a job writes its own root cause, and this one is markup.
HOSTILE = "rank 1 crashed <img src=x onerror=document.title='pwned'>"

#: Rank 1 raises and, after a slow teardown, exits; rank 0 waits on a socket to it (as a
#: collective waits on its peers) and dies of losing it: the collateral failure.
CULPRIT = f"""
import os, socket, sys, time, traceback
address = "\\0" + sys.argv[1]  # an abstract socket: no path to clean up
if os.environ["RANK"] == "0":
    server = socket.socket(socket.AF_UNIX)
    server.bind(address)
    server.listen(1)
    peer, _ = server.accept()
    peer.recv(1)  # b"": rank 1 is gone
    raise ConnectionResetError("Connection reset by peer: rank 1 went away")
while True:
    try:
        link = socket.socket(socket.AF_UNIX)
        link.connect(address)
        break
    except OSError:
        time.sleep(0.05)
try:
    raise RuntimeError({HOSTILE!r})
except RuntimeError:
    traceback.print_exc()
    sys.stderr.flush()
time.sleep(1.0)  # its error is a second older than its exit, and the survivor's
os._exit(1)
"""


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_the_culprit_comes_first_with_its_stderr_and_the_collateral_apart(tmp_path):
    """A 2-node job whose rank 1 raises: the page's first panel names rank 1 and its node,
    shows its (hostile) message as text and links to that rank's stderr through the API;
    rank 0's "connection reset" is listed apart, as collateral."""
    cluster = LocalCluster(tmp_path, slots=1)
    try:
        async with asyncio.timeout(150):
            await cluster.start_all("n0", "n1")
            worker = script(tmp_path, "culprit.py", CULPRIT)
            spec = {
                "id": "blame", "entrypoint": PY, "args": [worker, f"elasticd-{tmp_path.name}"],
                "nproc_per_node": 1, "min_nodes": 2, "max_nodes": 2, "max_restarts": 0,
                "termination_grace": 3,
            }  # fmt: skip
            async with cluster.client("n0") as api:
                assert (await api.post("/jobs", json=spec)).status_code == 201
                await follow_until(api, "blame", job_ended, 90)
                job = (await api.get("/jobs/blame")).json()
                assert job["state"] == "FAILED", cluster.logs()
                error, collateral = job["error"], job["collateral"]
                assert (error["rank"], error["message"]) == (1, f"RuntimeError: {HOSTILE}"), job
                assert [(c["rank"], c["node"] != error["node"]) for c in collateral] == [(0, True)]
                await check_the_culprit_panel(cluster, api, error, collateral[0])
    finally:
        cluster.stop_all()


async def check_the_culprit_panel(
    cluster: LocalCluster, api: httpx.AsyncClient, error: dict, bystander: dict
) -> None:
    async with browser_page() as (page, problems):
        await page.goto(cluster.nodes["n0"].url + "/ui#blame")
        await page.wait_for_selector("#token-dialog[open]")
        await page.fill("#token-input", TOKEN)
        await page.click("#token-form button[type=submit]")
        await page.wait_for_selector("#culprit .who")
        # First: the culprit panel leads the job's column, its cause before its collateral.
        order = await page.evaluate(
            "[...document.querySelectorAll('#detail > section, #culprit-cause, #collateral')]"
            ".filter((e) => !e.hidden).map((e) => e.id)"
        )
        assert order[:4] == ["culprit", "culprit-cause", "collateral", "job-panel"], order
        who = page.locator("#culprit .who")
        assert await who.inner_text() == f"rank 1 on node {error['node']}"
        # The job's own text is text: no element made of it, nothing run.
        assert await page.inner_text("#culprit .why") == f"RuntimeError: {HOSTILE}"
        assert await page.locator("img").count() == 0
        assert "pwned" not in await page.title()
        # Apart: one collateral failure, rank 0 on the other node, not in the cause.
        items = page.locator("#collateral li")
        assert await items.count() == 1
        assert await items.get_attribute("data-node") == bystander["node"]
        assert (await items.inner_text()).startswith(f"rank 0 on {bystander['node']}")
        assert "Connection reset by peer" in await items.inner_text()
        assert "Connection reset" not in await page.inner_text("#culprit-cause")
        # The link: that rank's stderr (its node, local rank, attempt) by the logs route.
        link = page.locator("#culprit-cause a.stderr-link")
        href = await link.get_attribute("href")
        node = error["node"]
        assert href == f"/jobs/blame/logs?local_rank=0&stream=stderr&node={node}&attempt=0"
        assert f"RuntimeError: {HOSTILE}" in (await api.get(href)).text
        artifacts = Path(os.environ.get("ELASTICD_ARTIFACTS") or cluster.root)
        await page.screenshot(path=str(artifacts / "culprit.png"))
        # Followed, it opens in the page's log viewer, fetched with the token.
        await link.click()
        log = page.locator("#log-text")
        await log.filter(has_text=f"RuntimeError: {HOSTILE}").wait_for()
        assert await log.get_attribute("data-key") == f"{node}/0"
        assert await log.get_attribute("data-stream") == "stderr"
        assert await page.locator("img").count() == 0
        assert "Connection reset" not in await log.inner_text()
    assert problems == []
