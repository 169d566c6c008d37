"""The one termination routine: SIGTERM, grace, SIGKILL, whole process groups, cancellation."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from pathlib import Path

import pytest

from elasticd.supervise.process import GroupResult

from .support import Workers, eventually, pid_alive

HANDLES_TERM = """
    import signal, sys, time
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(17))
    print("ready")
    time.sleep(60)
"""

IGNORES_TERM = """
    import signal, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("ready")
    time.sleep(60)
"""

# The worker starts a grandchild in its process group and prints its pid. The
# grandchild inherits SIGTERM ignored when IGNORE is true (a disposition set to
# "ignore" survives exec), and the worker's stdout unless QUIET is true.
WITH_GRANDCHILD = """
    import signal, subprocess, sys, time
    if {ignore}:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    quiet = subprocess.DEVNULL if {quiet} else None
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], stdout=quiet, stderr=quiet
    )
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    print("grandchild", child.pid)
    time.sleep(60)
"""

GRACE = 0.3
MARGIN = 2.0


async def test_a_worker_that_handles_sigterm_exits_without_sigkill(workers: Workers) -> None:
    """stop() returns as soon as a SIGTERM-handling worker exits, with its own exit code."""
    async with asyncio.timeout(20):
        group = await workers.start(workers.launch(0, HANDLES_TERM))
        await workers.output.line_starting(0, b"ready")
        started = time.monotonic()
        result = await group.stop(10.0)
        assert time.monotonic() - started < 5.0
        exit_ = result.exits[0]
        assert (exit_.exit_code, exit_.signal) == (17, None)
        assert exit_.stopped
        assert result.root_cause is None


async def test_a_worker_that_ignores_sigterm_is_killed_after_the_grace(workers: Workers) -> None:
    """A worker ignoring SIGTERM gets SIGKILL once the grace has passed, and not much later."""
    async with asyncio.timeout(20):
        group = await workers.start(workers.launch(0, IGNORES_TERM))
        await workers.output.line_starting(0, b"ready")
        started = time.monotonic()
        result = await group.stop(GRACE)
        took = time.monotonic() - started
        assert GRACE <= took < GRACE + MARGIN
        assert result.exits[0].signal == signal.SIGKILL
        assert result.exits[0].stopped


@pytest.mark.parametrize(
    ("ignore", "quiet"),
    [(False, False), (True, False), (True, True)],
    ids=["dies-on-sigterm", "ignores-sigterm-holds-stdout", "ignores-sigterm-detached-stdio"],
)
async def test_stop_ends_the_worker_grandchildren(
    workers: Workers, ignore: bool, quiet: bool
) -> None:
    """Every process in the worker's group dies with it, whether or not it obeys SIGTERM."""
    async with asyncio.timeout(20):
        group = await workers.start(
            workers.launch(0, WITH_GRANDCHILD.format(ignore=ignore, quiet=quiet))
        )
        line = await workers.output.line_starting(0, b"grandchild")
        grandchild = int(line.split()[1])
        assert pid_alive(grandchild)
        started = time.monotonic()
        await group.stop(GRACE)
        assert time.monotonic() - started < GRACE + MARGIN
        await eventually(lambda: not pid_alive(grandchild))


async def test_stop_runs_to_the_end_when_its_caller_is_cancelled(workers: Workers) -> None:
    """Cancelling the caller of stop() neither cuts the grace short nor leaves the worker alive."""
    async with asyncio.timeout(20):
        group = await workers.start(workers.launch(0, IGNORES_TERM))
        await workers.output.line_starting(0, b"ready")
        pid = group.pids[0]
        started = time.monotonic()
        stopping = asyncio.create_task(group.stop(GRACE))
        await asyncio.sleep(0)  # let stop() send SIGTERM and start its grace
        stopping.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stopping
        assert time.monotonic() - started >= GRACE
        assert group.closed
        assert group.snapshot().exits[0].signal == signal.SIGKILL
        assert not pid_alive(pid)


def test_a_loop_torn_down_under_a_running_group_still_ends_it(tmp_path: Path) -> None:
    """``asyncio.run`` ending with tasks left (the daemon's main coroutine died, a test
    runner's clean-up) cancels them all at once: the group's exit watches together with the
    task that owns the group. The owner's stop still sees the exit and returns, and the
    loop closes: before, the stop waited for ever for an exit nobody watched."""
    workers = Workers(tmp_path)
    stopped: list[GroupResult] = []
    pids: list[int] = []

    async def main() -> None:
        group = await workers.start(workers.launch(0, HANDLES_TERM))
        await workers.output.line_starting(0, b"ready")
        pids.append(group.pids[0])

        async def owner() -> None:
            try:
                await asyncio.Event().wait()
            finally:
                stopped.append(await group.stop(10.0))

        asyncio.get_running_loop().create_task(owner())
        await asyncio.sleep(0)  # the owner waits; main returns, leaving it and the watches

    runner = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    runner.start()
    runner.join(30)
    assert not runner.is_alive(), "the loop's teardown waited for ever on the group's stop"
    assert pids and not pid_alive(pids[0])
    [result] = stopped
    assert (result.exits[0].exit_code, result.exits[0].stopped) == (17, True)


async def test_stop_is_idempotent_and_ends_a_concurrent_wait(workers: Workers) -> None:
    """Concurrent and repeated stop() calls share one result, and wait() returns that result."""
    async with asyncio.timeout(20):
        group = await workers.start(*(workers.launch(rank, HANDLES_TERM) for rank in range(2)))
        await workers.output.line_starting(0, b"ready")
        await workers.output.line_starting(1, b"ready")
        waiting = asyncio.create_task(group.wait())
        first, second = await asyncio.gather(group.stop(5.0), group.stop(0.0))
        assert first == second == await group.stop(1.0)
        waited = await waiting
        assert waited == first
        assert sorted(waited.exits) == [0, 1]
        assert all(exit_.stopped for exit_ in waited.exits.values())
        assert waited.root_cause is None


async def test_leaving_async_with_stops_running_workers(workers: Workers) -> None:
    """Leaving the ``async with`` block, even by an exception, stops the workers."""
    async with asyncio.timeout(20):
        group = await workers.start(workers.launch(0, HANDLES_TERM))
        await workers.output.line_starting(0, b"ready")
        pid = group.pids[0]
        with pytest.raises(KeyError):
            async with group:
                raise KeyError("agent bug")
        assert group.closed
        assert not pid_alive(pid)
        with pytest.raises(RuntimeError, match="closed"):
            async with group:
                pass
