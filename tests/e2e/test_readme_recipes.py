"""The README's 3-node recipe, run as written (as whoever runs the tests: root in CI).

The block is read from README.md, so the test fails when the text stops working:
three daemons started in one loop (any order), a gloo job on 2-3 of them that must
end SUCCEEDED. The recipe's own ports (7070-7072) and folders (/tmp/ed-n*) are used.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]


def recipe(heading: str) -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index(heading) :]
    match = re.search(r"```sh\n(.*?)```", section, re.S)
    assert match, f"no sh block after {heading!r}"
    return match.group(1)


def get(url: str, token: str) -> dict:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        return json.load(answer)


@pytest.mark.skipif(shutil.which("curl") is None, reason="the recipe uses curl")
def test_the_three_node_recipe_runs_a_job_to_success(tmp_path):
    pytest.importorskip("torch")
    for i in range(3):
        shutil.rmtree(f"/tmp/ed-n{i}", ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTICD_", "PET_"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    log = tmp_path / "recipe.log"
    with log.open("wb") as out:  # the daemons keep it open: a file, not a pipe
        shell = subprocess.Popen(
            ["bash", "-c", recipe("## A 3-node cluster on one machine")],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        returncode = shell.wait(timeout=120)
        text = log.read_text(errors="replace")
        assert returncode == 0, text
        token = Path("/tmp/elasticd.token").read_text().strip()
        deadline = time.monotonic() + 150
        while (job := get("http://127.0.0.1:7070/jobs/elastic-1", token))["state"] not in (
            "SUCCEEDED",
            "FAILED",
        ):
            assert time.monotonic() < deadline, job
            time.sleep(0.5)
        assert job["state"] == "SUCCEEDED", (job, text[-4000:])
        assert len(get("http://127.0.0.1:7071/nodes", token)) == 3
        # The next recipe, on the same cluster: priority, the queue, `elasticd queue`, --priority.
        fleet = subprocess.run(
            ["bash", "-c", recipe("### Sharing the fleet")],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert fleet.returncode == 0, fleet.stdout + fleet.stderr
        assert '"queue":' in fleet.stdout and "submitted" in fleet.stdout, fleet.stdout
        submitted = re.search(r"job (\S+) submitted", fleet.stdout)
        assert submitted, fleet.stdout
        for job_id in ("urgent", submitted.group(1)):
            deadline = time.monotonic() + 60
            while (job := get(f"http://127.0.0.1:7070/jobs/{job_id}", token))["state"] not in (
                "SUCCEEDED",
                "FAILED",
            ):
                assert time.monotonic() < deadline, job
                time.sleep(0.2)
            assert job["state"] == "SUCCEEDED", job
    finally:
        os.killpg(shell.pid, signal.SIGTERM)
        deadline = time.monotonic() + 60
        while subprocess.run(["pgrep", "-g", str(shell.pid)], capture_output=True).returncode == 0:
            if time.monotonic() > deadline:
                os.killpg(shell.pid, signal.SIGKILL)
                break
            time.sleep(0.2)
