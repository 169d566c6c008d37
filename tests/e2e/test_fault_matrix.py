"""The fault matrix of issue 12: faults that already held, injected into real daemons, timed.

Each test injects one fault into real ``elasticd serve`` processes on
loopback (and, for the etcd case, a real 3-member etcd cluster), asserts the
outcome, and asserts that nothing was lost: every event the API returned
before the fault is still there and unchanged, the job is not ``FAILED``,
and once the job ends no process of it is left (found by the
``ELASTICD_JOB_ID`` in each process's environment, which catches a worker's
children too). Each test prints its recovery time on a line starting with
``FAULT-MATRIX`` (``pytest -s``), and asserts a generous bound on it.

Everything here runs on the test's side; the workers are tiny Python
scripts that note when they started (no torch).
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.cluster import LocalCluster, read_notes
from tests.e2e.etcd_cluster import EtcdCluster
from tests.e2e.fault_support import (
    assert_kept,
    assert_never_failed,
    end_without_strays,
    events_of,
    groups,
    job_processes,
    pid_alive,
    report,
    starts,
    submit,
    until,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

# A worker that notes who and where it is, then sleeps (or, told to, ignores SIGTERM first,
# crashes once, or exits 0 from its second attempt on).
NOTE = r"""
import json, os, signal, sys, time
if os.environ.get("IGNORE_TERM") == "1":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
note = {"pid": os.getpid(), "t": time.time(), "world": int(os.environ["WORLD_SIZE"]),
        "rank": int(os.environ["RANK"]), "group_rank": int(os.environ["GROUP_RANK"]),
        "attempt": attempt, "tag": os.environ.get("ELASTICD_ATTEMPT", "")}
with open(sys.argv[1], "a") as f:
    f.write(json.dumps(note) + "\n")
if os.environ.get("CRASH_ONCE") == "1" and attempt == 0 and note["rank"] == 1:
    while sum(1 for _ in open(sys.argv[1])) < int(os.environ["WORLD_SIZE"]):
        time.sleep(0.02)  # every rank of this attempt has started (and set its handler)
    sys.exit(3)
if os.environ.get("CRASH_ONCE") == "1" and attempt > 0:
    sys.exit(0)
