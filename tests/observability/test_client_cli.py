"""The Python clients and the `elasticd` client commands against a daemon.

The sync client and the CLI block, so against the live daemon (which runs in
the test's event loop) they run in a worker thread.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import socket
from pathlib import Path

import httpx
import pytest

from api.app import create_app
from elasticd import cli
from elasticd.client import (
    AsyncClient,
    Client,
    ClientError,
    DaemonUnreachable,
    SSEParser,
)
from elasticd.models import Job, JobSpec
from elasticd.states import JobState
from tests.conftest import PY, script
from tests.observability.support import CRASH_ONCE, live_daemon, url_of


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """`elasticd ARGV` in a thread: (exit code, stdout, stderr)."""
    capsys.readouterr()
    async with asyncio.timeout(60):
        rc = await asyncio.to_thread(cli.main, list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_sse_parser_handles_split_chunks_comments_and_multiline_data():
    """Messages split across chunks, comments, CRLF and multi-line data parse as the spec says."""
    p = SSEParser()
    assert p.feed('retry: 1500\n\n: heartbeat\n\nid: 7\nevent: job.state\ndata: {"a"') == []
    (m,) = p.feed(":1}\r\n\r\n")
    assert (m.id, m.event, m.data) == ("7", "job.state", '{"a":1}') and p.retry == 1500
    (m,) = p.feed("data: one\ndata: two\n\n")
    assert (m.event, m.data, m.id) == ("message", "one\ntwo", "7")


async def test_async_client_over_asgi(daemon, tmp_path):
    """AsyncClient returns the API's models and raises ClientError with status and detail."""
    transport = httpx.ASGITransport(app=create_app(daemon))
    path = script(tmp_path, "crash.py", CRASH_ONCE)
    async with (
        asyncio.timeout(60),
        AsyncClient("http://localhost", token=daemon.token, transport=transport) as c,
    ):
        job = await c.submit(JobSpec(id="a1", entrypoint=PY, args=[path], nproc_per_node=2))
        assert isinstance(job, Job) and job.state is JobState.PENDING
        done = await c.wait("a1", timeout=30)
        assert done.state is JobState.SUCCEEDED and done.restart_count == 1
        assert [j.id for j in (await c.list_jobs(state=["SUCCEEDED"])).jobs] == ["a1"]
        view = await c.workers("a1")
        assert view.remaining_restarts == 2 and view.groups[0].state.value == "SUCCEEDED"
        events = await c.events("a1")
        assert "group.restarting" in [e.kind for e in events]
        assert [e.seq for e in await c.events("a1", after=events[2].seq)] == [
            e.seq for e in events[3:]
        ]
        assert await c.logs("a1", 1) == "rank 1 attempt 1\n"
        assert await c.logs("a1", 1, "stderr", attempt=0) == "crashing\n"
        with pytest.raises(ClientError) as missing:
            await c.get("nope")
        assert missing.value.status == 404 and "nope" in str(missing.value)
        assert missing.value.problem["title"] == "Job not found"
        with pytest.raises(ClientError) as ended:
            await c.cancel("a1")
        assert ended.value.status == 409 and "already ended" in ended.value.detail
        with pytest.raises(ClientError) as bad:
            await c.submit({"entrypoint": PY, "nproc_per_node": 0})
        assert bad.value.status == 422 and "nproc_per_node" in str(bad.value)


async def test_sync_client_follows_events_and_logs(live, tmp_path):
    """Client.follow_events yields each event once and stops at the end; follow_logs too."""
    path = script(tmp_path, "crash.py", CRASH_ONCE)

    def scenario() -> None:
        with Client(url_of(live), token=live.token) as c:
            job = c.submit({"entrypoint": PY, "args": [path], "nproc_per_node": 2})
            followed = list(c.follow_events(job.id))
            assert [e.seq for e in followed] == [e.seq for e in c.events(job.id)]
            assert followed[-1].kind == "job.state" and followed[-1].state == "SUCCEEDED"
            assert c.wait(job.id, timeout=5).state is JobState.SUCCEEDED
            # The job has ended: following starts at (and stops after) the latest attempt.
            assert "".join(c.follow_logs(job.id, 1)) == "rank 1 attempt 1\n"
            with pytest.raises(ClientError) as missing:
                list(c.follow_events("nope"))
            assert missing.value.status == 404

    async with asyncio.timeout(60):
        await asyncio.to_thread(scenario)


def test_unreachable_daemon_is_a_clear_error():
    """No daemon at the URL: DaemonUnreachable naming the URL, not a traceback from httpx."""
    url = f"http://127.0.0.1:{closed_port()}"
    with Client(url, timeout=2) as c, pytest.raises(DaemonUnreachable) as exc:
        c.list_jobs()
    assert url in str(exc.value) and "is it running" in str(exc.value)


