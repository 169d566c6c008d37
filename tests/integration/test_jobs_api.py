"""The job API end to end over ASGI, with real worker subprocesses (tiny Python scripts)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

from api.app import create_app
from elasticd.models import Job, incarnation_tag
from elasticd.node.retention import EndSeen
from tests.conftest import PY, events_of, make_daemon, script, wait_group, wait_job
from tests.e2e.fault_support import report

CRASH_ONCE = """
import os, sys
print("rank", os.environ["RANK"], "attempt", os.environ["TORCHELASTIC_RESTART_COUNT"], flush=True)
if os.environ["LOCAL_RANK"] == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    print("crashing", file=sys.stderr, flush=True)
    sys.exit(3)
"""


async def test_submit_returns_201_location_and_job(client, tmp_path):
    """POST /jobs answers 201 with Location and the job; the job then succeeds."""
    r = await client.post("/jobs", json={"entrypoint": PY, "args": ["-c", "pass"]})
    assert r.status_code == 201
    job = r.json()
    assert r.headers["location"] == f"/jobs/{job['id']}"
    assert job["state"] == "PENDING" and job["max_restarts"] == 3
    done = await wait_job(client, job["id"])
    assert done["state"] == "SUCCEEDED"
    assert done["started_at"] and done["finished_at"] >= done["started_at"]


async def test_idempotent_submission(client):
    """Same id + same spec → 200 and the same job; different spec → 409."""
    spec = {"id": "same", "entrypoint": PY, "args": ["-c", "pass"]}
    first = await client.post("/jobs", json=spec)
    again = await client.post("/jobs", json=spec)
    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json()["created_at"] == first.json()["created_at"]
    other = await client.post("/jobs", json={**spec, "args": ["-c", "print(1)"]})
    assert other.status_code == 409
    assert other.headers["content-type"].startswith("application/problem+json")
    assert "different spec" in other.json()["detail"]


async def test_crash_once_restarts_the_group_and_succeeds(client, daemon, tmp_path):
    """Rank 1 failing on attempt 0 restarts the whole group once; the job then succeeds."""
    path = script(tmp_path, "crash.py", CRASH_ONCE)
    r = await client.post("/jobs", json={"entrypoint": PY, "args": [path], "nproc_per_node": 2})
    job = await wait_job(client, r.json()["id"])
    assert job["state"] == "SUCCEEDED"
    assert job["restart_count"] == 1
    rec = job["last_recovery"]  # where the recovery's time went
    assert rec["cause"] == "worker failure" and rec["round"] == 1
    phases = rec["stop_s"] + rec["rendezvous_s"] + rec["spawn_s"]
    assert 0 < rec["total_s"] < 10 and abs(phases - rec["total_s"]) < 1e-3
    report("worker crash", "exit detected -> group respawned", rec["total_s"])
    assert job["recovery_totals"] == {"count": 1, "total_s": rec["total_s"]}
    kinds = [e["kind"] for e in await events_of(client, job["id"])]
    for phase in ("detected", "stop_workers", "rendezvous", "spawn", "total"):
        assert f"recovery.{phase}" in kinds
    assert kinds.count("workers.started") == 2
    assert "group.restarting" in kinds
    exits = [
        e
        for e in await events_of(client, job["id"])
        if e["kind"] == "worker.exited" and e["exit_code"]
    ]
    assert exits[0]["exit_code"] == 3 and exits[0]["rank"] == 1 and exits[0]["attempt"] == 0
    view = (await client.get(f"/jobs/{job['id']}/workers")).json()
    assert view["restart_count"] == 1 and view["remaining_restarts"] == 2
    (group,) = view["groups"]
    assert group["state"] == "SUCCEEDED" and group["attempt"] == 1
    assert group["master_addr"] == "127.0.0.1" and group["master_port"] > 0
    assert [w["rank"] for w in group["workers"]] == [0, 1]
    assert all(w["exit_code"] == 0 and w["pid"] for w in group["workers"])


async def test_budget_spent_fails_with_root_cause(client, tmp_path):
    """When restarts run out the job is FAILED and names the failing rank and exit code."""
    path = script(
        tmp_path,
        "fail.py",
        """
        import os, sys, time
        if os.environ["LOCAL_RANK"] == "1":
            sys.exit(7)
        time.sleep(60)
    """,
    )
    r = await client.post(
        "/jobs", json={"entrypoint": PY, "args": [path], "nproc_per_node": 2, "max_restarts": 1}
    )
    job = await wait_job(client, r.json()["id"])
    assert job["state"] == "FAILED"
    assert job["restart_count"] == 1
    assert job["error"]["rank"] == 1 and job["error"]["exit_code"] == 7
    assert "exited with code 7" in job["error"]["message"]
    assert "restart budget spent" in job["reason"]


async def test_signal_death_is_reported(client, tmp_path):
    """A worker killed by a signal is reported with the signal, not an exit code."""
    path = script(tmp_path, "seg.py", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)\n")
    r = await client.post("/jobs", json={"entrypoint": PY, "args": [path], "max_restarts": 0})
    job = await wait_job(client, r.json()["id"])
    assert job["state"] == "FAILED"
    assert job["error"]["signal"] == signal.SIGKILL and job["error"]["signal_name"] == "SIGKILL"


async def test_cancel_stops_workers(client, tmp_path):
    """Cancel kills the workers' process groups and ends the job CANCELLED; a second cancel is 409."""
    path = script(tmp_path, "sleep.py", "import time; time.sleep(600)\n")
    r = await client.post(
        "/jobs",
        json={"entrypoint": PY, "args": [path], "nproc_per_node": 2, "termination_grace": 2},
    )
    job_id = r.json()["id"]
    await wait_job(client, job_id, {"RUNNING"})
    pids = [
        w["pid"]
        for w in (await client.get(f"/jobs/{job_id}/workers")).json()["groups"][0]["workers"]
    ]
    assert (await client.post(f"/jobs/{job_id}/cancel", json={})).status_code == 200
    job = await wait_job(client, job_id)
    assert job["state"] == "CANCELLED"
    await wait_group(client, job_id, {"STOPPED"})
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    again = await client.post(f"/jobs/{job_id}/cancel", json={})
    assert again.status_code == 409 and "already ended" in again.json()["detail"]


