"""An early crash under ``prewarm`` (issue 40): a standby still importing at the crash is never
waited for; the replacement starts cold at once, no later than without ``prewarm``."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import events_of, wait_job
from tests.e2e.test_prewarm import submit_body
from tests.hardening.support import serve

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="a root daemon, as deployed"),
]

#: The first attempt says when it started and when it fails, 1 s in; the second when it started.
EARLY = r"""
import json, os, sys, time
started = time.time()
count = os.environ["TORCHELASTIC_RESTART_COUNT"]
if count == "0":
    time.sleep(1.0)
path = os.path.join(os.environ["OUT"], f"{sys.argv[1]}_{count}.json")
with open(path, "w") as f:
    json.dump({"started": started, "ended": time.time()}, f)
sys.exit(3 if count == "0" else 0)
"""

#: A ``prewarm`` module far slower to import than the first attempt lives.
SLOW = "import time\ntime.sleep(60)\n"


async def _restart_gap(c: httpx.AsyncClient, code: Path, out: Path, name: str, **spec: object):
    """Seconds from the first attempt's end to the second's first statement; the events."""
    body = submit_body(
        name, out, entrypoint=sys.executable, args=[str(code / "w.py"), name], cwd=str(code),
        nproc_per_node=1, **spec,
    )  # fmt: skip
    assert (await c.post("/jobs", json=body)).status_code == 201
    job = await wait_job(c, name, timeout=60)
    assert job["state"] == "SUCCEEDED", job
    first = json.loads((out / f"{name}_0.json").read_text())
    second = json.loads((out / f"{name}_1.json").read_text())
    return second["started"] - first["ended"], await events_of(c, name)


async def test_a_crash_before_the_standby_is_ready_restarts_cold_at_once(tmp_path: Path) -> None:
    """Two CPUs and one worker: the standby starts with it, and is still importing (60 s) when
    the worker fails 1 s in. The rank starts cold at once, saying so, and the restart is
    not slower than the same job's without ``prewarm`` (loosely: the same machine, one
    after the other, a second of slack), far from the standby's import."""
    code, out = tmp_path / "code", tmp_path / "out"
    code.mkdir()
    out.mkdir()
    (code / "w.py").write_text(EARLY)
    (code / "slow_import_x.py").write_text(SLOW)
    daemon = serve(tmp_path, cpus=2)
    try:
        async with asyncio.timeout(150), daemon.client() as c:
            await daemon.wait_ready()
            cold_gap, _ = await _restart_gap(c, code, out, "plain", prewarm=[])
            gap, events = await _restart_gap(c, code, out, "early", prewarm=["slow_import_x"])
    finally:
        daemon.kill9()
    cold = [e for e in events if e["kind"] == "worker.cold_start"]
    assert len(cold) == 1 and "still importing" in cold[0]["message"], events
    assert "at once" in cold[0]["message"]
    assert not [e for e in events if e["kind"] == "standby.lost"], events
    assert gap < 10, gap
    assert gap <= cold_gap + 1.0, (gap, cold_gap)
