"""Live streams over a real socket: SSE events, resumable, with heartbeats; logs followed
across restarts; and neither ever holds up the daemon's shutdown."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from api import streams
from elasticd.client import SSEParser
from tests.conftest import PY, script
from tests.observability.support import CRASH_ONCE, auth, live_daemon, read_sse, url_of

SSE = {"Accept": "text/event-stream"}


async def submit(c: httpx.AsyncClient, body: dict) -> str:
    r = await c.post("/jobs", json=body)
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


async def test_sse_streams_every_event_then_ends(live, tmp_path):
    """id: is the seq, event: the kind, data: the event JSON; `end` follows the final events."""
    path = script(tmp_path, "crash.py", CRASH_ONCE)
    async with httpx.AsyncClient(base_url=url_of(live), headers=auth(live), timeout=30) as c:
        job_id = await submit(c, {"entrypoint": PY, "args": [path], "nproc_per_node": 2})
        async with asyncio.timeout(30), c.stream("GET", f"/jobs/{job_id}/events", headers=SSE) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            messages = await read_sse(r)
        listed = (await c.get(f"/jobs/{job_id}/events")).json()
    *events, end = messages
    assert end.event == "end" and json.loads(end.data)["state"] == "SUCCEEDED"
    assert [json.loads(m.data) for m in events] == listed
    assert [(m.id, m.event) for m in events] == [(str(e["seq"]), e["kind"]) for e in listed]
    assert listed[-1]["kind"] == "job.state" and listed[-1]["state"] == "SUCCEEDED"
    assert "group.restarting" in [m.event for m in events]


async def test_reconnect_with_last_event_id_misses_and_repeats_nothing(live, tmp_path):
    """A client that drops after a few events and reconnects with Last-Event-ID sees each once."""
    path = script(tmp_path, "crash.py", CRASH_ONCE)
    async with httpx.AsyncClient(base_url=url_of(live), headers=auth(live), timeout=30) as c:
        job_id = await submit(c, {"entrypoint": PY, "args": [path], "nproc_per_node": 2})
        first: list = []
        async with asyncio.timeout(30), c.stream("GET", f"/jobs/{job_id}/events", headers=SSE) as r:
            parser = SSEParser()
            async for text in r.aiter_text():
                first.extend(m for m in parser.feed(text) if m.event != "end")
                if len(first) >= 3:
                    break  # drop the connection mid-job
        last_id = first[-1].id
        headers = {**SSE, "Last-Event-ID": str(last_id)}
        async with (
            asyncio.timeout(30),
            c.stream("GET", f"/jobs/{job_id}/events", headers=headers) as r,
        ):
            rest = [m for m in await read_sse(r) if m.event != "end"]
        listed = (await c.get(f"/jobs/{job_id}/events")).json()
    seqs = [int(m.id) for m in first + rest]
    assert seqs == [e["seq"] for e in listed]


async def test_heartbeats_keep_an_idle_stream_alive(live, tmp_path, monkeypatch):
    """While nothing happens the stream sends a comment every heartbeat interval."""
    monkeypatch.setattr(streams, "HEARTBEAT_S", 0.1)
    path = script(tmp_path, "sleep.py", "import time; time.sleep(30)\n")
    async with httpx.AsyncClient(base_url=url_of(live), headers=auth(live), timeout=30) as c:
        job_id = await submit(c, {"entrypoint": PY, "args": [path], "termination_grace": 1})
        seen = ""
        async with asyncio.timeout(20), c.stream("GET", f"/jobs/{job_id}/events", headers=SSE) as r:
            async for text in r.aiter_text():
                seen += text
                if seen.count(": heartbeat\n\n") >= 3:
                    break
        await c.post(f"/jobs/{job_id}/cancel", json={})


async def test_logs_follow_across_restarts(live, tmp_path):
    """follow=true streams one rank's log, goes on to the next attempt's, and ends with the job."""
    path = script(tmp_path, "crash.py", CRASH_ONCE)
    async with httpx.AsyncClient(base_url=url_of(live), headers=auth(live), timeout=30) as c:
        job_id = await submit(c, {"entrypoint": PY, "args": [path], "nproc_per_node": 2})
        params = {"local_rank": 1, "follow": "true"}
        async with asyncio.timeout(30), c.stream("GET", f"/jobs/{job_id}/logs", params=params) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
            text = "".join([t async for t in r.aiter_text()])
        assert text == "rank 1 attempt 0\n==> attempt 1 <==\nrank 1 attempt 1\n"
        params = {"local_rank": 1, "follow": "true", "attempt": 0, "stream": "stderr"}
        async with asyncio.timeout(30), c.stream("GET", f"/jobs/{job_id}/logs", params=params) as r:
            assert "".join([t async for t in r.aiter_text()]) == "crashing\n"
        for params in ({"local_rank": 5, "follow": "true"}, {"attempt": 7, "follow": "true"}):
            assert (await c.get(f"/jobs/{job_id}/logs", params=params)).status_code == 404
        assert (await c.get("/jobs/nope/logs", params={"follow": "true"})).status_code == 404
        assert (await c.get("/jobs/nope/events", headers=SSE)).status_code == 404


async def test_open_streams_do_not_hold_up_shutdown(tmp_path):
    """With an SSE stream and a log follow open on a running job, a stop completes promptly:
    the daemon ends them, where uvicorn would hold the stop for its whole graceful wait (a
    minute here, so that a loaded machine cannot blur the two)."""
    d = live_daemon(tmp_path, shutdown_timeout=60)
    path = script(tmp_path, "sleep.py", "print('up', flush=True)\nimport time; time.sleep(60)\n")
    await d.start()
    serving = asyncio.create_task(d.serve())
    try:
        async with asyncio.timeout(60):
            async with httpx.AsyncClient(base_url=url_of(d), headers=auth(d), timeout=60) as c:
                job_id = await submit(c, {"entrypoint": PY, "args": [path], "termination_grace": 1})
                events = c.stream("GET", f"/jobs/{job_id}/events", headers=SSE)
                logs = c.stream("GET", f"/jobs/{job_id}/logs", params={"follow": "true"})
                async with events as ev, logs as lg:
                    ev_iter, lg_iter = ev.aiter_text(), lg.aiter_text()
                    seen = ""
                    while "workers.started" not in seen:
                        seen += await anext(ev_iter)
                    logged = ""  # as many chunks as the follow takes to read the line
                    while "\n" not in logged:
                        logged += await anext(lg_iter)
                    assert logged == "up\n"
                    started = time.monotonic()
                    d.request_stop()
                    await serving
                    elapsed = time.monotonic() - started
                    rest = [t async for t in ev_iter]
                    log_rest = [t async for t in lg_iter]
    finally:  # a failure above still stops the daemon and its worker
        d.request_stop()
        async with asyncio.timeout(60):
            await asyncio.gather(serving, return_exceptions=True)
    assert elapsed < 20, elapsed
    assert "daemon.stopped" in "".join(rest) and log_rest == []


async def test_streams_end_when_the_daemon_closes_them(tmp_path):
    """A stream of a job that stays active (run elsewhere) still ends when the daemon stops,
    well before uvicorn's graceful wait would have (a minute here, as above)."""
    d = live_daemon(tmp_path, labels="zone=a", shutdown_timeout=60)
    async with asyncio.timeout(60):
        await d.start()
        serving = asyncio.create_task(d.serve())
        async with httpx.AsyncClient(base_url=url_of(d), headers=auth(d), timeout=30) as c:
            # Nothing here matches the selector: the job stays PENDING through the stop.
            job_id = await submit(
                c, {"entrypoint": PY, "args": ["-c", "pass"], "node_selector": {"zone": "b"}}
            )
            async with c.stream("GET", f"/jobs/{job_id}/events", headers=SSE) as ev:
                it = ev.aiter_text()
                seen = ""  # however many chunks the stream's start and first event take
                while "job.submitted" not in seen:
                    seen += await anext(it)
                started = time.monotonic()
                d.request_stop()
                await serving
                elapsed = time.monotonic() - started
                assert [t async for t in it] == []
    assert elapsed < 20, elapsed