async def test_worker_environment_contract(client, tmp_path):
    """Workers get torchrun's variables with consistent ranks and a fresh master port per attempt."""
    out = tmp_path / "env"
    out.mkdir()
    path = script(
        tmp_path,
        "env.py",
        f"""
        import json, os, sys
        d = dict(os.environ)
        name = d["TORCHELASTIC_RESTART_COUNT"] + "-" + d["LOCAL_RANK"]
        open({str(out)!r} + "/" + name + ".json", "w").write(json.dumps(d))
        if d["TORCHELASTIC_RESTART_COUNT"] == "0" and d["LOCAL_RANK"] == "0":
            import time  # fail only once rank 1 has written its environment
            deadline = time.monotonic() + 30
            while not os.path.exists({str(out)!r} + "/0-1.json") and time.monotonic() < deadline:
                time.sleep(0.01)
            sys.exit(1)
    """,
    )
    r = await client.post(
        "/jobs",
        json={"entrypoint": PY, "args": [path], "nproc_per_node": 2, "env": {"MY_SETTING": "x"}},
    )
    job = await wait_job(client, r.json()["id"])
    assert job["state"] == "SUCCEEDED"
    envs = {p.stem: json.loads(p.read_text()) for p in out.iterdir()}
    assert set(envs) == {"0-0", "0-1", "1-0", "1-1"}
    for name, env in envs.items():
        attempt, local = name.split("-")
        assert env["LOCAL_RANK"] == env["RANK"] == env["ROLE_RANK"] == local
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == env["ROLE_WORLD_SIZE"] == "2"
        assert env["GROUP_RANK"] == "0" and env["GROUP_WORLD_SIZE"] == "1"
        assert env["ROLE_NAME"] == "default" and env["TORCHELASTIC_RUN_ID"] == job["id"]
        assert env["TORCHELASTIC_MAX_RESTARTS"] == "3"
        assert env["TORCHELASTIC_USE_AGENT_STORE"] == "False"
        assert env["TORCHELASTIC_ERROR_FILE"].endswith(f"attempt_{attempt}/{local}/error.json")
        assert env["OMP_NUM_THREADS"] == "1" and env["MY_SETTING"] == "x"
        assert env["ELASTICD_JOB_ID"] == job["id"] and "NOTIFY_SOCKET" not in env
    assert envs["0-0"]["MASTER_PORT"] == envs["0-1"]["MASTER_PORT"]
    assert envs["0-0"]["MASTER_PORT"] != envs["1-0"]["MASTER_PORT"]


