"""WorkerGroupProcesses with real child processes: spawn, exits, error files, spawn failures."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import pytest

from elasticd.clock import FakeClock
from elasticd.errors import WorkerSpawnError
from elasticd.supervise import GroupResult, WorkerError, WorkerExit, WorkerGroupProcesses
from elasticd.supervise.spawn import SpawnPolicy

from .support import Workers, eventually, pid_alive

SLEEP = "import time; time.sleep(60)"


async def test_all_workers_exit_zero_and_the_group_succeeds(workers: Workers) -> None:
    """wait() reports success once every worker has exited 0, with a pid and start time each."""
    async with asyncio.timeout(20):
        group = await workers.start(*(workers.launch(rank, "print('hello')") for rank in range(3)))
        async with group:
            result = await group.wait()
        assert result.succeeded
        assert sorted(result.exits) == [0, 1, 2]
        assert result.failures == []
        assert result.root_cause is None
        for rank, exit_ in result.exits.items():
            assert exit_.exit_code == 0
            assert exit_.signal is None
            assert not exit_.failed
            assert exit_.pid == group.pids[rank]
            assert group.started_at[rank] <= exit_.exited_at
        assert group.closed


async def test_wait_returns_at_the_first_failure_and_leaves_the_others_running(
    workers: Workers,
) -> None:
    """A failed worker ends wait() at once; the still-running worker is not touched."""
    async with asyncio.timeout(20):
        group = await workers.start(
            workers.launch(0, "import sys; sys.exit(3)"), workers.launch(1, SLEEP)
        )
        result = await group.wait()
        assert not result.succeeded
        assert list(result.exits) == [0]
        assert result.exits[0].exit_code == 3
        assert result.root_cause is result.exits[0]
        assert pid_alive(group.pids[1])
        final = await group.stop(5.0)
        assert final.exits[1].stopped
        assert final.root_cause == result.exits[0]


async def test_exit_codes_and_killing_signals_are_reported(workers: Workers) -> None:
    """A worker killed by a signal has no exit code and names the signal; others keep their code."""
    segfault = """
        import os, resource, signal
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        os.kill(os.getpid(), signal.SIGSEGV)
    """
    ready = "import time; print('ready'); time.sleep(60)"
    async with asyncio.timeout(20):
        group = await workers.start(
            workers.launch(0, segfault), workers.launch(1, ready), workers.launch(2, "exit(7)")
        )
        async with group:
            await workers.output.line_starting(1, b"ready")
            os.kill(group.pids[1], signal.SIGKILL)
            await eventually(lambda: len(group.snapshot().exits) == 3)
            exits = group.snapshot().exits
        assert (exits[0].exit_code, exits[0].signal) == (None, signal.SIGSEGV)
        assert (exits[1].exit_code, exits[1].signal) == (None, signal.SIGKILL)
        assert (exits[2].exit_code, exits[2].signal) == (7, None)
        assert all(exit_.failed and not exit_.stopped for exit_ in exits.values())
        assert "killed by SIGKILL" in exits[1].describe()


async def test_on_exit_is_called_once_per_exit_before_wait_returns(workers: Workers) -> None:
    """The on_exit callback sees every exit, each once, by the time wait() reports the outcome."""
    async with asyncio.timeout(20):
        group = await workers.start(*(workers.launch(rank, "pass") for rank in range(2)))
        async with group:
            result = await group.wait()
            assert sorted(exit_.local_rank for exit_ in workers.exits) == [0, 1]
            assert {exit_.local_rank: exit_ for exit_ in workers.exits} == result.exits


async def test_a_failed_worker_error_file_is_read(workers: Workers) -> None:
    """The error file a failed worker wrote at TORCHELASTIC_ERROR_FILE is attached to its exit."""
    code = """
        import json, os, sys
        extra = {"py_callstack": "Traceback: cheese", "timestamp": "1700000000"}
        data = {"message": {"message": "RuntimeError: out of cheese", "extraInfo": extra}}
        with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
            json.dump(data, f)
        sys.exit(1)
    """
    async with asyncio.timeout(20):
        group = await workers.start(workers.launch(0, code))
        async with group:
            result = await group.wait()
        error = result.exits[0].error
        assert error == WorkerError(
            message="RuntimeError: out of cheese",
            traceback="Traceback: cheese",
            timestamp=1_700_000_000.0,
            raw=json.loads((workers.log_dir(0) / "error.json").read_text()),
        )
        assert "out of cheese" in result.exits[0].describe()


async def test_an_error_file_left_from_an_earlier_run_is_not_reported(workers: Workers) -> None:
    """An error file from before the worker started is removed, so it is never misattributed."""
    stale = workers.log_dir(0) / "error.json"
    stale.parent.mkdir(parents=True)
    stale.write_text('{"message": "from the previous attempt"}')
    async with asyncio.timeout(20):
        group = await workers.start(workers.launch(0, "exit(1)"))
        async with group:
            result = await group.wait()
        assert result.exits[0].exit_code == 1
        assert result.exits[0].error is None


async def test_root_cause_is_the_earliest_error_file_timestamp_not_the_first_exit(
    workers: Workers, tmp_path: Path
) -> None:
    """The worker whose error file is oldest is the root cause even if it exited last."""
    go = tmp_path / "go"
    template = """
        import json, os, sys, time
        while not os.path.exists({go!r}):
            time.sleep(0.01)
        with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
            body = {{"message": "rank {rank}", "extraInfo": {{"timestamp": "{ts}"}}}}
            json.dump({{"message": body}}, f)
        sys.exit(1)
    """
    first = template.format(go="/", rank=0, ts=1_700_000_100)  # "/" exists: exits at once
    later = template.format(go=str(go), rank=1, ts=1_700_000_050)
    async with asyncio.timeout(20):
        group = await workers.start(workers.launch(0, first), workers.launch(1, later))
        async with group:
            early = await group.wait()
            assert early.root_cause is not None
            assert early.root_cause.local_rank == 0
            go.touch()
            await eventually(lambda: len(group.snapshot().exits) == 2)
            both = group.snapshot()
        assert both.root_cause is not None
        assert both.root_cause.local_rank == 1
        assert both.root_cause.failed_at == 1_700_000_050.0


@pytest.mark.parametrize("case", ["missing entrypoint", "not executable", "missing cwd"])
async def test_a_spawn_failure_raises_and_leaves_no_process(
    workers: Workers, tmp_path: Path, case: str
) -> None:
    """A worker that cannot start raises WorkerSpawnError naming it; started ones are gone."""
    (tmp_path / "not-executable.sh").write_text("#!/bin/sh\nexit 0\n")
    marker = f"elasticd-spawn-test-{os.getpid()}-{case.replace(' ', '-')}"
    good = workers.launch(0, f"import time; time.sleep(60)  # {marker}")
    entry = {
        "missing entrypoint": "elasticd-test-no-such-program",
        "not executable": str(tmp_path / "not-executable.sh"),
        "missing cwd": sys.executable,
    }[case]
    cwd = str(tmp_path / "no-such-dir") if case == "missing cwd" else None
    bad = workers.launch(1, "", argv=[entry, "-c", "pass"], cwd=cwd)
    async with asyncio.timeout(20):
        with pytest.raises(WorkerSpawnError, match="local rank 1") as caught:
            await WorkerGroupProcesses.start([good, bad])
    assert repr(entry) in str(caught.value)
    assert isinstance(caught.value.__cause__, OSError) or case == "missing entrypoint"
    assert _processes_with(marker) == []


async def test_launches_are_checked_before_anything_starts(workers: Workers) -> None:
    """Duplicate local ranks, an empty argv or no launch at all are refused up front."""
    with pytest.raises(ValueError, match="unique"):
        await WorkerGroupProcesses.start([workers.launch(0, "pass"), workers.launch(0, "pass")])
    with pytest.raises(ValueError, match="argv"):
        await WorkerGroupProcesses.start([workers.launch(0, "", argv=[])])
    with pytest.raises(ValueError, match="at least one"):
        await WorkerGroupProcesses.start([])


async def test_a_cancelled_start_leaves_no_process(workers: Workers) -> None:
    """Cancelling start() after the first worker spawned stops that worker before re-raising."""
    marker = f"elasticd-cancel-test-{os.getpid()}"
    launches = [workers.launch(rank, f"{SLEEP}  # {marker}") for rank in range(3)]
    starting: asyncio.Task[WorkerGroupProcesses] | None = None

    class CancelOnFirstSpawn(FakeClock):
        def time(self) -> float:  # read once per spawned worker, for started_at
            assert starting is not None
            starting.cancel()
            return super().time()

    async with asyncio.timeout(20):
        starting = asyncio.create_task(
            WorkerGroupProcesses.start(launches, clock=CancelOnFirstSpawn())
        )
        with pytest.raises(asyncio.CancelledError):
            await starting
    assert _processes_with(marker) == []


async def test_times_come_from_the_injected_clock(workers: Workers) -> None:
    """Start and exit times are read from the clock the group was given."""
    clock = FakeClock()
    async with asyncio.timeout(20):
        group = await WorkerGroupProcesses.start([workers.launch(0, "pass")], clock=clock)
        async with group:
            result = await group.wait()
    assert group.started_at[0] == result.exits[0].exited_at == clock.time()


def _exit(
    rank: int, failed_at: float | None, exited_at: float, *, stopped: bool = False
) -> WorkerExit:
    error = None
    if failed_at is not None:
        error = WorkerError(message=f"rank {rank}", traceback=None, timestamp=failed_at, raw={})
    return WorkerExit(
        local_rank=rank,
        pid=1000 + rank,
        exit_code=1,
        signal=None,
        exited_at=exited_at,
        error=error,
        stopped=stopped,
    )


def _result(*exits: WorkerExit) -> GroupResult:
    return GroupResult(
        succeeded=False, exits={exit_.local_rank: exit_ for exit_ in exits}, failures=list(exits)
    )


def test_root_cause_orders_by_error_timestamp_then_exit_time() -> None:
    """An error-file timestamp orders a failure; without one, the exit time does."""
    by_file = _exit(1, 150.0, 300.0)
    assert _result(_exit(0, 200.0, 100.0), by_file).root_cause == by_file
    by_exit = _exit(0, None, 120.0)
    assert _result(by_exit, _exit(1, 130.0, 110.0)).root_cause == by_exit


def test_root_cause_ignores_exits_caused_by_stop() -> None:
    """Workers ended by stop() are consequences; with only those, there is no root cause."""
    cause = _exit(1, None, 200.0)
    assert _result(_exit(0, None, 100.0, stopped=True), cause).root_cause == cause
    assert _result(_exit(0, None, 100.0, stopped=True)).root_cause is None
    assert _result().root_cause is None


def _processes_with(marker: str) -> list[int]:
    """Pids of live processes whose command line contains `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if marker.encode() in cmdline and pid_alive(int(entry.name)):
            found.append(int(entry.name))
    return found


READ_STDIN = """
import os, sys
print("stdin", os.readlink("/proc/self/fd/0"), repr(sys.stdin.read()))
print("fds", sorted(int(fd) for fd in os.listdir("/proc/self/fd")))
"""


async def test_workers_read_dev_null_unless_the_policy_passes_a_stdin(
    workers: Workers, tmp_path: Path
) -> None:
    """By default a worker's stdin is /dev/null; with ``worker_stdin`` (elasticd run's stdin)
    every worker reads that descriptor as its stdin, and the copy under its own number is closed."""
    async with asyncio.timeout(20):
        group = await workers.start(workers.launch(0, READ_STDIN))
        assert (await group.wait()).succeeded
        line = await workers.output.line_starting(0, b"stdin ")
        assert line.strip() == b"stdin /dev/null ''"
        plain_fds = (await workers.output.line_starting(0, b"fds ")).strip()

        read_end, write_end = os.pipe()
        os.write(write_end, b"hi\n")
        os.close(write_end)
        try:
            policy = SpawnPolicy(worker_stdin=read_end)
            other = Workers(tmp_path / "with-stdin")
            group = await WorkerGroupProcesses.start(
                [other.launch(0, READ_STDIN)], on_output=other.output, policy=policy
            )
            async with group:
                assert (await group.wait()).succeeded
        finally:
            os.close(read_end)
        line = (await other.output.line_starting(0, b"stdin ")).strip()
        assert line.startswith(b"stdin pipe:") and line.endswith(b"'hi\\n'")
        # the same descriptors as a worker without it: the copy was closed after the move to 0
        assert (await other.output.line_starting(0, b"fds ")).strip() == plain_fds