async def test_cli_session(live, tmp_path, capsys, monkeypatch):
    """submit --wait, jobs, status, workers, events, logs, cancel: tables, --json, exit codes."""
    monkeypatch.setenv("ELASTICD_URL", url_of(live))
    path = script(tmp_path, "crash.py", CRASH_ONCE)

    rc, out, err = await run_cli(
        capsys, "submit", "--id", "c1", "--nproc-per-node", "2", "--wait", "--", PY, path
    )
    assert rc == 0, err
    assert "group.restarting" in err and "job c1 SUCCEEDED after 1 restart(s)" in err

    rc, out, _ = await run_cli(capsys, "jobs")
    header, row = out.splitlines()[:2]
    assert header.split() == ["ID", "STATE", "RESTARTS", "NODESxPROCS", "AGE", "COMMAND"]
    assert row.split()[:4] == ["c1", "SUCCEEDED", "1/3", "1x2"]
    rc, out, _ = await run_cli(capsys, "jobs", "--json", "--state", "SUCCEEDED")
    assert [j["id"] for j in json.loads(out)["jobs"]] == ["c1"]

    rc, out, _ = await run_cli(capsys, "status", "c1")
    assert rc == 0 and "SUCCEEDED" in out and "1 of 3" in out and "exited with code 3" in out
    rc, out, _ = await run_cli(capsys, "workers", "c1")
    assert "RANK  LOCAL  PID" in out and "(2 left)" in out
    assert [line.split()[3] for line in out.splitlines()[-2:]] == ["SUCCEEDED"] * 2

    rc, out, _ = await run_cli(capsys, "events", "c1")
    assert rc == 0 and "group.restarting" in out and out.splitlines()[-1].split()[3] == "job.state"
    rc, out, _ = await run_cli(capsys, "events", "-f", "--json", "c1")
    kinds = [json.loads(line)["kind"] for line in out.splitlines()]
    assert kinds[0] == "job.submitted" and kinds[-1] == "job.state"

    rc, out, _ = await run_cli(capsys, "logs", "c1", "--local-rank", "1")
    assert out == "rank 1 attempt 1\n"
    rc, out, _ = await run_cli(capsys, "logs", "-f", "c1", "--local-rank", "1", "--attempt", "0")
    assert (rc, out) == (0, "rank 1 attempt 0\n")

    rc, out, err = await run_cli(capsys, "status", "nope")
    assert (rc, out, err) == (1, "", "elasticd: no job with id 'nope' (404)\n")
    rc, _, err = await run_cli(capsys, "cancel", "c1")
    assert rc == 1 and "already ended as SUCCEEDED" in err and err.endswith("(409)\n")


async def test_cli_submit_spec_file_stdin_failure_and_cancel(live, tmp_path, capsys, monkeypatch):
    """A spec from a file or stdin; --wait exits 1 for a failed job; cancel stops a running one."""
    url = url_of(live)
    spec = tmp_path / "job.json"
    spec.write_text(
        json.dumps(
            {"id": "f1", "entrypoint": PY, "args": ["-c", "raise SystemExit(4)"], "max_restarts": 0}
        )
    )
    rc, out, err = await run_cli(capsys, "submit", "--url", url, "--wait", str(spec))
    assert rc == 1 and "job f1 FAILED" in err
    # The same id and spec again: the existing (ended) job, and the CLI says it did not run.
    rc, out, err = await run_cli(capsys, "submit", "--url", url, str(spec))
    assert rc == 0 and "already exists and ended FAILED: it was not run again" in err
    assert "submitted" not in out

    monkeypatch.setattr(
        "sys.stdin",
        io.StringIO(
            json.dumps(
                {
                    "entrypoint": PY,
                    "args": ["-c", "import time; time.sleep(60)"],
                    "termination_grace": 1,
                }
            )
        ),
    )
    rc, out, _ = await run_cli(capsys, "submit", "--url", url, "--json", "--id", "s1", "-")
    assert rc == 0 and json.loads(out)["id"] == "s1"
    rc, out, _ = await run_cli(capsys, "cancel", "--url", url, "s1")
    assert rc == 0 and out == "job s1: cancel requested (CANCELLED)\n"

    rc, _, err = await run_cli(capsys, "submit", "--url", url, "--", PY, "-c", "pass", "--x")
    assert rc == 0
    rc, _, err = await run_cli(capsys, "submit", "--url", url, "--nproc-per-node", "0", "--", PY)
    assert rc == 1 and "nproc_per_node" in err and err.endswith("(422)\n")
    rc, _, err = await run_cli(capsys, "submit", "--url", url)
    assert rc == 2 and "needs a spec file" in err


