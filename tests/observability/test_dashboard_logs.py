"""The dashboard's way to a worker's log, in a real headless Chromium (issue 41): a worker
tile's "log" opens that worker's log in the viewer, and Download saves the log the viewer
shows as a file, read with the token in its header (never a cookie or a URL)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import PY, script
from tests.e2e.cluster import follow_until, job_ended
from tests.observability.test_dashboard import MISSING, Session, session

#: Rank 0 says it is fine, then rank 1 fails (only after that: rank 0's line is in its log
#: before the group is stopped, however loaded the machine).
FAILS_AFTER_RANK_0 = """
import os, sys, time
from pathlib import Path
said = Path(sys.argv[1])
if os.environ["RANK"] == "0":
    print("rank 0 is fine", flush=True)
    said.touch()
    time.sleep(600)
deadline = time.monotonic() + 60
while not said.exists() and time.monotonic() < deadline:
    time.sleep(0.02)
print("rank 1 fell over", file=sys.stderr, flush=True)
sys.exit(3)
"""

if MISSING and not os.environ.get("CI"):
    pytestmark = pytest.mark.skip(reason=f"needs {', '.join(MISSING)}")


async def test_a_worker_tiles_log_opens_that_workers_log(tmp_path):
    """Rank 1's tile opens rank 1's stderr (it failed) in the viewer; rank 0's, its stdout."""
    async with session(tmp_path) as s:
        await failed_and_shown(s, tmp_path, "tiles")
        await s.page.wait_for_selector('#job-head .badge[data-state="FAILED"]')
        await s.page.click('.worker[data-rank="0"] .tile-log')
        log = s.page.locator("#log-text")
        await s.page.wait_for_selector('#log-text[data-key="hard-node/0"][data-stream="stdout"]')
        await log.filter(has_text="rank 0 is fine").wait_for()
        await s.page.click('.worker[data-rank="1"] .tile-log')
        await s.page.wait_for_selector('#log-text[data-key="hard-node/1"][data-stream="stderr"]')
        await log.filter(has_text="rank 1 fell over").wait_for()
        assert await s.page.input_value("#log-worker") == "hard-node/1"


async def test_download_saves_the_log_the_viewer_shows(tmp_path):
    """Download saves the failed rank's stderr (what the viewer shows) under a name of the job,
    the worker, the stream and the attempt; its text is the log's."""
    async with session(tmp_path) as s:
        await failed_and_shown(s, tmp_path, "saved")
        await s.page.locator("#log-text").filter(has_text="rank 1 fell over").wait_for()
        async with s.page.expect_download(timeout=20_000) as info:
            await s.page.click("#log-download")
        download = await info.value
        assert download.suggested_filename == "saved_hard-node-local1_stderr_attempt0.log"
        path = tmp_path / "saved.log"
        await download.save_as(path)
        assert path.read_text() == "rank 1 fell over\n"


async def failed_and_shown(s: Session, tmp_path: Path, job_id: str) -> None:
    """Run ``job_id``, whose rank 1 fails (its stderr says so), to its end; show it."""
    args = [script(tmp_path, "f.py", FAILS_AFTER_RANK_0), str(tmp_path / f"{job_id}-said")]
    spec = {"id": job_id, "entrypoint": PY, "args": args, "nproc_per_node": 2}
    r = await s.api.post("/jobs", json={**spec, "max_restarts": 0, "termination_grace": 1})
    assert r.status_code == 201, r.text
    await follow_until(s.api, job_id, job_ended, 30)
    await s.sign_in("#" + job_id)
