"""Helpers for the fault-matrix tests (issue 12): timing lines, "nothing lost" checks, etcd.

Test side only. ``job_processes`` finds every live process of a job by the
``ELASTICD_JOB_ID`` and ``ELASTICD_TOKEN_FILE`` in its environment (reading
``/proc/<pid>/environ`` needs root for other users' processes, as CI and the
e2e suite run), so a worker's children count too, also those that left its
process group or session. ``EtcdCluster`` runs a 3-member etcd on loopback whose
members can be killed with SIGKILL and restarted on their data folders.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import httpx

from tests.store.etcd_server import etcd_binary, free_port


def report(case: str, what: str, seconds: float) -> None:
    """One line of the matrix's measurements, for ``pytest -s``."""
    print(f"\nFAULT-MATRIX {case}: {what} = {seconds:.3f} s", flush=True)


def job_processes(job_id: str, token_file: Path) -> list[int]:
    """Every live process of ``job_id`` run by the cluster whose token file is ``token_file``.

    Found by the environment every worker gets (``ELASTICD_JOB_ID`` and
    ``ELASTICD_TOKEN_FILE``, which its children inherit); the token file's path
    tells this test's cluster from any other running on the machine.
    """
    wanted = {f"ELASTICD_JOB_ID={job_id}".encode(), f"ELASTICD_TOKEN_FILE={token_file}".encode()}
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = set((entry / "environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        if wanted <= environ and pid_alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie is dead)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


async def until(condition: Any, timeout: float, what: str) -> None:
    """Poll the (async) ``condition`` every 50 ms until it is true."""
    deadline = time.monotonic() + timeout
    while not await condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.05)


async def events_of(c: httpx.AsyncClient, job_id: str) -> list[dict[str, Any]]:
    r = await c.get(f"/jobs/{job_id}/events", params={"limit": 10_000})
    assert r.status_code == 200, r.text
    return list(r.json())


def assert_kept(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> None:
    """Every event returned before is still returned, identical."""
    now = {e["seq"]: e for e in after}
    lost = [e for e in before if now.get(e["seq"]) != e]
    assert not lost, f"events lost or changed: {lost}"


def assert_never_failed(events: list[dict[str, Any]]) -> None:
    states = [e["state"] for e in events if e["kind"] == "job.state"]
    assert "FAILED" not in states, states
    assert "job.orphaned" not in [e["kind"] for e in events]


async def end_without_strays(
    c: httpx.AsyncClient, job_id: str, token_file: Path, timeout: float = 30
) -> None:
    """Cancel the running job, wait for CANCELLED, then for no process of the job to be left."""
    assert job_processes(job_id, token_file), "the check does not see the job's workers"
    r = await c.post(f"/jobs/{job_id}/cancel", json={})
    assert r.status_code == 200, r.text

    async def cancelled() -> bool:
        return (await c.get(f"/jobs/{job_id}")).json()["state"] == "CANCELLED"

    await until(cancelled, timeout, f"{job_id} CANCELLED")

    async def no_strays() -> bool:
        return not job_processes(job_id, token_file)

    await until(no_strays, 10, f"no process of {job_id} left")


async def groups(c: httpx.AsyncClient, job_id: str) -> dict[str, dict[str, Any]]:
    return {g["node"]: g for g in (await c.get(f"/jobs/{job_id}/workers")).json()["groups"]}


def starts(events: list[dict[str, Any]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for e in events:
        if e["kind"] == "workers.started":
            counts[e["node"]] = counts.get(e["node"], 0) + 1
    return counts


class EtcdCluster:
    """A 3-member etcd cluster on loopback; members can be killed (-9) and restarted."""

    def __init__(self, root: Path, size: int = 3) -> None:
        self.binary = etcd_binary()
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.names = [f"m{i}" for i in range(size)]
        self.client_ports = [free_port() for _ in self.names]
        self.peer_ports = [free_port() for _ in self.names]
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * size
        self.initial = ",".join(
            f"{n}=http://127.0.0.1:{p}" for n, p in zip(self.names, self.peer_ports, strict=True)
        )

    def url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.client_ports[i]}"

    def start(self, i: int) -> None:
        """Start member ``i`` (again: on the same data folder and ports)."""
        peer = f"http://127.0.0.1:{self.peer_ports[i]}"
        args = [
            self.binary,
            f"--name={self.names[i]}",
            f"--data-dir={self.root / self.names[i]}",
            f"--listen-client-urls={self.url(i)}",
            f"--advertise-client-urls={self.url(i)}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster={self.initial}",
            "--initial-cluster-state=new",
            "--initial-cluster-token=fault-matrix",
            # Raft timers short enough for a quick election, long enough for a loaded box.
            "--heartbeat-interval=50",
            "--election-timeout=500",
            "--logger=zap",
            "--log-outputs=stderr",
            "--log-level=error",
        ]
        with (self.root / f"{self.names[i]}.log").open("ab") as log:
            self.procs[i] = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )

    def start_all(self) -> None:
        for i in range(len(self.names)):
            self.start(i)
        for i in range(len(self.names)):
            self.wait_healthy(i)

    def status(self, i: int) -> dict[str, Any] | None:
        """Member ``i``'s maintenance status (its id and the leader's), or None if it is down."""
        request = urllib.request.Request(
            self.url(i) + "/v3/maintenance/status", data=b"{}", method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=1) as response:
                return dict(json.loads(response.read()))
        except OSError:
            return None

    def leader(self) -> int | None:
        """The index of the member every live member names as leader (None: no agreement)."""
        ids: dict[str, int] = {}
        named = set()
        for i in range(len(self.names)):
            status = self.status(i)
            if status is None:
                continue
            ids[status["header"]["member_id"]] = i
            named.add(status.get("leader"))
        if len(named) != 1:
            return None
        return ids.get(named.pop())

    def wait_healthy(self, i: int, deadline: float = 30) -> None:
        until_ = time.monotonic() + deadline
        while True:
            proc = self.procs[i]
            assert proc is not None
            if proc.poll() is not None:
                raise RuntimeError(f"etcd {self.names[i]} exited; see {self.root}")
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(self.url(i) + "/health", timeout=1) as response,
            ):
                if b'"true"' in response.read():
                    return
            if time.monotonic() > until_:
                raise RuntimeError(f"etcd {self.names[i]} not healthy in {deadline}s")
            time.sleep(0.05)

    def kill(self, i: int) -> None:
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)
        self.procs[i] = None

    def close(self) -> None:
        for i in range(len(self.names)):
            self.kill(i)
