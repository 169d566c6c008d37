"""Heartbeat files against a hostile worker, and hang detection for jobs of another user.

The heartbeat lies in the worker's own folder, so a worker can put anything
at that path: a FIFO, a link to a root-only file, a folder. The daemon must
keep answering, stop on SIGTERM, and never open what is there (it reads the
file it created through its own descriptor). With ``--run-as nobody`` the
worker must be able to write its file, so that ``startup_timeout`` spares a
worker that pings and ``progress_timeout`` catches one that stops.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import pwd
import signal
import stat
import struct
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from elasticd.agent.progress import ProgressMonitor, ProgressSettings
from elasticd.errors import WorkerSpawnError
from elasticd.supervise.output import OutputPipe
from elasticd.worker.heartbeat import HeartbeatFile, create_heartbeat_file, read_heartbeat
from tests.conftest import events_of, wait_job
from tests.hardening.support import Served, eventually, healthy_pids, pid_alive, serve
from tests.normal_user import NobodyClone

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (jobs run as nobody)"),
]

#: Replaces the heartbeat file with $1 (fifo, symlink to $2, dir), then idles as nobody.
#: A FIFO or a link is renamed over the file in one step; a folder cannot be, so the
#: daemon may look between the removal and the mkdir and see nothing there.
REPLACE = """
hb="$ELASTICD_HEARTBEAT_FILE"
case "$1" in
  fifo) mkfifo "$hb.new" && mv -fT "$hb.new" "$hb" ;;
  symlink) ln -s "$2" "$hb.new" && mv -fT "$hb.new" "$hb" ;;
  dir) rm -f "$hb" && mkdir "$hb" ;;
esac
echo replaced
exec sleep 600
"""

#: What the daemon must answer within, even while it looks at a replaced heartbeat.
ANSWER_WITHIN = 5.0


def _serve_as_nobody(root: Path) -> Served:
    return serve(root, "--run-as", "nobody", env={"ELASTICD_ALLOW_ROOT": "false"})


class _Inotify:
    """Every open, read, write or attribute change of one file, by any process (inotify)."""

    MASK = 0x1 | 0x2 | 0x4 | 0x20  # IN_ACCESS | IN_MODIFY | IN_ATTRIB | IN_OPEN

    def __init__(self, path: Path) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        if libc.inotify_add_watch(self.fd, os.fsencode(path), self.MASK) < 0:
            os.close(self.fd)
            raise OSError(ctypes.get_errno(), f"inotify_add_watch {path}")

    def events(self) -> list[int]:
        """The masks seen since the watch began."""
        masks: list[int] = []
        while True:
            try:
                data = os.read(self.fd, 65536)
            except BlockingIOError:
                return masks
            offset = 0
            while offset < len(data):
                _, mask, _, length = struct.unpack_from("iIII", data, offset)
                masks.append(mask)
                offset += 16 + length

    def close(self) -> None:
        os.close(self.fd)


async def _keeps_answering(daemon: Served, seconds: float) -> None:
    """/healthz answers within ANSWER_WITHIN every time, for ``seconds``."""
    until = time.monotonic() + seconds
    async with httpx.AsyncClient(
        base_url=daemon.url, headers=daemon.headers, timeout=ANSWER_WITHIN
    ) as c:
        while time.monotonic() < until:
            r = await c.get("/healthz")
            assert r.status_code == 200
            await asyncio.sleep(0.1)


async def _event(c: httpx.AsyncClient, job_id: str, kind: str, timeout: float) -> dict[str, Any]:
    """The job's first event of ``kind``, waiting for it under a deadline."""
    deadline = time.monotonic() + timeout
    while True:
        for event in await events_of(c, job_id):
            if event["kind"] == kind:
                return event
        if time.monotonic() > deadline:
            raise AssertionError(f"no {kind} event for job {job_id} within {timeout}s")
        await asyncio.sleep(0.1)


def _is(path: Path, kind: Any) -> bool:
    try:
        return bool(kind(path.lstat().st_mode))
    except FileNotFoundError:
        return False


def _stop_cleanly(daemon: Served) -> int:
    """SIGTERM; the daemon's exit code (it must come well within the test's bounds)."""
    daemon.proc.send_signal(signal.SIGTERM)
    try:
        return daemon.proc.wait(30)
    except subprocess.TimeoutExpired:
        daemon.kill9()
        raise AssertionError("the daemon ignored SIGTERM for 30 s") from None