time.sleep(600)
"""


# -- node restart ---------------------------------------------------------------------------


async def test_node_restart_rejoins_and_the_job_reforms_to_three(tmp_path: Path) -> None:
    """kill -9 of n2's daemon (its worker dies by the parent-death signal), restarted at once
    on the same port and state folder: n2 rejoins, the job is back at 3 nodes, no restart
    spent, nothing lost."""
    out = tmp_path / "notes.jsonl"
    worker = tmp_path / "note.py"
    worker.write_text(NOTE)
    with LocalCluster(tmp_path) as cluster:
        await cluster.start_all("n0", "n1", "n2")
        async with cluster.client("n0") as c:
            await submit(c, "fm-rejoin", worker, out, min_nodes=2, max_nodes=3, termination_grace=2)

            async def three() -> bool:
                found = await groups(c, "fm-rejoin")
                return len(found) == 3 and all(
                    g["state"] == "HEALTHY" and g["group_world_size"] == 3 for g in found.values()
                )

            def of_round(number: int | None = None) -> dict[int, list[dict[str, Any]]]:
                """The notes of workers that ran in a world of 3, by rendezvous round."""
                found: dict[int, list[dict[str, Any]]] = {}
                for n in read_notes(out):
                    round_ = int(n["tag"].split(".")[0])
                    if n["world"] == 3 and (number is None or round_ == number):
                        found.setdefault(round_, []).append(n)
                return found

            async def first_round_running() -> bool:
                return len(of_round(0).get(0, [])) == 3 and await three()

            await until(first_round_running, 40, "3 workers running")
            before = await events_of(c, "fm-rejoin")
            victim = (await groups(c, "fm-rejoin"))["n2"]
            old_pids = [w["pid"] for w in victim["workers"]]
            node = cluster.nodes["n2"]
            killed_at = time.time()
            cluster.kill9("n2", [])  # the daemon only: its worker must die by pdeathsig

            async def orphans_gone() -> bool:
                return not any(pid_alive(p) for p in old_pids)

            await until(orphans_gone, 5, "n2's worker to die with its daemon")
            cluster.start("n2", port=node.port)
            restarted_at = time.time()
            await cluster.wait_ready("n2")

            def rejoined() -> list[dict[str, Any]]:
                """The workers of the latest later round that all 3 nodes run."""
                full = [ns for r, ns in of_round().items() if r > 0 and len(ns) == 3]
                return full[-1] if full else []

            async def back_at_three() -> bool:
                return bool(rejoined()) and await three()

            try:
                await until(back_at_three, 60, "the job back at 3 nodes")
            except AssertionError as exc:
                raise AssertionError(
                    f"{exc}: {await groups(c, 'fm-rejoin')}\n{cluster.logs()}"
                ) from exc
            back = max(n["t"] for n in rejoined())
            report("node restart", "kill -9 -> 3 nodes running again", back - killed_at)
            report("node restart", "daemon restarted -> 3 nodes running again", back - restarted_at)
            assert back - killed_at < 30
            job = (await c.get("/jobs/fm-rejoin")).json()
            assert job["state"] == "RUNNING" and job["restart_count"] == 0, job
            after = await events_of(c, "fm-rejoin")
            print(f"\nFAULT-MATRIX node restart: worker starts per node {starts(after)}")
            assert_kept(before, after)
            assert_never_failed(after)
            await end_without_strays(c, "fm-rejoin", cluster.token_file)


# -- workers that ignore SIGTERM --------------------------------------------------------------

GRACE = 2.0
MARGIN = 3.0  # the agent's own steps on a loaded 2-core machine


async def test_cancel_of_workers_that_ignore_sigterm_kills_them_after_the_grace(
    tmp_path: Path,
) -> None:
    """Cancel: both SIGTERM-ignoring workers are SIGKILLed once termination_grace has passed,
    not much later; the job is CANCELLED and nothing of it is left."""
    out = tmp_path / "notes.jsonl"
    worker = tmp_path / "note.py"
    worker.write_text(NOTE)
    with LocalCluster(tmp_path) as cluster:
        await cluster.start_all("n0")
        async with cluster.client("n0") as c:
            await submit(
                c,
                "fm-stubborn",
                worker,
                out,
                env={"IGNORE_TERM": "1"},
                nproc_per_node=2,
                termination_grace=GRACE,
            )

            async def both_noted() -> bool:
                return len(read_notes(out)) == 2

            await until(both_noted, 30, "both workers to start (and ignore SIGTERM)")
            pids = [n["pid"] for n in read_notes(out)]
            assert set(pids) <= set(job_processes("fm-stubborn", cluster.token_file))
            before = await events_of(c, "fm-stubborn")
            cancelled_at = time.monotonic()
            r = await c.post("/jobs/fm-stubborn/cancel", json={})
            assert r.status_code == 200, r.text

            async def dead() -> bool:
                return not any(pid_alive(p) for p in pids)

            await until(dead, GRACE + 15, "the workers to die")
            took = time.monotonic() - cancelled_at
            report("SIGTERM ignored, cancel", f"cancel -> workers dead (grace {GRACE} s)", took)
            assert GRACE <= took < GRACE + MARGIN

            async def cancelled() -> bool:
                return (await c.get("/jobs/fm-stubborn")).json()["state"] == "CANCELLED"

            await until(cancelled, 15, "CANCELLED")
            ended = time.monotonic() - cancelled_at
            report("SIGTERM ignored, cancel", "cancel -> job CANCELLED", ended)
            after = await events_of(c, "fm-stubborn")
            assert_kept(before, after)
            assert_never_failed(after)
            exits = [e for e in after if e["kind"] == "worker.exited"]
            assert sorted(e["pid"] for e in exits) == sorted(pids)
            assert all(e["signal"] == signal.SIGKILL for e in exits), exits
            assert not job_processes("fm-stubborn", cluster.token_file)


async def test_a_group_restart_escalates_to_sigkill_for_a_worker_that_ignores_sigterm(
    tmp_path: Path,
) -> None:
    """Rank 1 crashes on attempt 0 while rank 0 ignores SIGTERM: rank 0 is SIGKILLed after
    termination_grace, the group restarts once and the job SUCCEEDS; nothing is left."""
    out = tmp_path / "notes.jsonl"
    worker = tmp_path / "note.py"
    worker.write_text(NOTE)
    with LocalCluster(tmp_path) as cluster:
        await cluster.start_all("n0")
        async with cluster.client("n0") as c:
            await submit(
                c,
                "fm-stubborn-restart",
                worker,
                out,
                env={"IGNORE_TERM": "1", "CRASH_ONCE": "1"},
                nproc_per_node=2,
                max_restarts=2,
                termination_grace=GRACE,
            )

            async def ended() -> bool:
                job = (await c.get("/jobs/fm-stubborn-restart")).json()
                return job["state"] in ("SUCCEEDED", "FAILED", "CANCELLED")

            await until(ended, 60, "the job to end")
            job = (await c.get("/jobs/fm-stubborn-restart")).json()
            assert job["state"] == "SUCCEEDED" and job["restart_count"] == 1, job
            events = await events_of(c, "fm-stubborn-restart")
            exits = [e for e in events if e["kind"] == "worker.exited" and e["attempt"] == 0]
            crash = next(e for e in exits if e["exit_code"] == 3)
            stubborn = next(e for e in exits if e["rank"] == 0)
            assert stubborn["signal"] == signal.SIGKILL, exits
            stop = stubborn["time"] - crash["time"]
            report(
                "SIGTERM ignored, group restart", f"crash -> rank 0 killed (grace {GRACE} s)", stop
            )
            assert GRACE <= stop < GRACE + MARGIN
            second = [n for n in read_notes(out) if n["attempt"] == 1]
            assert len(second) == 2
            recovery = max(n["t"] for n in second) - crash["time"]
            report(
                "SIGTERM ignored, group restart", "crash -> both workers running again", recovery
            )
            assert recovery < GRACE + MARGIN + 5
            first_pids = [n["pid"] for n in read_notes(out) if n["attempt"] == 0]
            assert not any(pid_alive(p) for p in first_pids)
            assert not job_processes("fm-stubborn-restart", cluster.token_file)


# -- etcd leader loss ------------------------------------------------------------------------


ETCD_LEASE_TTL = 3.0


async def test_etcd_leader_loss_with_quorum_kept_fences_nothing(tmp_path: Path) -> None:
    """kill -9 of the etcd leader (the endpoint both daemons talk to) under a 2-node job, then
    a restart of that member: no fence, no worker restarted (same pids, restart_count 0, job
    RUNNING), no event lost, the API answers throughout."""
    out = tmp_path / "notes.jsonl"
    worker = tmp_path / "note.py"
    worker.write_text(NOTE)
    with EtcdCluster(tmp_path / "etcd") as etcd:
        leader = await asyncio.to_thread(etcd.leader)
        # The leader first: both daemons talk to it until it dies.
        url = etcd.endpoints(first=etcd.members.index(leader))
        with LocalCluster(tmp_path, lease_ttl=ETCD_LEASE_TTL, store_url=url) as cluster:
            await cluster.start_all("n0", "n1")
            async with cluster.client("n0") as c0, cluster.client("n1") as c1:
                await submit(
                    c0, "fm-leader", worker, out, min_nodes=2, max_nodes=2, termination_grace=2
                )

                async def running() -> bool:
                    found = await groups(c0, "fm-leader")
                    return (
                        len(read_notes(out)) == 2
                        and len(found) == 2
                        and all(g["state"] == "HEALTHY" for g in found.values())
                    )

                await until(running, 40, "both nodes running")
                pids = [n["pid"] for n in read_notes(out)]
                before = await events_of(c0, "fm-leader")
                assert starts(before) == {"n0": 1, "n1": 1}

                latencies: list[float] = []
                failures: list[str] = []
                stop = asyncio.Event()

                async def probe(c: httpx.AsyncClient) -> None:
                    """Ask the API over and over; record how long each answer took."""
                    while not stop.is_set():
                        for path in ("/jobs/fm-leader", "/jobs/fm-leader/workers", "/nodes"):
                            began = time.monotonic()
                            try:
                                r = await c.get(path, timeout=30)
                                if r.status_code != 200:
                                    failures.append(f"{path}: {r.status_code} {r.text}")
                            except httpx.HTTPError as exc:
                                failures.append(f"{path}: {exc!r}")
                            latencies.append(time.monotonic() - began)
                        await asyncio.sleep(0.02)

                probes = [asyncio.create_task(probe(c)) for c in (c0, c1)]
                try:
                    await asyncio.sleep(0.5)
                    killed_at = time.monotonic()
                    leader.kill()
                    new_leader = await asyncio.to_thread(etcd.leader)
                    elected = time.monotonic() - killed_at
                    assert new_leader != leader
                    # Well past the daemons' lease: a false fence would have happened by now.
                    await asyncio.sleep(ETCD_LEASE_TTL + 2)
                finally:
                    stop.set()
                    await asyncio.gather(*probes)
                report("etcd leader loss", "kill -9 of the leader -> new leader", elected)
                report("etcd leader loss", "worst API latency during the change", max(latencies))
                assert not failures, failures[:5]
                for node in cluster.nodes.values():  # the fault reached both daemons
                    assert leader.url in node.log.read_text(), node.log.read_text()
                assert max(latencies) < 5, sorted(latencies)[-5:]
                after = await events_of(c0, "fm-leader")
                kinds = [e["kind"] for e in after]
                assert "agent.fenced" not in kinds, cluster.logs()
                assert starts(after) == {"n0": 1, "n1": 1}, cluster.logs()
                assert all(pid_alive(p) for p in pids)
                assert len(read_notes(out)) == 2
                assert_kept(before, after)
                job = (await c1.get("/jobs/fm-leader")).json()
                assert job["state"] == "RUNNING" and job["restart_count"] == 0, job

                # The member comes back and catches up; still nothing restarted.
                restarted_at = time.monotonic()
                await asyncio.to_thread(etcd.start, leader)
                report(
                    "etcd leader loss",
                    "member restarted -> healthy",
                    time.monotonic() - restarted_at,
                )
                await asyncio.sleep(ETCD_LEASE_TTL)
                final = await events_of(c1, "fm-leader")
                assert "agent.fenced" not in [e["kind"] for e in final]
                assert starts(final) == {"n0": 1, "n1": 1}
                assert all(pid_alive(p) for p in pids)
                assert_kept(after, final)
                assert_never_failed(final)
                job = (await c0.get("/jobs/fm-leader")).json()
                assert job["state"] == "RUNNING" and job["restart_count"] == 0, job
                await end_without_strays(c0, "fm-leader", cluster.token_file)