async def test_logs_are_served_per_rank_attempt_and_stream(client, tmp_path):
    """stdout/stderr land per attempt and rank; tail and attempt select; traversal is refused."""
    path = script(tmp_path, "crash.py", CRASH_ONCE)
    r = await client.post("/jobs", json={"entrypoint": PY, "args": [path], "nproc_per_node": 2})
    job_id = r.json()["id"]
    await wait_job(client, job_id)
    latest = await client.get(f"/jobs/{job_id}/logs", params={"local_rank": 1})
    assert latest.status_code == 200 and latest.text == "rank 1 attempt 1\n"
    first = await client.get(
        f"/jobs/{job_id}/logs", params={"local_rank": 1, "attempt": 0, "stream": "stderr"}
    )
    assert first.text == "crashing\n"
    assert (
        await client.get(f"/jobs/{job_id}/logs", params={"local_rank": 1, "tail": 0})
    ).text == ""
    for params in ({"local_rank": 5}, {"attempt": 9}):
        missing = await client.get(f"/jobs/{job_id}/logs", params=params)
        assert missing.status_code == 404
    for params in ({"stream": "../../etc/passwd"}, {"local_rank": "../../x"}, {"attempt": "-1"}):
        bad = await client.get(f"/jobs/{job_id}/logs", params=params)
        assert bad.status_code == 422


async def test_unknown_ids_are_404_problems(client):
    """Every per-job endpoint answers 404 problem+json for an unknown id."""
    for method, path in [
        ("GET", "/jobs/nope"),
        ("GET", "/jobs/nope/workers"),
        ("GET", "/jobs/nope/events"),
        ("GET", "/jobs/nope/logs"),
        ("POST", "/jobs/nope/cancel"),
    ]:
        r = await client.request(method, path, json={} if method == "POST" else None)
        assert r.status_code == 404, path
        assert r.headers["content-type"].startswith("application/problem+json")
        assert "nope" in r.json()["detail"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"entrypoint": ""}, "entrypoint"),
        ({"entrypoint": "x", "nproc_per_node": -2}, "nproc_per_node"),
        ({"entrypoint": "x", "min_nodes": 4, "max_nodes": 2}, "min_nodes"),
        ({"entrypoint": "x", "env": {"A": 5}}, "env.A"),
        ({"entrypoint": "x", "env": {"": "x"}}, "env"),  # no process could be given it
        ({"entrypoint": "x", "surprise": True}, "surprise"),
        ({"args": ["x"]}, "entrypoint"),
    ],
)
async def test_malformed_specs_get_422_naming_the_field(client, body, field):
    """A bad spec is a 422 problem whose detail names the offending field."""
    r = await client.post("/jobs", json=body)
    assert r.status_code == 422
    assert field in r.json()["detail"]