@pytest.mark.parametrize(
    ("kind", "described"),
    [("fifo", "a FIFO"), ("symlink", "a symbolic link"), ("dir", "a directory")],
)
async def test_a_replaced_heartbeat_never_blocks_the_daemon_nor_is_opened(
    open_tmp: Path, kind: str, described: str
) -> None:
    """A worker (nobody) swaps its heartbeat for a FIFO, a link to a root-only file or a folder
    while hang detection reads it: /healthz and the workers view keep answering, one
    worker.heartbeat_replaced event says what is there, SIGTERM stops the daemon (exit 0) and
    its worker, and the link's target is never opened, read or changed."""
    private = open_tmp / "private"
    private.mkdir(mode=0o700)
    target = private / "secret"
    target.write_bytes(b"root only\n")
    target.chmod(0o600)
    watch = _Inotify(target)
    daemon = _serve_as_nobody(open_tmp)
    try:
        async with (
            asyncio.timeout(90),
            httpx.AsyncClient(
                base_url=daemon.url, headers=daemon.headers, timeout=ANSWER_WITHIN
            ) as c,
        ):
            await daemon.wait_ready()
            r = await c.post(
                "/jobs",
                json={
                    "id": "swap",
                    "entrypoint": "/bin/sh",
                    "args": ["-c", REPLACE, "sh", kind, str(target)],
                    # No startup_timeout: the worker is never judged, so the daemon keeps
                    # reading the replaced file every progress_timeout (and on each view).
                    "progress_timeout": 0.3,
                    "termination_grace": 1,
                },
            )
            assert r.status_code == 201, r.text
            (pid,) = await healthy_pids(c, "swap", 1)
            heartbeat = open_tmp / "state" / "logs" / "swap" / "attempt_0" / "0" / "heartbeat"
            swapped = {"fifo": stat.S_ISFIFO, "symlink": stat.S_ISLNK, "dir": stat.S_ISDIR}[kind]
            await eventually(lambda: _is(heartbeat, swapped), 30, "the swap")
            await _keeps_answering(daemon, 2.0)  # several reads at the 0.3 s deadlines
            view = await c.get("/jobs/swap/workers")  # reads the heartbeat for last_progress_at
            assert view.status_code == 200
            assert view.json()["groups"][0]["workers"][0]["last_progress_at"] is None
            assert (await c.get("/jobs/swap")).json()["state"] == "RUNNING"
            events = await events_of(c, "swap")
        assert _stop_cleanly(daemon) == 0
        await eventually(lambda: not pid_alive(pid), 10, f"worker {pid} to stop")
    finally:
        daemon.stop()
        masks = watch.events()
        watch.close()
    assert masks == [], f"the link's target was touched: inotify masks {masks}"
    assert target.read_bytes() == b"root only\n"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600 and target.stat().st_uid == 0
    replaced = [e for e in events if e["kind"] == "worker.heartbeat_replaced"]
    assert len(replaced) == 1, replaced  # said once, not at every read
    message = replaced[0]["message"]
    assert described in message or (kind == "dir" and "removed" in message), message
    assert replaced[0]["local_rank"] == 0


async def test_a_replaced_heartbeat_counts_as_no_progress(open_tmp: Path) -> None:
    """A worker that swapped its heartbeat for a FIFO and never pings is caught by
    startup_timeout like any silent worker; the daemon still answers afterwards."""
    daemon = _serve_as_nobody(open_tmp)
    try:
        async with (
            asyncio.timeout(90),
            httpx.AsyncClient(
                base_url=daemon.url, headers=daemon.headers, timeout=ANSWER_WITHIN
            ) as c,
        ):
            await daemon.wait_ready()
            r = await c.post(
                "/jobs",
                json={
                    "id": "fifo",
                    "entrypoint": "/bin/sh",
                    "args": ["-c", REPLACE, "sh", "fifo"],
                    "startup_timeout": 1.5,
                    "max_restarts": 0,
                    "termination_grace": 1,
                },
            )
            assert r.status_code == 201, r.text
            job = await wait_job(c, "fifo", timeout=60)
            assert job["state"] == "FAILED"
            events = await events_of(c, "fifo")
            hang = next(e for e in events if e["kind"] == "worker.hang")
            assert "has not reported progress since it started" in hang["message"]
            await _keeps_answering(daemon, 0.5)
        assert _stop_cleanly(daemon) == 0
    finally:
        daemon.stop()


# -- hang detection for a job of another user ------------------------------------------

#: Pings every 50 ms for $1 seconds, prints when it stopped, then idles or exits 0 ($2).
PINGER = """
import sys, time
import elasticd.worker as w
until = time.monotonic() + float(sys.argv[1])
while True:
    w.ping()
    last = time.time()
    if time.monotonic() >= until:
        break
    time.sleep(0.05)
print("last ping", last, flush=True)
if sys.argv[2] == "idle":
    time.sleep(600)
"""


