"""Helpers for the fault-matrix tests (issue 12): timing lines, "nothing lost" checks.

Test side only. ``job_processes`` finds every live process of a job by the
``ELASTICD_JOB_ID`` and ``ELASTICD_TOKEN_FILE`` in its environment (reading
``/proc/<pid>/environ`` needs root for other users' processes, as CI and the
e2e suite run), so a worker's children count too, also those that left its
process group or session. The 3-member etcd cluster of the etcd cases is
``tests.e2e.etcd_cluster.EtcdCluster``.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import httpx


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


async def submit(c: httpx.AsyncClient, job_id: str, worker: Path, out: Path, **fields: Any) -> None:
    """Submit a job of the note-writing worker (``worker out``); 201 or the test fails."""
    job = {"id": job_id, "entrypoint": sys.executable, "args": [str(worker), str(out)], **fields}
    r = await c.post("/jobs", json=job)
    assert r.status_code == 201, r.text


async def groups(c: httpx.AsyncClient, job_id: str) -> dict[str, dict[str, Any]]:
    return {g["node"]: g for g in (await c.get(f"/jobs/{job_id}/workers")).json()["groups"]}


def starts(events: list[dict[str, Any]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for e in events:
        if e["kind"] == "workers.started":
            counts[e["node"]] = counts.get(e["node"], 0) + 1
    return counts
