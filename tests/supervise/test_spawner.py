"""The spawner thread (elasticd.supervise.spawner): every start forks in one lasting thread, off
the event loop, and its processes are watched from the loop; real threads and processes."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading

import pytest

from elasticd.supervise.spawn import live_children, spawn_process
from elasticd.supervise.spawner import THREAD_NAME, in_spawner, spawner

pytestmark = pytest.mark.timeout(60)


def _name_and_id() -> tuple[str, int]:
    return threading.current_thread().name, threading.get_ident()


async def test_every_start_runs_in_the_same_lasting_thread() -> None:
    """Not the loop's thread, and the same one each time: the parent-death signal of a
    worker belongs to the thread that forked it, which must live as long as the daemon."""
    first = await in_spawner(_name_and_id)
    second = await in_spawner(_name_and_id)
    assert first == second
    assert first[0] == THREAD_NAME
    assert first[1] != threading.get_ident()


async def test_the_loop_runs_while_the_spawner_thread_is_busy() -> None:
    """A start that blocks its thread (a fork waiting for its exec) never blocks the loop:
    the start below only returns once the loop has run, meanwhile, the code that frees it."""
    loop_ran = threading.Event()

    def blocked_until_the_loop_runs() -> bool:
        return loop_ran.wait(timeout=30)

    start = asyncio.ensure_future(in_spawner(blocked_until_the_loop_runs))
    for _ in range(3):
        await asyncio.sleep(0)  # the loop turns while the thread waits
    loop_ran.set()
    assert await start is True


async def test_a_cancelled_start_waits_for_the_thread_then_undoes_what_it_did() -> None:
    """Cancelled while the thread works: the caller still waits for the thread (it may be
    using the caller's descriptors), hands the result to on_cancel, then is cancelled."""
    release = threading.Event()
    undone: list[str] = []

    def work() -> str:
        release.wait(timeout=30)
        return "started"

    async def undo(result: str) -> None:
        undone.append(result)

    task = asyncio.ensure_future(in_spawner(work, on_cancel=undo))
    await asyncio.sleep(0.05)
    task.cancel()
    await asyncio.sleep(0.05)
    assert not task.done()  # still waiting for the thread
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert undone == ["started"]


async def test_a_start_cancelled_after_the_thread_finished_is_undone_too() -> None:
    """Cancelled after the thread has finished but before the caller resumed with the
    result: the process it started is still handed to on_cancel (else it would leak)."""
    undone: list[str] = []

    async def undo(result: str) -> None:
        undone.append(result)

    task = asyncio.ensure_future(in_spawner(lambda: "started", on_cancel=undo))
    await asyncio.sleep(0)  # the task hands the work to the thread and waits
    behind = threading.Event()
    spawner.submit(behind.set)  # runs once the work above has run and queued its result
    assert behind.wait(timeout=30)  # the loop is held here: the result is not delivered yet
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert undone == ["started"]


async def test_a_failed_start_raises_in_the_caller() -> None:
    """An exception in the thread is the awaiting caller's."""

    def fail() -> None:
        raise OSError(24, "Too many open files")

    with pytest.raises(OSError, match="Too many open files"):
        await in_spawner(fail)


async def test_a_spawned_process_exit_code_and_signal_reach_the_loop() -> None:
    """spawn_process's processes: exit codes, and -N for a kill by signal N, as asyncio's;
    each is a live child until it is reaped, and none after."""
    exits = await spawn_process(
        [sys.executable, "-c", "raise SystemExit(3)"], os.environ, identity=None
    )
    sleeper = await spawn_process(
        [sys.executable, "-c", "import time; time.sleep(60)"], os.environ, identity=None
    )
    assert sleeper.pid in live_children()
    assert await exits.wait() == 3
    assert exits.returncode == 3
    os.killpg(sleeper.pid, signal.SIGKILL)
    assert await sleeper.wait() == -signal.SIGKILL
    assert {exits.pid, sleeper.pid}.isdisjoint(live_children())