def _pinger(root: Path) -> str:
    """``PINGER``, in a file every user can read."""
    (root / "pinger.py").write_text(PINGER)
    (root / "pinger.py").chmod(0o644)
    return str(root / "pinger.py")


async def test_a_pinging_worker_of_another_user_passes_startup_and_progress_timeouts(
    open_tmp: Path, nobody_clone: NobodyClone
) -> None:
    """--run-as nobody: the heartbeat is nobody's, so a worker that pings for 4 s (past
    startup_timeout and several progress_timeouts) is never judged hung and SUCCEEDS."""
    pinger = _pinger(open_tmp)
    daemon = _serve_as_nobody(open_tmp)
    try:
        async with asyncio.timeout(90), daemon.client() as c:
            await daemon.wait_ready()
            r = await c.post(
                "/jobs",
                json={
                    "id": "pings",
                    "entrypoint": nobody_clone.python,
                    "args": [pinger, "4", "exit"],
                    "startup_timeout": 1.5,
                    "progress_timeout": 1.0,
                    "max_restarts": 0,
                    "termination_grace": 1,
                },
            )
            assert r.status_code == 201, r.text
            await healthy_pids(c, "pings", 1)
            heartbeat = open_tmp / "state" / "logs" / "pings" / "attempt_0" / "0" / "heartbeat"
            assert heartbeat.stat().st_uid == pwd.getpwnam("nobody").pw_uid
            job = await wait_job(c, "pings", timeout=60)
            events = await events_of(c, "pings")
    finally:
        daemon.stop()
    hangs = [e["message"] for e in events if e["kind"] == "worker.hang"]
    assert job["state"] == "SUCCEEDED" and job["restart_count"] == 0, (job, hangs)
    assert hangs == []


async def test_a_worker_of_another_user_that_stops_pinging_is_caught(
    open_tmp: Path, nobody_clone: NobodyClone
) -> None:
    """--run-as nobody: a worker that pings for 1 s then idles is declared hung about
    progress_timeout after its last ping (not never, as when it could not write its file)."""
    pinger = _pinger(open_tmp)
    daemon = _serve_as_nobody(open_tmp)
    timeout = 1.0
    try:
        async with asyncio.timeout(90), daemon.client() as c:
            await daemon.wait_ready()
            r = await c.post(
                "/jobs",
                json={
                    "id": "stops",
                    "entrypoint": nobody_clone.python,
                    "args": [pinger, "1", "idle"],
                    "progress_timeout": timeout,
                    "max_restarts": 0,
                    "termination_grace": 1,
                },
            )
            assert r.status_code == 201, r.text
            hang = await _event(c, "stops", "worker.hang", 30)
            job = await wait_job(c, "stops", timeout=60)
            log = await c.get("/jobs/stops/logs", params={"attempt": 0, "local_rank": 0})
    finally:
        daemon.stop()
    assert "no progress" in hang["message"], hang
    assert timeout <= hang["duration_s"] < timeout + 4.0, hang
    last_ping = float(log.text.split("last ping", 1)[1].split()[0])
    # Wall clocks of two processes: a little slack below, the loaded-machine slack above.
    assert timeout - 0.1 <= hang["time"] - last_ping < timeout + 4.0, (hang, last_ping)
    assert job["state"] == "FAILED" and "hung" in job["error"]["message"]


# -- the daemon's side of the file, without a daemon -----------------------------------


def test_creating_over_a_planted_link_replaces_the_link_and_never_touches_its_target(
    tmp_path: Path,
) -> None:
    """A link (or FIFO) planted at the path is renamed over, not followed; a linked folder is
    refused; the daemon's handle keeps reading its own file whatever is put there later."""
    target = tmp_path / "target"
    target.write_bytes(b"keep")
    folder = tmp_path / "0"
    folder.mkdir()
    path = folder / "heartbeat"
    path.symlink_to(target)
    handle = HeartbeatFile.create(path, owner=(65534, 65534))
    try:
        assert target.read_bytes() == b"keep" and target.stat().st_uid == 0
        st = path.lstat()
        assert stat.S_ISREG(st.st_mode) and (st.st_uid, stat.S_IMODE(st.st_mode)) == (65534, 0o600)
        assert [p.name for p in folder.iterdir()] == ["heartbeat"]  # no temporary left
        assert handle.replaced() is None
        path.unlink()
        os.mkfifo(path)
        assert handle.replaced() == "a FIFO"
        value = handle.read()  # its own descriptor: the FIFO is never opened
        assert value is not None and value.count == 0
    finally:
        handle.close()
    assert handle.read() is None
    linked = tmp_path / "linked"
    linked.symlink_to(folder, target_is_directory=True)
    with pytest.raises(NotADirectoryError):  # O_DIRECTORY | O_NOFOLLOW on a link
        HeartbeatFile.create(linked / "heartbeat")
    assert [p.name for p in folder.iterdir()] == ["heartbeat"]  # nothing made through it


