"""/metrics by Prometheus' conventions, checked by its own tools: the parser, promtool and a
real Prometheus server scraping a daemon."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from elasticd import __version__
from elasticd.eventkinds import EventKind
from elasticd.keys import job_key
from elasticd.models import Job, JobSpec
from elasticd.node.metrics import KEEP_FINISHED_JOBS
from elasticd.states import JobState
from tests.conftest import PY, asgi_client, make_daemon, script
from tests.hardening.support import free_port, serve

FINISHED_JOBS = 1000

#: Restarts on the first attempt, then runs until cancelled (so it is live while scraped).
CRASH_THEN_RUN = """
import os, sys, time
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    sys.exit(3)
print("second attempt", flush=True)
time.sleep(600)
"""


def tool(name: str) -> str:
    """The path of a tool from Debian's ``prometheus`` package (CI installs it: .ci/run)."""
    path = shutil.which(name)
    if path is None:
        if os.environ.get("CI"):
            raise AssertionError(f"{name} is missing: apt-get install prometheus")
        pytest.skip(f"{name} is missing (Debian package prometheus)")
    return path


def start_prometheus(
    binary: str, folder: Path, port: int, target_port: int, token_file: Path
) -> subprocess.Popen[bytes]:
    """A Prometheus server on ``port`` scraping the daemon's /metrics every 500 ms."""
    config = folder / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 500ms\n  scrape_timeout: 400ms\n"
        "scrape_configs:\n  - job_name: elasticd\n"
        f"    authorization:\n      credentials_file: {token_file}\n"
        f"    static_configs:\n      - targets: ['127.0.0.1:{target_port}']\n"
    )
    with (folder / "prometheus.log").open("wb") as out:
        return subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={folder / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def promtool_check(text: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [tool("promtool"), "check", "metrics"],
        input=text,
        capture_output=True,
        text=True,
        timeout=60,
    )


def convention_problems(text: str) -> list[str]:
    """What a scrape does against Prometheus' naming conventions (pure)."""
    problems = []
    for family in text_string_to_metric_families(text):
        name = family.name
        if not name.startswith("elasticd_"):
            problems.append(f"{name}: not in the elasticd_ namespace")
        if "percent" in name or "percent" in family.documentation.lower():
            problems.append(f"{name}: a percentage (the convention is a 0-1 _ratio)")
        if ("duration" in name or "latency" in name) and not name.endswith("_seconds"):
            problems.append(f"{name}: a time not in _seconds")
        for sample in family.samples:
            if sample.name.endswith("_created"):
                problems.append(f"{sample.name}: a _created series")
            if family.type == "counter" and not sample.name.endswith("_total"):
                problems.append(f"{sample.name}: a counter without _total")
            if name.endswith("_ratio") and not 0 <= sample.value <= 1:
                problems.append(f"{sample.name}{sample.labels}: {sample.value} not in 0..1")
            if name.endswith("_info") and sample.value != 1:
                problems.append(f"{sample.name}: an info series is always 1")
    return problems


def job_ids(text: str) -> set[str]:
    """Every ``job_id`` label value on the page."""
    return {
        s.labels["job_id"]
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if "job_id" in s.labels
    }


def finished(i: int) -> Job:
    restarts = i % 3
    return Job(
        id=f"done-{i:04d}",
        spec=JobSpec(entrypoint="x", max_restarts=3),
        state=JobState.FAILED if i % 7 == 0 else JobState.SUCCEEDED,
        restart_count=restarts,
        max_restarts=3,
        created_at=1.0 + i,
        finished_at=2.0 + i,
    )


def test_the_convention_check_catches_what_it_checks():
    """The check itself fails a percent, a counter without _total, a _created series."""
    bad = (
        "# HELP elasticd_flakiness in percent\n# TYPE elasticd_flakiness gauge\n"
        "elasticd_flakiness 25\n"
        "# HELP elasticd_x_ratio r\n# TYPE elasticd_x_ratio gauge\nelasticd_x_ratio 1.5\n"
        "# HELP elasticd_runs c\n# TYPE elasticd_runs counter\n"
        "elasticd_runs_total 1\nelasticd_runs_created 5\n"
        "# HELP elasticd_wait_duration d\n# TYPE elasticd_wait_duration gauge\n"
        "elasticd_wait_duration 3\n"
    )
    problems = "\n".join(convention_problems(bad))
    for needle in ("percentage", "not in 0..1", "_created series", "not in _seconds"):
        assert needle in problems


async def test_metrics_follow_the_conventions_after_1000_finished_jobs(tmp_path):
    """After 1,000 finished jobs (documents and this node's events, not runs), /metrics
    passes the conventions and promtool, and keeps per-job series for only the newest
    KEEP_FINISHED_JOBS of them."""
    d = make_daemon(tmp_path)
    async with asyncio.timeout(120):
        await d.start()
        try:
            for i in range(FINISHED_JOBS):  # this node ran a group of each
                d.events.emit(f"done-{i:04d}", "agent", EventKind.GROUP_STATE, state="SUCCEEDED")
            docs = [finished(i) for i in range(FINISHED_JOBS)]
            for start in range(0, FINISHED_JOBS, 100):
                await d.store.put_batch(
                    [
                        (job_key(j.id), j.model_dump_json().encode())
                        for j in docs[start : start + 100]
                    ]
                )
            live = await d.jobs.submit(
                JobSpec(entrypoint=PY, args=["-c", "import time; time.sleep(600)"])
            )
            async with asgi_client(d) as c:
                while True:
                    text = (await c.get("/metrics")).text
                    counts = {
                        s.labels["state"]: s.value
                        for f in text_string_to_metric_families(text)
                        if f.name == "elasticd_jobs"
                        for s in f.samples
                    }
                    if counts["SUCCEEDED"] + counts["FAILED"] == FINISHED_JOBS:
                        break
                    await asyncio.sleep(0.05)
                await c.post(f"/jobs/{live[0].id}/cancel", json={})
        finally:
            await d.shutdown()

    assert convention_problems(text) == []
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert [(s.labels, s.value) for s in families["elasticd_build_info"].samples] == [
        ({"version": __version__}, 1)
    ]
    runs = {s.labels["outcome"]: s.value for s in families["elasticd_run"].samples}
    assert sum(runs.values()) == FINISHED_JOBS and runs["failed_with_retries"] > 0
    newest = {f"done-{i:04d}" for i in range(FINISHED_JOBS - KEEP_FINISHED_JOBS, FINISHED_JOBS)}
    assert job_ids(text) == newest | {live[0].id}
    shown = {s.labels["job_id"] for s in families["elasticd_flakiness_ratio"].samples}
    assert shown == newest  # the live job has no run yet

    check = promtool_check(text)
    assert check.returncode == 0 and not check.stdout.strip() and not check.stderr.strip(), (
        check.stdout + check.stderr
    )


@pytest.mark.slow
async def test_a_real_prometheus_scrapes_a_jobs_restarts(tmp_path):
    """A Prometheus server scrapes a daemon (with its bearer token) while a job restarts;
    PromQL over its HTTP API returns that job's restart."""
    prometheus = tool("prometheus")
    daemon = serve(tmp_path)
    prom: subprocess.Popen[bytes] | None = None
    try:
        await daemon.wait_ready()
        token_file = tmp_path / "scrape-token"
        token_file.write_text(daemon.token or "")
        token_file.chmod(0o600)
        port = free_port()
        prom = start_prometheus(prometheus, tmp_path, port, daemon.port, token_file)
        path = script(tmp_path, "crash_then_run.py", CRASH_THEN_RUN)
        async with daemon.client() as c:
            r = await c.post("/jobs", json={"entrypoint": PY, "args": [path]})
            assert r.status_code == 201, r.text
            job_id = r.json()["id"]
            query = f'elasticd_job_restarts{{job_id="{job_id}"}}'
            deadline = time.monotonic() + 90
            async with (
                asyncio.timeout(120),
                httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as api,
            ):
                while True:
                    assert prom.poll() is None, (tmp_path / "prometheus.log").read_text()
                    answer = None
                    try:
                        response = await api.get("/api/v1/query", params={"query": query})
                        if response.status_code == 200:
                            answer = response.json()
                        # else Prometheus listens but is still starting ("Service Unavailable")
                    except httpx.TransportError:
                        pass  # not listening yet
                    result = answer["data"]["result"] if answer else []
                    if result and float(result[0]["value"][1]) == 1:
                        break
                    assert time.monotonic() < deadline, (
                        f"{answer}\n{(tmp_path / 'prometheus.log').read_text()[-3000:]}"
                    )
                    await asyncio.sleep(0.2)
            assert result[0]["metric"]["job"] == "elasticd"
            await c.post(f"/jobs/{job_id}/cancel", json={})
    finally:
        if prom is not None:
            prom.terminate()
            prom.wait(30)
        daemon.stop()