async def test_cli_token_and_unreachable(tmp_path, capsys, monkeypatch):
    """--token-file (or $ELASTICD_TOKEN_FILE) authenticates; a missing token or daemon is exit 1."""
    d = live_daemon(tmp_path, token="s3cret")
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    os.chmod(token_file, 0o600)
    async with asyncio.timeout(30):
        await d.start()
        try:
            url = url_of(d)
            rc, out, err = await run_cli(capsys, "jobs", "--url", url)
            assert rc == 1 and "Bearer" in err and err.endswith("(401)\n")
            rc, out, _ = await run_cli(
                capsys, "jobs", "--url", url, "--token-file", str(token_file)
            )
            assert (rc, out) == (0, "no jobs\n")
            monkeypatch.setenv("ELASTICD_TOKEN_FILE", str(token_file))
            rc, out, _ = await run_cli(capsys, "jobs", "--url", url)
            assert rc == 0
        finally:
            await d.shutdown()
    rc, _, err = await run_cli(capsys, "jobs", "--url", f"http://127.0.0.1:{closed_port()}")
    assert rc == 1 and "cannot reach the elasticd daemon" in err
    rc, _, err = await run_cli(capsys, "jobs", "--token-file", str(Path(tmp_path, "missing")))
    assert rc == 1 and "cannot read the token file" in err


async def test_cli_queue_and_priority(live, tmp_path, capsys, monkeypatch):
    """`elasticd submit --priority` and `elasticd queue`: the order the fleet will place jobs in."""
    monkeypatch.setenv("ELASTICD_URL", url_of(live))
    sleep = ["--", PY, "-c", "import time; time.sleep(60)"]
    rc, out, _ = await run_cli(capsys, "queue")
    assert (rc, out) == (0, "no job waits (0 placed)\n")
    # The node has 8 slots: the blocker takes them all, at a priority nobody below preempts.
    for job_id, prio in (("blocker", "9"), ("low", "0"), ("high", "3")):
        argv = ["submit", "--id", job_id, "--nproc-per-node", "8", "--priority", prio]
        rc, _, err = await run_cli(capsys, *argv, "--termination-grace", "1", *sleep)
        assert rc == 0, err
    async with asyncio.timeout(20):
        while True:
            rc, out, _ = await run_cli(capsys, "queue", "--json")
            if len(json.loads(out)["queue"]) == 2:
                break
            await asyncio.sleep(0.05)
    rc, out, _ = await run_cli(capsys, "queue")
    header, first, second = out.splitlines()
    assert header.split() == ["POS", "ID", "PRIO", "REASON", "WAITING", "WHY"]
    assert first.split()[:4] == ["1", "high", "3", "capacity"]
    assert second.split()[:4] == ["2", "low", "0", "capacity"]
    assert "needs 1 node with 8 free slots; 0 matching nodes have them now" in first
    for job_id in ("blocker", "low", "high"):
        rc, _, _ = await run_cli(capsys, "cancel", job_id)
        assert rc == 0


async def test_cli_submit_flags_set_the_spec_fields_users_set_often(
    live, tmp_path, capsys, monkeypatch
):
    """`elasticd submit`'s flags for prewarm, the hang timeouts, health checks, nodes, env,
    priority and selector reach the job's spec as given; unset flags leave its defaults."""
    monkeypatch.setenv("ELASTICD_URL", url_of(live))
    argv = [
        "submit",
        "--id",
        "flags1",
        "--json",
        "--prewarm",
        "json,email",
        "--prewarm",
        "csv",
        "--progress-timeout",
        "auto",
        "--startup-timeout",
        "120",
        "--checkpoint-timeout",
        "600",
        "--max-no-progress-restarts",
        "2",
        "--health-check",
        "true --quiet 'a b'",
        "--health-check-timeout",
        "5",
        "--no-gpu-health-check",
        "--nnodes",
        "1:2",
        "--join-timeout",
        "30",
        "--env",
        "A=1",
        "--priority",
        "4",
        "--node-selector",
        "zone=a",
        "--termination-grace",
        "1",
        "--",
        PY,
        "-c",
        "pass",
    ]
    rc, out, err = await run_cli(capsys, *argv)
    assert rc == 0, err
    spec = json.loads(out)["spec"]
    assert spec["prewarm"] == ["json", "email", "csv"]
    assert spec["progress_timeout"] == "auto" and spec["startup_timeout"] == 120.0
    assert spec["checkpoint_timeout"] == 600.0 and spec["max_no_progress_restarts"] == 2
    assert spec["health_check"] == ["true", "--quiet", "a b"]
    assert spec["health_check_timeout"] == 5.0 and spec["gpu_health_check"] is False
    assert (spec["min_nodes"], spec["max_nodes"], spec["join_timeout"]) == (1, 2, 30.0)
    assert (spec["env"], spec["priority"], spec["node_selector"]) == ({"A": "1"}, 4, {"zone": "a"})
    assert spec["inprocess_restart"] is False and spec["max_restarts"] == 3  # defaults
    rc, _, err = await run_cli(capsys, "cancel", "flags1")
    assert rc == 0, err

    with pytest.raises(SystemExit) as usage:
        await run_cli(capsys, "submit", "--progress-timeout", "soon", "--", PY)
    assert usage.value.code == 2 and "expected seconds or 'auto'" in capsys.readouterr().err
    rc, _, err = await run_cli(capsys, "submit", "--startup-timeout", "0", "--", PY)
    assert rc == 1 and "startup_timeout" in err and err.endswith("(422)\n")