async def test_reading_by_name_refuses_a_fifo_without_waiting(tmp_path: Path) -> None:
    """read_heartbeat (tools, tests) opens with O_NONBLOCK|O_NOFOLLOW: a FIFO or link is None."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    link = tmp_path / "link"
    create_heartbeat_file(tmp_path / "real")
    link.symlink_to(tmp_path / "real")
    async with asyncio.timeout(10):
        assert await asyncio.to_thread(read_heartbeat, fifo) is None
    assert read_heartbeat(link) is None
    assert read_heartbeat(tmp_path / "real") is not None


def test_a_folder_at_the_heartbeat_path_fails_the_spawn_with_a_clear_error(
    tmp_path: Path,
) -> None:
    """A folder the daemon cannot rename over is a WorkerSpawnError naming the path."""
    (tmp_path / "0" / "heartbeat").mkdir(parents=True)
    monitor = ProgressMonitor({0: tmp_path / "0" / "heartbeat"}, ProgressSettings(1.0))
    with pytest.raises(WorkerSpawnError, match="cannot create the heartbeat file"):
        monitor.prepare()
    assert [p.name for p in (tmp_path / "0").iterdir()] == ["heartbeat"]


# -- other files the daemon opens in a worker's folder: hard links ---------------------
#
# Where fs.protected_hardlinks is off, a job's user can hard-link a file of root's into its
# own folder. The test plants the link itself (as root), standing in for such a worker.

SECRET = b"root:only:secret\n"


def _root_only_file(root: Path) -> Path:
    private = root / "private"
    private.mkdir(mode=0o700)
    secret = private / "secret"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    return secret


async def test_a_hard_linked_log_file_is_never_chowned_nor_written(tmp_path: Path) -> None:
    """A stdout.log in the worker's folder that is a hard link to root's file is refused, and
    the file stays root's, 0600, unchanged (it would be chowned to the job user, made 0640 and
    appended to). No daemon path reopens an old worker folder since attempts go on numbering
    from the log folder, so this checks the guard itself: defence in depth."""
    secret = _root_only_file(tmp_path)
    folder = tmp_path / "0"
    folder.mkdir()
    os.link(secret, folder / "stdout.log")
    with pytest.raises(OSError, match="has other hard links"):
        await OutputPipe.open(0, "stdout", folder / "stdout.log", None, owner=(65534, 65534))
    (folder / "stdout.log").unlink()
    (folder / "stdout.log").write_bytes(b"")
    os.chown(folder / "stdout.log", 1, 1)  # a file of a third user: not the worker's either
    with pytest.raises(OSError, match="belongs to uid 1"):
        await OutputPipe.open(0, "stdout", folder / "stdout.log", None, owner=(65534, 65534))
    st = secret.stat()
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o600)
    assert secret.read_bytes() == SECRET


async def test_a_hard_linked_error_file_is_not_quoted_back(open_tmp: Path) -> None:
    """A failing worker whose error.json is a hard link to root's file: the failure is
    reported, saying the file was not read, and none of its content reaches the API."""
    secret = _root_only_file(open_tmp)
    daemon = _serve_as_nobody(open_tmp)
    body = 'while [ ! -e "$(dirname "$TORCHELASTIC_ERROR_FILE")/go" ]; do sleep 0.05; done; exit 3'
    job = {"id": "ef", "entrypoint": "/bin/sh", "args": ["-c", body], "max_restarts": 0}
    try:
        async with asyncio.timeout(60), daemon.client() as c:
            await daemon.wait_ready()
            assert (await c.post("/jobs", json=job)).status_code == 201
            await healthy_pids(c, "ef", 1)
            folder = open_tmp / "state" / "logs" / "ef" / "attempt_0" / "0"
            os.link(secret, folder / "error.json")
            (folder / "go").touch()
            done = await wait_job(c, "ef", timeout=45)
            events = await events_of(c, "ef")
    finally:
        daemon.stop()
    assert done["state"] == "FAILED"
    everything = json.dumps(done) + json.dumps(events)
    assert "root:only" not in everything
    assert "has other hard links and was not read" in everything
