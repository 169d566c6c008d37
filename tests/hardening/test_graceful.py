"""Graceful stop (SIGTERM, what `systemctl stop` sends) of one node of a job, and the watchdog."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time
from pathlib import Path

import pytest

from elasticd.node import systemd
from tests.e2e.cluster import LocalCluster, follow_until
from tests.e2e.fault_support import assert_kept, assert_never_failed, end_without_strays, report
from tests.hardening.support import PY, pid_alive, script, serve

pytestmark = pytest.mark.slow

LEASE_TTL = 10.0

NOTE = """
import json, os, sys, time
with open(sys.argv[1], "a") as f:
    f.write(json.dumps({"world": int(os.environ["WORLD_SIZE"]), "rank": int(os.environ["RANK"]),
                        "pid": os.getpid(), "t": time.time()}) + "\\n")
time.sleep(600)
"""


def notes(path: Path) -> list[dict[str, float]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture
def cluster(tmp_path: Path):
    c = LocalCluster(tmp_path, lease_ttl=LEASE_TTL)
    try:
        yield c
    finally:
        c.stop_all()


async def test_sigterm_of_a_participant_stops_its_workers_leaves_and_the_rest_reform_at_once(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """SIGTERM to one of 3 nodes: its worker is gone within termination_grace, it exits 0, and
    the other two re-form a world of 2 long before its lease (10 s) could have expired; no
    event is lost, and once the job is cancelled none of its processes is left."""
    out = tmp_path / "notes.jsonl"
    worker = script(tmp_path, "note.py", NOTE)
    async with asyncio.timeout(90):
        await cluster.start_all("n0", "n1", "n2")
        async with cluster.client("n0") as c:
            r = await c.post(
                "/jobs",
                json={
                    "id": "g",
                    "entrypoint": PY,
                    "args": [worker, str(out)],
                    "min_nodes": 2,
                    "max_nodes": 3,
                    "termination_grace": 5,
                },
            )
            assert r.status_code == 201, r.text
            await follow_until(c, "g", lambda _: len(notes(out)) >= 3, 60)
            assert {n["world"] for n in notes(out)} == {3}, cluster.logs()
            view = (await c.get("/jobs/g/workers")).json()
            victim = next(g for g in view["groups"] if g["node"] == "n2")
            victim_pids = [w["pid"] for w in victim["workers"]]
            node = cluster.nodes["n2"]
            before = (await c.get("/jobs/g/events", params={"limit": 10_000})).json()
            stopped_at = time.time()
            node.proc.send_signal(signal.SIGTERM)
            code = await asyncio.to_thread(node.proc.wait, 30)
            exited_after = time.time() - stopped_at
            assert code == 0, node.log.read_text()[-3000:]
            assert exited_after < 5 + 3  # termination_grace plus the bounded shutdown steps
            assert not any(pid_alive(p) for p in victim_pids)
            await follow_until(
                c, "g", lambda _: len([n for n in notes(out) if n["world"] == 2]) >= 2, 30
            )
            reformed = [n for n in notes(out) if n["world"] == 2]
            took = max(n["t"] for n in reformed[:2]) - stopped_at
            assert sorted(n["rank"] for n in reformed[:2]) == [0, 1]
            report("graceful stop", "SIGTERM -> daemon exited 0", exited_after)
            report("graceful stop", "SIGTERM -> world of 2 running", took)
            assert took < LEASE_TTL / 2, f"re-formed after {took:.1f}s: waited for the lease?"
            job = (await c.get("/jobs/g")).json()
            assert job["state"] == "RUNNING"
            assert job["restart_count"] == 0  # a node leaving is a membership change
            nodes = {n["name"] for n in (await c.get("/nodes")).json()}
            assert nodes == {"n0", "n1"}  # it revoked its lease on the way out
            events = (await c.get("/jobs/g/events", params={"limit": 10_000})).json()
            assert any(e["node"] == "n2" and e["kind"] == "workers.stopped" for e in events)
            assert_kept(before, events)
            assert_never_failed(events)
            await end_without_strays(c, "g", cluster.token_file)


def _notify_socket(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.setblocking(False)
    return sock


async def _datagrams(sock: socket.socket, seconds: float) -> list[bytes]:
    loop = asyncio.get_running_loop()
    got: list[bytes] = []
    deadline = loop.time() + seconds
    while (left := deadline - loop.time()) > 0:
        try:
            async with asyncio.timeout(left):
                got.append(await loop.sock_recv(sock, 4096))
        except TimeoutError:
            break
    return got


async def test_the_daemon_pings_the_systemd_watchdog_from_its_loop(tmp_path: Path) -> None:
    """With WATCHDOG_USEC, `elasticd serve` sends WATCHDOG=1 at half the interval after READY=1."""
    notify = _notify_socket(tmp_path / "notify.sock")
    daemon = serve(
        tmp_path, env={"NOTIFY_SOCKET": str(tmp_path / "notify.sock"), "WATCHDOG_USEC": "400000"}
    )
    try:
        async with asyncio.timeout(60):
            first = await asyncio.get_running_loop().sock_recv(notify, 4096)
            assert first.startswith(b"READY=1")
            pings = await _datagrams(notify, 1.2)
    finally:
        daemon.stop()
        notify.close()
    watchdog = [p for p in pings if p == b"WATCHDOG=1"]
    assert 3 <= len(watchdog) <= 8, pings  # every 0.2 s
    assert daemon.proc.returncode == 0


async def test_no_watchdog_pings_for_another_pid_or_without_liveness(tmp_path: Path) -> None:
    """WATCHDOG_PID naming another process turns the watchdog off; a failed check skips pings."""
    assert systemd.watchdog_interval({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"}) is None
    env = {"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": str(os.getpid())}
    assert systemd.watchdog_interval(env) == 0.5
    sock = _notify_socket(tmp_path / "n.sock")
    environ = {"NOTIFY_SOCKET": str(tmp_path / "n.sock")}
    healthy = True

    async def alive() -> bool:
        return healthy

    task = asyncio.create_task(systemd.watchdog(0.05, environ, alive=alive))
    try:
        assert len(await _datagrams(sock, 0.3)) >= 3
        healthy = False
        await _datagrams(sock, 0.06)  # drain a ping already under way
        assert await _datagrams(sock, 0.3) == []
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        sock.close()


def test_the_unit_sets_a_watchdog() -> None:
    """The shipped unit asks for the watchdog the daemon implements (verified by test_packaging)."""
    unit = (Path(__file__).resolve().parents[2] / "systemd" / "elasticd.service").read_text()
    assert "WatchdogSec=60" in unit and "NotifyAccess=main" in unit


@pytest.mark.timeout(90)
async def test_shutdown_timeout_bounds_the_wind_down_when_the_store_hangs(tmp_path: Path) -> None:
    """A node whose store stops answering exits within its shutdown_timeout, not 5 + 5 + 3 s."""
    c = LocalCluster(tmp_path, lease_ttl=LEASE_TTL)
    try:
        c.start("n0")  # serves the store
        await c.wait_ready("n0")
        c.start("n1", env={"ELASTICD_SHUTDOWN_TIMEOUT": "1"})
        await c.wait_ready("n1")
        store = c.nodes["n0"].proc
        store.send_signal(signal.SIGSTOP)  # the store hangs: no answer, no refusal
        try:
            node = c.nodes["n1"].proc
            started = time.monotonic()
            node.send_signal(signal.SIGTERM)
            while node.poll() is None and time.monotonic() - started < 30:
                await asyncio.sleep(0.05)
            took = time.monotonic() - started
        finally:
            store.send_signal(signal.SIGCONT)
        assert node.returncode == 0, c.logs()
        # Three steps of at least 1 s each (events, lease, HTTP); 5 + 5 s before the setting.
        assert took < 4.5, f"the stop took {took:.1f} s: {c.logs()}"
    finally:
        c.stop_all()