async def test_non_json_body_is_422(client):
    """A body that is not JSON is refused with 422, and the daemon keeps serving."""
    r = await client.post(
        "/jobs", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 422
    assert (await client.get("/healthz")).status_code == 200


async def test_list_filters_and_paginates(client, tmp_path):
    """GET /jobs filters by state and pages with limit/offset, newest first."""
    ids = []
    for i in range(3):
        r = await client.post(
            "/jobs", json={"id": f"j{i}", "entrypoint": PY, "args": ["-c", "pass"]}
        )
        ids.append(r.json()["id"])
        await wait_job(client, ids[-1])
    page = (await client.get("/jobs", params={"limit": 2})).json()
    assert [j["id"] for j in page["jobs"]] == ["j2", "j1"] and page["total"] == 3
    assert page["next_offset"] == 2
    rest = (await client.get("/jobs", params={"limit": 2, "offset": 2})).json()
    assert [j["id"] for j in rest["jobs"]] == ["j0"] and rest["next_offset"] is None
    assert (await client.get("/jobs", params={"state": "FAILED"})).json()["total"] == 0
    assert (await client.get("/jobs", params={"state": "SUCCEEDED"})).json()["total"] == 3
    assert (await client.get("/jobs", params={"state": "BOGUS"})).status_code == 422


async def test_bad_entrypoint_fails_the_job_clearly(client):
    """A program that does not exist fails the job with a message naming it."""
    r = await client.post("/jobs", json={"entrypoint": "/no/such/program"})
    job = await wait_job(client, r.json()["id"])
    assert job["state"] == "FAILED"
    assert "/no/such/program" in job["reason"]


async def test_events_after_filters(client):
    """?after=SEQ returns only later events, in order."""
    r = await client.post("/jobs", json={"entrypoint": PY, "args": ["-c", "pass"]})
    job = await wait_job(client, r.json()["id"])
    events = await events_of(client, job["id"])
    seqs = [e["seq"] for e in events]
    assert seqs == sorted(seqs) and len(seqs) >= 4
    later = (await client.get(f"/jobs/{job['id']}/events", params={"after": seqs[1]})).json()
    assert [e["seq"] for e in later] == seqs[2:]


async def test_every_event_of_a_job_says_which_job_of_its_id_it_is(client, tmp_path):
    """Each event a job gets (submission, placement, its agent's, the cancel, its states)
    carries the job's ``incarnation_tag``: a read by id leaves out another job's."""
    path = script(tmp_path, "sleep.py", "import time; time.sleep(600)\n")
    r = await client.post("/jobs", json={"entrypoint": PY, "args": [path], "termination_grace": 2})
    tag = incarnation_tag(Job.model_validate(r.json()))
    await wait_job(client, r.json()["id"], {"RUNNING"})
    assert (await client.post(f"/jobs/{r.json()['id']}/cancel", json={})).status_code == 200
    await wait_job(client, r.json()["id"])
    events = await events_of(client, r.json()["id"])
    kinds = {e["kind"] for e in events}
    assert {"job.submitted", "job.placed", "workers.started", "job.cancel_requested"} <= kinds
    assert [e for e in events if e["job_tag"] != tag] == []


async def test_delete_forgets_a_finished_job_and_refuses_a_running_one(client, daemon, tmp_path):
    """DELETE removes a finished job's records (404 after); a running job gets 409."""
    path = script(tmp_path, "sleep.py", "import time; time.sleep(600)\n")
    live = (
        await client.post("/jobs", json={"entrypoint": PY, "args": [path], "termination_grace": 1})
    ).json()["id"]
    await wait_job(client, live, {"RUNNING"})
    refused = await client.delete(f"/jobs/{live}")
    assert refused.status_code == 409 and "cancel it" in refused.json()["detail"]
    done = (await client.post("/jobs", json={"entrypoint": PY, "args": ["-c", "pass"]})).json()
    await wait_job(client, done["id"])
    assert (await client.delete(f"/jobs/{done['id']}")).status_code == 204
    assert (await client.get(f"/jobs/{done['id']}")).status_code == 404
    assert (await client.delete(f"/jobs/{done['id']}")).status_code == 404
    leftovers = await daemon.store.list(f"ev/{done['id']}/")
    assert not leftovers.entries
    assert [j["id"] for j in (await client.get("/jobs")).json()["jobs"]] == [live]


async def test_finished_jobs_are_deleted_after_the_retention_and_running_ones_kept(tmp_path):
    """job_retention: a job that ended longer ago than that is deleted (404, no store keys, no
    local events), and so are local events of jobs gone from the store; a running job is never
    touched; 0 turns retention off."""
    daemon = make_daemon(tmp_path, job_retention=1.0)
    path = script(tmp_path, "sleep.py", "import time; time.sleep(600)\n")
    async with asyncio.timeout(60):
        await daemon.start()
        try:
            transport = httpx.ASGITransport(app=create_app(daemon))
            async with httpx.AsyncClient(
                transport=transport,
                headers={"Authorization": f"Bearer {daemon.token}"},
                base_url="http://localhost",
            ) as client:
                live = (
                    await client.post(
                        "/jobs", json={"entrypoint": PY, "args": [path], "termination_grace": 1}
                    )
                ).json()["id"]
                done = await client.post("/jobs", json={"entrypoint": PY, "args": ["-c", ""]})
                done_id = done.json()["id"]
                await wait_job(client, done_id)
                assert daemon.events.read(done_id)
                while (await client.get(f"/jobs/{done_id}")).status_code != 404:
                    await asyncio.sleep(0.1)
                assert not (await daemon.store.list(f"ev/{done_id}/")).entries
                assert not daemon.events.read(done_id)
                job = (await client.get(f"/jobs/{live}")).json()
                assert job["state"] == "RUNNING"
                # Local events of a job deleted while this daemon was down go too.
                (event,) = daemon.events.read(live, limit=1)
                ghost = event.model_copy(update={"job_id": "ghost", "time": time.time() - 60})
                daemon.db.conn.execute(
                    "INSERT INTO events (job_id, doc) VALUES (?, ?)",
                    ("ghost", ghost.model_dump_json()),
                )
                assert daemon.events.read("ghost")
                while daemon.events.read("ghost"):
                    await asyncio.sleep(0.1)
                assert daemon.events.read(live)  # a job still in the store keeps its events
                await client.post(f"/jobs/{live}/cancel", json={})
        finally:
            await daemon.shutdown()
    kept = make_daemon(tmp_path / "kept", job_retention=0)
    async with asyncio.timeout(30):
        await kept.start()
        try:
            assert not [t for t in asyncio.all_tasks() if t.get_name() == "job-retention"]
        finally:
            await kept.shutdown()


async def test_retention_deletes_only_the_job_whose_end_it_counted(tmp_path):
    """Retention decides on this node's copy of the jobs, which lags the store: a job whose
    end it counted past retention, deleted and its id taken by a job that just ended, is
    not deleted again (the new job keeps its retention); an up-to-date copy deletes it."""
    daemon = make_daemon(tmp_path, job_retention=0)  # no retention loop: expire runs here
    async with asyncio.timeout(60):
        await daemon.start()
        try:
            transport = httpx.ASGITransport(app=create_app(daemon))
            headers = {"Authorization": f"Bearer {daemon.token}"}
            async with httpx.AsyncClient(
                transport=transport, headers=headers, base_url="http://localhost"
            ) as client:
                spec = {"id": "kept", "entrypoint": "/bin/true", "min_nodes": 2}
                assert (await client.post("/jobs", json=spec)).status_code == 201
                old = (await client.post("/jobs/kept/cancel", json={})).json()
                reconciler = daemon.jobs.reconciler
                while "kept" not in reconciler.ends:  # this node saw the end
                    await asyncio.sleep(0.01)
                stale = dict(reconciler.known)
                assert (await client.delete("/jobs/kept")).status_code == 204
                assert (await client.post("/jobs", json=spec)).status_code == 201
                new = (await client.post("/jobs/kept/cancel", json={})).json()
                assert new["created_at"] != old["created_at"]
                # The copy as it was before the delete, its end seen long ago.
                reconciler.known = stale
                end = reconciler.ends["kept"]
                reconciler.ends["kept"] = EndSeen(old["finished_at"], end.boot_id, -1e9)
                assert await daemon.jobs.expire(1.0) == []
                assert (await client.get("/jobs/kept")).json()["created_at"] == new["created_at"]
                # Once the copy has the new job and its end is past retention, it goes.
                reconciler.known = {j.id: j for j in await daemon.jobs.documents.all()}
                reconciler.ends["kept"] = EndSeen(new["finished_at"], end.boot_id, -1e9)
                assert await daemon.jobs.expire(1.0) == ["kept"]
        finally:
            await daemon.shutdown()


async def test_a_join_that_times_out_fails_the_job_with_the_reason(client, daemon):
    """Placed on two nodes, one of which never joins: the join times out, FAILED, and says why.

    The scheduler places a gang only on live nodes, so the second node here is a
    record bound to a lease the test keeps alive, with no daemon behind it.
    """
    lease = await daemon.store.grant(30)
    ghost = daemon.cluster.record.model_copy(update={"name": "ghost", "url": "http://127.0.0.1:9"})
    await daemon.store.put("nodes/ghost", ghost.model_dump_json().encode(), lease=lease)
    spec = {"entrypoint": PY, "args": ["-c", "pass"], "min_nodes": 2, "max_nodes": 2}
    r = await client.post("/jobs", json={**spec, "join_timeout": 1})
    assert r.status_code == 201, r.text
    job = await wait_job(client, r.json()["id"], timeout=30)
    await daemon.store.revoke(lease)
    assert job["state"] == "FAILED" and "rendezvous failed" in job["reason"], job
    (failed,) = [e for e in await events_of(client, job["id"]) if e["kind"] == "rendezvous.failed"]
    assert failed["source"] == "rendezvous" and failed["state"] == "FAILED"


async def test_a_traceback_in_stderr_is_the_cause_without_record(client, tmp_path):
    """A worker that raises without torch's @record: the job's cause is its exception, from the log."""
    path = script(
        tmp_path,
        "raise.py",
        """
        import sys
        print("about to fail", file=sys.stderr, flush=True)
        def load(name):
            raise FileNotFoundError(f"no checkpoint {name}")
        load("ckpt-7")
    """,
    )
    r = await client.post("/jobs", json={"entrypoint": PY, "args": [path], "max_restarts": 0})
    job = await wait_job(client, r.json()["id"])
    assert job["state"] == "FAILED"
    error = job["error"]
    assert error["message"] == "FileNotFoundError: no checkpoint ckpt-7", error
    assert error["source"] == "log" and error["exit_code"] == 1
    assert error["traceback"].startswith("Traceback (most recent call last):")
    assert 'load("ckpt-7")' in error["traceback"]
    exited = [e for e in await events_of(client, job["id"]) if e["kind"] == "worker.exited"]
    assert exited and exited[0]["error"]["source"] == "log", exited