CRASH_ONCE_THEN_RUN = """
import os, sys, time
from elasticd.worker import ping
if os.environ["LOCAL_RANK"] == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    sys.exit(3)
for step in range(1, 4):
    ping(step=step)
    time.sleep(0.05)
time.sleep(60)
"""


async def test_cli_status_says_what_applies_now_and_never_none(live, tmp_path, capsys, monkeypatch):
    """`elasticd status` of a job RUNNING again after a crash shows no stale "restarting the
    group"; status and goodput never print None (no rank of a failed health check, no
    checkpoint); the last recovery's phases are shown."""
    monkeypatch.setenv("ELASTICD_URL", url_of(live))
    path = script(tmp_path, "again.py", CRASH_ONCE_THEN_RUN)
    argv = ["submit", "--id", "again", "--nproc-per-node", "2", "--termination-grace", "1"]
    rc, _, err = await run_cli(capsys, *argv, "--", PY, path)
    assert rc == 0, err
    async with asyncio.timeout(30):
        while True:
            rc, out, _ = await run_cli(capsys, "status", "--json", "again")
            job = json.loads(out)
            if job["state"] == "RUNNING" and job["restart_count"] == 1 and job["last_recovery"]:
                break
            await asyncio.sleep(0.1)
    assert job["reason"] is None  # the failure's "restarting the group" ended with the restart
    rc, out, _ = await run_cli(capsys, "status", "again")
    assert rc == 0 and "restarting the group" not in out and "None" not in out
    assert "running again after 1 restart(s)" in out
    assert "rank 1 (node node-a, local rank 1, attempt 0): worker exited with code 3" in out
    assert "last recovery" in out and "rendezvous " in out
    async with asyncio.timeout(30):  # the restarted workers' three steps, seen, then the cancel
        while "steps: max 3," not in (await run_cli(capsys, "goodput", "again"))[1]:
            await asyncio.sleep(0.1)
    rc, _, _ = await run_cli(capsys, "cancel", "again")
    with Client(url_of(live), token=live.token) as c:
        await asyncio.to_thread(c.wait, "again", timeout=30)
    rc, out, _ = await run_cli(capsys, "goodput", "again")
    assert rc == 0 and "steps: max 3, no checkpoint, lost " in out and "None" not in out

    argv = ["submit", "--id", "sick", "--max-restarts", "0", "--health-check", "false", "--wait"]
    rc, _, err = await run_cli(capsys, *argv, "--", PY, "-c", "pass")
    assert rc == 1 and "None" not in err
    rc, out, _ = await run_cli(capsys, "status", "sick")
    assert "root cause  node node-a" in out and "health check failed" in out
    assert "None" not in out


@pytest.mark.parametrize("quiet", [(), ("-q",), ("-qq",)])
async def test_cli_submit_wait_streams_the_workers_output_unless_quiet(
    live, tmp_path, capsys, monkeypatch, quiet
):
    """`submit --wait` prints the workers' output as it comes (stdout to stdout, stderr to
    stderr, each worker's lines prefixed), across the restart, beside the events; -q keeps
    only the events, -qq only how the job ended."""
    monkeypatch.setenv("ELASTICD_URL", url_of(live))
    path = script(tmp_path, "crash.py", CRASH_ONCE)
    argv = ["submit", "--nproc-per-node", "2", "--wait", *quiet, "--", PY, path]
    rc, out, err = await run_cli(capsys, *argv)
    assert rc == 0, err
    assert "SUCCEEDED after 1 restart(s)" in err
    if not quiet:
        assert sorted(out.splitlines()) == [
            "[default0]:==> attempt 1 <==",
            "[default0]:rank 0 attempt 0",
            "[default0]:rank 0 attempt 1",
            "[default1]:==> attempt 1 <==",
            "[default1]:rank 1 attempt 0",
            "[default1]:rank 1 attempt 1",
        ]
        assert "[default1]:crashing\n" in err and "group.restarting" in err
    else:
        assert out == "" and "crashing" not in err
        assert ("group.restarting" in err) is (quiet == ("-q",))
        if quiet == ("-qq",):
            assert err.count("\n") == 1
