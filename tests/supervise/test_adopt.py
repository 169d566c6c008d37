"""Workers across the daemon's re-exec (elasticd.supervise.adopt), with real child processes:
the identity check, reaping by pidfd with the real status, and the hand-over's JSON."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from pathlib import Path

import pytest

from elasticd.supervise.adopt import (
    AdoptedProcess,
    HandedPipe,
    HandedWorker,
    adopted_children,
    check_worker,
    end_handed,
    end_inherited,
    inherited_to_end,
    unreported_exit,
    zombie_status,
)
from elasticd.supervise.sweep import process_start_time, start_time_of


class Child:
    """A child started without asyncio or subprocess bookkeeping (the test reaps it)."""

    def __init__(self, code: str) -> None:
        self.pid = os.posix_spawn(
            sys.executable, [sys.executable, "-c", code], dict(os.environ), setsid=True
        )

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)


def child(code: str) -> Child:
    return Child(code)


def handed(proc: Child, tmp_path: Path, **changes: object) -> HandedWorker:
    """A worker record for ``proc`` with real descriptors: two pipes, two log files."""
    fds = []
    for stream in ("out", "err"):
        read_fd, write_fd = os.pipe()
        os.close(write_fd)
        fds.append((read_fd, os.open(tmp_path / f"{stream}.log", os.O_WRONLY | os.O_CREAT)))
    start_time = process_start_time(proc.pid)
    assert start_time is not None
    fields: dict[str, object] = {
        "local_rank": 0,
        "pid": proc.pid,
        "start_time": start_time,
        "started_at": 1.0,
        "stdout": HandedPipe(fds[0][0], fds[0][1], 0),
        "stderr": HandedPipe(fds[1][0], fds[1][1], 0),
        "heartbeat_fd": None,
        "beat_started": None,
    }
    fields.update(changes)
    return HandedWorker(**fields)  # type: ignore[arg-type]


async def test_an_adopted_child_is_reaped_with_its_real_exit_code() -> None:
    """A child this process did not start through asyncio is awaited by pidfd and reaped:
    its code 7 is what ``wait`` returns, and it is no adopted child any more."""
    proc = child("import time; time.sleep(0.2); raise SystemExit(7)")
    adopted = AdoptedProcess(proc.pid)
    assert proc.pid in adopted_children()
    async with asyncio.timeout(30):
        assert await adopted.wait() == 7
    assert proc.pid not in adopted_children()
    with pytest.raises(ChildProcessError):
        os.waitpid(proc.pid, os.WNOHANG)  # noqa: ASYNC222 - reaped: nothing left to collect


async def test_a_child_that_died_before_adoption_is_collected_as_a_zombie() -> None:
    """A child killed while nobody waited (the exec's gap) is still a zombie: adopted, its
    signal is reported the asyncio way (negative)."""
    proc = child("import time; time.sleep(60)")
    os.kill(proc.pid, signal.SIGKILL)
    while not unreported_exit(proc.pid, None) and _state(proc.pid) != "Z":
        await asyncio.sleep(0.01)
    async with asyncio.timeout(30):
        assert await AdoptedProcess(proc.pid).wait() == -signal.SIGKILL


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


async def test_check_worker_accepts_its_own_child_and_names_what_is_wrong(tmp_path: Path) -> None:
    """The same child with its descriptors passes; another start time, a lost pipe, a process
    that is not this one's child each fail, with a reason that says which."""
    proc = child("import time; time.sleep(60)")
    try:
        worker = handed(proc, tmp_path)
        assert check_worker(worker, None) is None
        other = handed(proc, tmp_path, start_time=worker.start_time + 1)
        assert "start time" in (check_worker(other, None) or "")
        os.close(worker.stderr.read_fd)
        assert "stderr pipe" in (check_worker(worker, None) or "")
        not_ours = handed(proc, tmp_path, pid=1, start_time=process_start_time(1) or 0)
        assert "no longer a child" in (check_worker(not_ours, None) or "")
        gone = handed(proc, tmp_path, returncode=3)
        assert check_worker(gone, None) is None  # reaped before the exec: its status came along
    finally:
        proc.kill()


async def test_end_handed_kills_and_reaps_a_worker_nobody_took_up(tmp_path: Path) -> None:
    """A handed-over worker no agent takes up is SIGKILLed (its group) and reaped."""
    proc = child("import time; time.sleep(60)")
    worker = handed(proc, tmp_path)
    async with asyncio.timeout(30):
        await end_handed([worker])
    with pytest.raises(ChildProcessError):
        os.waitpid(proc.pid, os.WNOHANG)  # noqa: ASYNC222 - reaped already
    with pytest.raises(OSError, match="Bad file descriptor"):
        os.fstat(worker.stdout.read_fd)  # its descriptors were closed


def test_a_handed_worker_survives_its_json() -> None:
    """The manifest's record of a worker reads back equal (JSON, never pickle)."""
    worker = HandedWorker(
        local_rank=1,
        pid=4242,
        start_time=99,
        started_at=12.5,
        stdout=HandedPipe(10, 11, 5),
        stderr=HandedPipe(12, 13, 0),
        heartbeat_fd=14,
        beat_started=3.25,
        returncode=-9,
    )
    assert HandedWorker.from_json(worker.to_json()) == worker
    assert worker.fds == [10, 11, 12, 13, 14]
    # Its exit reported before the exec, its stdout at its end: nothing of that pipe crosses.
    exited = HandedWorker(
        local_rank=1,
        pid=4242,
        start_time=99,
        started_at=12.5,
        stdout=HandedPipe(-1, -1, 5, at_eof=True),
        stderr=HandedPipe(12, 13, 0),
        heartbeat_fd=None,
        beat_started=None,
        returncode=3,
        reported_at=20.0,
    )
    assert HandedWorker.from_json(exited.to_json()) == exited
    assert exited.fds == [12, 13]


async def test_check_worker_takes_a_pipe_at_its_end_without_descriptors(tmp_path: Path) -> None:
    """A worker that exited before the exec, its pipes at their end (nothing handed: -1),
    passes the check on its status alone."""
    proc = child("import time; time.sleep(60)")
    try:
        worker = handed(
            proc,
            tmp_path,
            stdout=HandedPipe(-1, -1, 0, at_eof=True),
            stderr=HandedPipe(-1, -1, 0, at_eof=True),
            returncode=0,
            reported_at=1.0,
        )
        assert check_worker(worker, None) is None
        assert worker.fds == []
    finally:
        proc.kill()


async def test_end_inherited_kills_what_it_must_and_reaps_every_one() -> None:
    """Of the children a new image found: one nobody reads is killed (its group) and reaped,
    one that ends on its own is reaped with it; a handed worker is left alone, still ours."""
    killed = child("import time; time.sleep(60)")
    ends = child("import time; time.sleep(0.2)")
    worker = child("import time; time.sleep(60)")
    # A pid to kill whose start time is not the one the old image recorded: by then
    # another process (a reused pid): never signalled.
    other = child("import time; time.sleep(60)")
    started = {p.pid: start_time_of(p.pid) for p in (killed, ends)}
    started[other.pid] = (start_time_of(other.pid) or 0) + 1
    try:
        async with asyncio.timeout(30):
            ending = asyncio.ensure_future(
                end_inherited({killed.pid, other.pid}, {killed.pid, ends.pid}, started)
            )
            await asyncio.sleep(0)
            # Reaped here, but still strays of their job: the containment's "known" (the
            # daemon's own children, whom it never kills) does not list them.
            assert not {killed.pid, ends.pid} & adopted_children()
            await ending
        for reaped in (killed, ends):
            with pytest.raises(ChildProcessError):
                os.waitpid(reaped.pid, os.WNOHANG)  # noqa: ASYNC222 - reaped already
        assert _state(worker.pid) not in (None, "Z")
        assert _state(other.pid) not in (None, "Z")
    finally:
        worker.kill()
        other.kill()


@pytest.mark.parametrize(
    ("children", "handed", "unhanded", "kill", "reap"),
    [
        # nothing left: nothing to do
        ({}, set(), [], set(), set()),
        # a handed worker (alive, or a zombie that exited in the exec) is its group's to reap
        ({100: 7}, {(100, 7)}, [], set(), set()),
        # a health check the old image started and did not hand over: killed, reaped
        ({100: 7, 200: 9}, {(100, 7)}, [(200, 9)], {200}, {200}),
        # a child nobody started through start_process (a stack dump, a swept worker): reaped
        ({300: 4}, set(), [], set(), {300}),
        # same pid, another start time: not the handed worker, nor the unhanded check
        ({100: 8}, {(100, 7)}, [(100, 9)], set(), {100}),
        # start time unreadable: not a worker this image can name; reaped, never killed
        ({400: None}, set(), [(400, 1)], set(), {400}),
    ],
)
def test_which_inherited_children_are_killed_and_reaped(
    children: dict[int, int | None],
    handed: set[tuple[int, int]],
    unhanded: list[tuple[int, int]],
    kill: set[int],
    reap: set[int],
) -> None:
    """After an exec every child that is not a handed worker is reaped; those the old image
    started and handed nothing of are killed first (by pid and start time, never pid alone)."""
    assert inherited_to_end(children, handed, unhanded) == (kill, reap)


@pytest.mark.parametrize(
    ("code", "status"), [("raise SystemExit(3)", 3), ("import os; os.kill(os.getpid(), 9)", -9)]
)
async def test_a_zombie_s_status_is_read_without_reaping_it(code: str, status: int) -> None:
    """What the re-exec reads of a worker that exited and nobody reaped yet: its code (or
    signal, negative); None while it runs; and it stays a zombie for whoever reaps it."""
    running = child("import time; time.sleep(60)")
    proc = child(code)
    try:
        assert zombie_status(running.pid) is None
        async with asyncio.timeout(30):
            while _state(proc.pid) != "Z":
                await asyncio.sleep(0.01)
        assert zombie_status(proc.pid) == status
        assert zombie_status(proc.pid) == status  # looked at, not reaped
        _, raw = os.waitpid(proc.pid, 0)  # noqa: ASYNC222 - a zombie: at once
        assert os.waitstatus_to_exitcode(raw) == status
        assert zombie_status(proc.pid) is None  # reaped: not ours any more
    finally:
        running.kill()
        proc.kill()