@pytest.mark.parametrize("header", ["12x", ""])
def test_resume_point_ignores_a_bad_last_event_id(header):
    """A Last-Event-ID that is not a seq is ignored; a good one wins over a smaller after."""
    assert streams.resume_point(4, header) == 4
    assert streams.resume_point(4, "9") == 9
    assert streams.resume_point(12, "9") == 12


async def test_a_followed_log_is_woken_by_its_growth_not_by_a_timer(live, tmp_path, monkeypatch):
    """The worker prints a line each time the test asks (no job event in between): each line
    reaches the follower, though the follower's event wait is far longer than the test."""
    from elasticd.node import logfollow

    monkeypatch.setattr(logfollow, "EVENT_WAIT_S", 3600.0)
    go = tmp_path / "go"
    path = script(
        tmp_path,
        "echo.py",
        f"""
        import os, time
        for n in range(3):
            while not os.path.exists({str(go)!r} + str(n)):
                time.sleep(0.01)
            print("line", n, flush=True)
        """,
    )
    async with httpx.AsyncClient(base_url=url_of(live), headers=auth(live), timeout=30) as c:
        job_id = await submit(c, {"entrypoint": PY, "args": [path]})
        params = {"follow": "true"}
        async with asyncio.timeout(30), c.stream("GET", f"/jobs/{job_id}/logs", params=params) as r:
            chunks = r.aiter_text()
            seen = ""
            for n in range(3):
                (tmp_path / f"go{n}").touch()
                while f"line {n}\n" not in seen:
                    seen += await anext(chunks)
        assert seen == "line 0\nline 1\nline 2\n"


def test_log_growth_wakes_the_armed_waiters_of_that_file_only(tmp_path):
    from elasticd.node.logfollow import LogGrowth

    async def main() -> None:
        growth = LogGrowth()
        a, b = tmp_path / "a", tmp_path / "b"
        wa, wb = growth.arm(a), growth.arm(b)
        growth.grew(a)
        await asyncio.sleep(0)
        assert wa.done() and not wb.done()
        wb.cancel()
        await asyncio.sleep(0)
        assert growth._waiting == {}  # nothing kept for futures that are done

    asyncio.run(main())
