"""Worker output: log files, nothing lost at exit, console forwarding, exits despite open pipes."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from .support import Workers, eventually, pid_alive


async def test_output_is_appended_to_the_log_files(workers: Workers) -> None:
    """stdout and stderr land in their own log files, after what the files already held."""
    log_dir = workers.log_dir(0)
    log_dir.mkdir(parents=True)
    (log_dir / "stdout.log").write_bytes(b"earlier\n")
    code = "import sys; print('to out'); print('to err', file=sys.stderr)"
    async with asyncio.timeout(20):
        group = await workers.start(workers.launch(0, code))
        async with group:
            await group.wait()
    assert (log_dir / "stdout.log").read_bytes() == b"earlier\nto out\n"
    assert (log_dir / "stderr.log").read_bytes() == b"to err\n"


async def test_nothing_is_lost_from_a_worker_that_prints_fast_then_exits(workers: Workers) -> None:
    """Every one of 100k lines per stream reaches the files (and the sink), in order."""
    count = 100_000
    code = f"""
        import sys
        for i in range({count}):
            print(i)
            print(i, file=sys.stderr)
    """
    launch = workers.launch(0, code, console_stdout=True, env={"PYTHONUNBUFFERED": ""})
    expected = "".join(f"{i}\n" for i in range(count))
    async with asyncio.timeout(60):
        group = await workers.start(launch)
        async with group:
            result = await group.wait()
        assert result.succeeded
    assert (workers.log_dir(0) / "stdout.log").read_text() == expected
    assert (workers.log_dir(0) / "stderr.log").read_text() == expected
    assert b"".join(workers.output.of(0)) == expected.encode()


async def test_console_forwarding_is_per_rank_and_stream(workers: Workers) -> None:
    """Only the streams chosen for a rank reach the sink; all of them still reach the files."""
    code = "import sys; print('out', {rank}); print('err', {rank}, file=sys.stderr)"
    async with asyncio.timeout(20):
        group = await workers.start(
            workers.launch(0, code.format(rank=0), console_stdout=True),
            workers.launch(1, code.format(rank=1), console_stdout=False, console_stderr=True),
            workers.launch(2, code.format(rank=2), console_stdout=False),
        )
        async with group:
            await group.wait()
    assert sorted(workers.output.lines) == [(0, "stdout", b"out 0\n"), (1, "stderr", b"err 1\n")]
    for rank in range(3):
        assert (workers.log_dir(rank) / "stderr.log").read_bytes() == f"err {rank}\n".encode()


async def test_a_last_line_without_newline_is_forwarded(workers: Workers) -> None:
    """Output that does not end in a newline is still forwarded when the stream closes."""
    code = "import sys; sys.stdout.write('one\\ntwo')"
    async with asyncio.timeout(20):
        group = await workers.start(workers.launch(0, code))
        async with group:
            await group.wait()
    assert workers.output.of(0) == [b"one\n", b"two"]


async def test_an_exit_is_reported_while_a_grandchild_keeps_stdout_open(workers: Workers) -> None:
    """The exit is seen at once although a child holds the pipe; stop() then ends the child."""
    code = """
        import os, sys, time
        if os.fork() == 0:
            time.sleep(0.2)
            print("grandchild still writing", flush=True)
            time.sleep(60)
            os._exit(0)
        print("worker done", flush=True)
        sys.exit(4)
    """
    async with asyncio.timeout(20):
        group = await workers.start(workers.launch(0, code))
        started = time.monotonic()
        result = await group.wait()
        assert time.monotonic() - started < 5.0  # the grandchild would hold it for 60 s
        assert result.exits[0].exit_code == 4
        line = await workers.output.line_starting(0, b"grandchild")
        assert line == b"grandchild still writing\n"
        await group.stop(5.0)
    log = (workers.log_dir(0) / "stdout.log").read_text()
    assert "worker done\n" in log
    assert "grandchild still writing\n" in log
    await eventually(lambda: not _children_of_group_alive(group.pids[0]))


def _children_of_group_alive(pgid: int) -> bool:
    """True while any process in process group `pgid` is still running."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getpgid(int(entry.name)) == pgid and pid_alive(int(entry.name)):
                return True
        except OSError:
            continue
    return False
