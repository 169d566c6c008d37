"""Issue 22 #12: a job's error text cannot drive the operator's terminal.

A real job writes an error.json whose message and traceback hold escape
sequences (retitle the window, BEL, clear the screen); ``elasticd status``
and ``elasticd events`` against the real daemon print them escaped, with no
ESC or BEL byte reaching the terminal. The dashboard shows job text as
text (``textContent``), never as markup.
"""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import pytest

from tests.hardening.support import PY, script, serve

pytestmark = pytest.mark.timeout(90)

EVIL = "\x1b]0;pwned\x07\x1b[2J"

WRITER = """
import json, os, sys
evil = "\\x1b]0;pwned\\x07\\x1b[2J"
payload = {"message": {"message": "RuntimeError: " + evil + " gotcha\\x9b31m",
                       "extraInfo": {"py_callstack": "Traceback (most recent call last):\\n"
                                     "  File \\"x.py\\", line 1\\n\\tRuntimeError: " + evil,
                                     "timestamp": "1"}}}
with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
    json.dump(payload, f)
sys.exit(1)
"""


def cli(daemon, *words: str) -> bytes:
    token = daemon.state_dir.parent / "cli-token"
    token.write_text(daemon.token or "")
    token.chmod(0o600)
    done = subprocess.run(
        [PY, "-m", "elasticd", *words, "--url", daemon.url, "--token-file", str(token)],
        capture_output=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout + done.stderr


async def test_status_and_events_print_a_jobs_escape_sequences_escaped(tmp_path: Path) -> None:
    """ESC and BEL from a job's error.json never reach stdout of status or events."""
    daemon = serve(tmp_path)
    try:
        await daemon.wait_ready()
        body = {
            "id": "evil",
            "entrypoint": PY,
            "args": [script(tmp_path, "writer.py", WRITER)],
            "max_restarts": 0,
        }
        async with daemon.client() as c:
            r = await c.post("/jobs", json=body)
            assert r.status_code == 201, r.text
            async with asyncio.timeout(60):
                while (job := (await c.get("/jobs/evil")).json())["state"] != "FAILED":
                    await asyncio.sleep(0.05)
        assert EVIL in job["error"]["message"]  # the API serves the job's text as it is
        for words in (("status", "evil"), ("events", "evil")):
            out = cli(daemon, *words)
            assert b"\x1b" not in out and b"\x07" not in out, out
            assert "\u009b".encode() not in out, out
        status = cli(daemon, "status", "evil").decode()
        assert "\\x1b]0;pwned\\x07\\x1b[2J" in status  # shown, escaped
        assert "Traceback (most recent call last):\n" in status  # a traceback keeps its lines
    finally:
        daemon.stop()


def test_the_dashboard_never_renders_job_text_as_markup() -> None:
    """The page builds every node from text (textContent, append): no HTML sink at all."""
    page = (Path(__file__).parents[2] / "api" / "static" / "dashboard.html").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "srcdoc"):
        assert sink not in page, sink
    assert "textContent" in page
