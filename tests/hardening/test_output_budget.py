"""A job's output never takes more than its user could write (issue 22, finding 10).

The daemon appends worker output as root. These attacks run against a real
root ``elasticd serve`` whose jobs run as a throwaway user: workers that
print far past their ``log_limit_bytes``, and workers that print until the
log filesystem (a loop-mounted ext4 image with a 20% root reserve) has no
space left for unprivileged users. In both the files stop where they must,
the drop is counted in one event, and the workers finish at once: the daemon
keeps draining their pipes. Needs root (users, ``mount``), as CI has.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.hardening.support import Served, script, serve
from tests.users import User, Users

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="plays a job user and mounts: needs root"),
]

#: System python: stdlib only, readable by the job's user (the project's venv may not be).
SYSTEM_PY = "/usr/bin/python3"

MiB = 1 << 20

#: Each worker writes this many bytes to stdout and to stderr, in a pattern the test rebuilds.
LOUD = """
import os, sys
total = int(sys.argv[1])
line = b"%s" % (b"x" * 63,)
block = b"".join(b"%07d" % i + line[7:] + b"\\n" for i in range(1024))  # 64 KiB
for fd in (1, 2):
    left = total
    while left:
        n = os.write(fd, block[: min(len(block), left)])
        left -= n
"""


def expected_head(n: int) -> bytes:
    """The first ``n`` bytes a LOUD worker writes to each stream."""
    block = b"".join(b"%07d" % i + b"x" * 56 + b"\n" for i in range(1024))
    return (block * (n // len(block) + 1))[:n]


def job_user_daemon(root: Path, user: User, *extra: str) -> Served:
    return serve(root, "--run-as", user.name, *extra)


async def finished(c: httpx.AsyncClient, job_id: str, timeout: float) -> dict[str, Any]:
    """The job once it is terminal (polled under a deadline)."""
    job: dict[str, Any] = {}

    async def poll() -> bool:
        nonlocal job
        job = (await c.get(f"/jobs/{job_id}")).json()
        return job.get("state") in ("SUCCEEDED", "FAILED", "CANCELLED")

    deadline = time.monotonic() + timeout
    while not await poll():
        if time.monotonic() > deadline:
            raise AssertionError(f"job {job_id} not finished after {timeout}s: {job}")
        await asyncio.sleep(0.05)
    return job


async def eventually_async(
    condition: Callable[[], Awaitable[bool]], timeout: float, what: str
) -> None:
    deadline = time.monotonic() + timeout
    while not await condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.05)


async def events_of(c: httpx.AsyncClient, job_id: str, kind: str) -> list[dict[str, Any]]:
    r = await c.get(f"/jobs/{job_id}/events")
    r.raise_for_status()
    return [e for e in r.json() if e["kind"] == kind]


async def test_workers_past_log_limit_bytes_keep_running_and_the_files_stop_at_the_limit(
    open_tmp: Path, users: Users
) -> None:
    """Past log_limit_bytes the files stop at the limit, one event counts the rest, workers finish."""
    user = users.user()
    worker = script(open_tmp, "loud.py", LOUD)
    written = 48 * MiB  # per stream per worker: 48 times the budget
    limit = 1 * MiB
    daemon = job_user_daemon(open_tmp, user)
    try:
        await daemon.wait_ready()
        async with daemon.client() as c:
            started = time.monotonic()
            r = await c.post(
                "/jobs",
                json={"id": "loud", "entrypoint": SYSTEM_PY, "args": [worker, str(written)],
                      "cwd": str(open_tmp), "nproc_per_node": 2, "max_restarts": 0,
                      "log_limit_bytes": limit},
            )  # fmt: skip
            assert r.status_code == 201, r.text
            job = await finished(c, "loud", 60)
            took = time.monotonic() - started
            assert job["state"] == "SUCCEEDED", job
            # Never blocked: 192 MiB through the pipes in far less than a stalled pipe's forever.
            assert took < 30, took

            folder = daemon.state_dir / "logs" / "loud" / "attempt_0"
            for rank in (0, 1):
                for stream in ("stdout", "stderr"):
                    path = folder / str(rank) / f"{stream}.log"
                    assert path.stat().st_size == limit, (path, path.stat().st_size)
                    assert path.read_bytes() == expected_head(limit)
                    # The logs API serves what was kept.
                    r = await c.get(
                        "/jobs/loud/logs", params={"local_rank": rank, "stream": stream}
                    )
                    assert r.status_code == 200 and r.content == expected_head(limit)

            truncated = await events_of(c, "loud", "logs.truncated")
            assert len(truncated) == 1, truncated
            dropped_per_worker = 2 * (written - limit)
            assert truncated[0]["bytes_lost"] == 2 * dropped_per_worker, truncated[0]
            assert truncated[0]["lost_by_rank"] == {
                "0": dropped_per_worker,
                "1": dropped_per_worker,
            }
            assert not await events_of(c, "loud", "logs.lost")
    finally:
        daemon.stop()
    assert "Traceback" not in daemon.output(), daemon.output()[-3000:]


@pytest.mark.parametrize("limit", [0, 1, (64 << 10) - 1, (1 << 40) + 1, -1, "1MiB"])
async def test_log_limit_bytes_out_of_bounds_is_refused(open_tmp: Path, limit: object) -> None:
    """A log_limit_bytes below 64 KiB, above 1 TiB or not an integer gets 422 naming the field."""
    daemon = serve(open_tmp)
    try:
        await daemon.wait_ready()
        async with daemon.client() as c:
            r = await c.post("/jobs", json={"entrypoint": "/bin/true", "log_limit_bytes": limit})
            assert r.status_code == 422, r.text
            assert "log_limit_bytes" in r.text
    finally:
        daemon.stop()


# -- a filesystem with a root reserve ---------------------------------------------------------


def loop_devices_usable() -> str | None:
    """None when a loop-mounted ext4 can be made here, else why not."""
    for tool in ("losetup", "mkfs.ext4", "mount", "umount"):
        if shutil.which(tool) is None:
            return f"{tool} is missing"
    probe = subprocess.run(["losetup", "-f"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"no free loop device: {probe.stderr.strip()}"
    return None


@contextlib.contextmanager
def ext4_with_reserve(folder: Path, size_mib: int, reserve_percent: int) -> Iterator[Path]:
    """A fresh ext4 image, ``reserve_percent`` of it for root, loop-mounted at ``folder/mnt``."""
    why_not = loop_devices_usable()
    if why_not is not None:
        # A missing tool is an install step CI forgot (.ci/run installs them): fail there.
        # No loop device is the kernel's or the container's to give, not an install step.
        if os.environ.get("CI") and "missing" in why_not:
            raise AssertionError(f"CI must run this test: {why_not}")
        pytest.skip(f"cannot loop-mount an ext4 image here: {why_not}")
    image = folder / "disk.img"
    with image.open("wb") as f:
        f.truncate(size_mib * MiB)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", str(reserve_percent), str(image)], check=True)
    mnt = folder / "mnt"
    mnt.mkdir()
    subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], check=True)
    try:
        mnt.chmod(0o755)
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


async def test_output_stops_where_the_user_has_no_space_left_and_root_s_reserve_stays(
    open_tmp: Path, users: Users
) -> None:
    """On a disk with a root reserve, root's appends stop once users have no space: reserve intact."""
    user = users.user()
    worker = script(open_tmp, "loud.py", LOUD)
    written = 40 * MiB  # per stream per worker: 160 MiB in all, on a 64 MiB disk
    with ext4_with_reserve(open_tmp, 64, 20) as disk:
        before = os.statvfs(disk)
        reserve = (before.f_bfree - before.f_bavail) * before.f_frsize
        assert reserve >= 12 * MiB and before.f_bavail * before.f_frsize > 30 * MiB, before
        daemon = job_user_daemon(open_tmp, user, "--log-dir", str(disk))
        try:
            await daemon.wait_ready()
            async with daemon.client() as c:
                r = await c.post(
                    "/jobs",
                    json={"id": "filler", "entrypoint": SYSTEM_PY,
                          "args": [worker, str(written)], "cwd": str(open_tmp),
                          "nproc_per_node": 2, "max_restarts": 0},
                )  # fmt: skip
                assert r.status_code == 201, r.text
                job = await finished(c, "filler", 60)
                assert job["state"] == "SUCCEEDED", job

                after = os.statvfs(disk)
                # Root's reserve was not touched: what is free for root exceeds users' free
                # space by the whole reserve, and users still have (a little) space too.
                assert after.f_bavail > 0, after
                assert (after.f_bfree - after.f_bavail) * after.f_frsize == reserve, after
                # The daemon stopped appending near users' zero, not far before it.
                assert after.f_bavail * after.f_frsize < 2 * MiB, after
                kept = sum(p.stat().st_size for p in disk.rglob("*.log"))
                lost = await events_of(c, "filler", "logs.lost")
                assert len(lost) == 1, lost
                # Nothing unaccounted: what the files kept plus what was counted is all of it.
                assert kept + lost[0]["bytes_lost"] == 4 * written, (kept, lost[0])
                assert "no space for unprivileged users" in daemon.output()

                # The job's end closes its files: the daemon is ready again.
                async def ready() -> bool:
                    return (await c.get("/readyz")).status_code == 200

                await eventually_async(ready, 10, "/readyz 200 after the job")
            # Root can still write (the reserve is its own), as ext4 intends.
            with (disk / "root-can-write").open("wb") as f:
                f.write(b"\0" * (4 * MiB))
                f.flush()
                os.fsync(f.fileno())
        finally:
            daemon.stop()
    assert "Traceback" not in daemon.output(), daemon.output()[-3000:]
