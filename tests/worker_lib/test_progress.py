"""The daemon's progress monitor: the pure deadline decision, real hung workers, stack dumps."""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import time
from pathlib import Path

import pytest

from elasticd.agent.progress import (
    Beat,
    Hang,
    ProgressMonitor,
    ProgressSettings,
    catches_signal,
    dump_stacks,
    next_deadline,
)
from elasticd.clock import FakeClock
from elasticd.worker.heartbeat import ENV_VAR

from .support import child_env, finish, read_line, spawn

# -- the pure decision ---------------------------------------------------------------

BOTH = ProgressSettings(progress_timeout=10.0, startup_timeout=30.0)


def test_no_rule_means_no_deadline() -> None:
    """With both timeouts off, nothing is ever due."""
    beats = [
        Beat(0, started_at=0.0, last_ping=None),
        Beat(1, started_at=0.0, last_ping=5.0, count=1),
    ]
    assert next_deadline(beats, 1e9, ProgressSettings()) == (None, None)


def test_the_earliest_deadline_comes_from_the_latest_pings() -> None:
    """The next wake-up is the earliest of last ping + progress_timeout and start + startup_timeout."""
    clock = FakeClock(start=100.0)
    beats = [
        Beat(0, started_at=90.0, last_ping=95.0, count=3),  # due 105
        Beat(1, started_at=90.0, last_ping=None),  # due 120
        Beat(2, started_at=90.0, last_ping=99.0, count=1),  # due 109
    ]
    assert next_deadline(beats, clock.monotonic(), BOTH) == (105.0, None)
    clock.advance(4.9)
    assert next_deadline(beats, clock.monotonic(), BOTH) == (105.0, None)


def test_a_missed_deadline_is_a_hang_naming_the_rank_and_silence() -> None:
    """At the deadline, the most overdue worker is reported with its silent time."""
    beats = [
        Beat(0, started_at=0.0, last_ping=95.0, count=3),  # due 105
        Beat(1, started_at=0.0, last_ping=93.0, count=2),  # due 103: most overdue
    ]
    deadline, hang = next_deadline(beats, 106.0, BOTH)
    assert deadline is None
    assert hang == Hang(local_rank=1, silent_for=13.0, never_pinged=False, deadline=103.0)
    assert "local rank 1" in hang.describe() and "13.0 s" in hang.describe()


def test_a_worker_that_never_pings_is_judged_by_startup_timeout_only() -> None:
    """Before its first ping a worker has start + startup_timeout; without that rule, no deadline."""
    beats = [Beat(3, started_at=50.0, last_ping=None)]
    _, hang = next_deadline(beats, 80.0, BOTH)
    assert (
        hang is not None and hang.never_pinged and hang.local_rank == 3 and hang.silent_for == 30.0
    )
    assert next_deadline(beats, 1e6, ProgressSettings(progress_timeout=1.0)) == (None, None)


def test_ties_go_to_the_lowest_local_rank() -> None:
    """Two workers due at the same instant: the lower local rank is reported."""
    beats = [Beat(2, 0.0, 1.0, 1), Beat(1, 0.0, 1.0, 1)]
    _, hang = next_deadline(beats, 20.0, BOTH)
    assert hang is not None and hang.local_rank == 1


def test_settings_refuse_non_positive_timeouts() -> None:
    """A zero or negative timeout is a configuration error, not 'always hung'."""
    with pytest.raises(ValueError, match="progress_timeout"):
        ProgressSettings(progress_timeout=0)
    with pytest.raises(ValueError, match="startup_timeout"):
        ProgressSettings(startup_timeout=-1)


# -- the monitor with real workers ----------------------------------------------------

PING_THEN_BLOCK = """
    import threading
    from elasticd.worker import ping
    for _ in range(5):
        ping()
    print("pinged", flush=True)
    threading.Event().wait()
"""

NEVER_PINGS = """
    import threading
    print("up", flush=True)
    threading.Event().wait()
"""

KEEPS_PINGING = """
    import time
    from elasticd.worker import ping
    print("up", flush=True)
    while True:
        ping()
        time.sleep(0.05)
"""


async def _monitored(
    tmp_path: Path, code: str, settings: ProgressSettings
) -> tuple[ProgressMonitor, asyncio.subprocess.Process]:
    monitor = ProgressMonitor({0: tmp_path / "0" / "heartbeat"}, settings)
    monitor.prepare()
    proc = await spawn(code, child_env({ENV_VAR: str(monitor.files[0]), "ELASTICD_JOB_ID": "j"}))
    monitor.started(0)
    return monitor, proc


async def test_a_worker_that_pings_then_blocks_is_caught_at_its_deadline(tmp_path: Path) -> None:
    """A real worker that pings and then blocks forever is declared hung within progress_timeout + 0.5 s."""
    timeout = 0.6
    monitor, proc = await _monitored(
        tmp_path, PING_THEN_BLOCK, ProgressSettings(progress_timeout=timeout)
    )
    try:
        async with asyncio.timeout(30):
            await read_line(proc, b"pinged")
            pinged_at = monitor.beat(0)
            assert (
                pinged_at is not None and pinged_at.last_ping is not None and pinged_at.count == 5
            )
            assert monitor.last_progress_at(0) == pytest.approx(
                time.time() - (time.monotonic() - pinged_at.last_ping), abs=0.05
            )
            hang = await monitor.wait_for_hang()
            late = time.monotonic() - (pinged_at.last_ping + timeout)
    finally:
        await finish(proc)
    assert hang.local_rank == 0 and not hang.never_pinged
    assert timeout <= hang.silent_for < timeout + 0.5
    assert 0 <= late < 0.5, f"detected {late:.3f} s after the deadline"


async def test_a_worker_that_never_pings_is_caught_by_startup_timeout(tmp_path: Path) -> None:
    """A worker that never pings is declared hung once startup_timeout has passed since its start."""
    settings = ProgressSettings(progress_timeout=0.3, startup_timeout=0.8)
    monitor, proc = await _monitored(tmp_path, NEVER_PINGS, settings)
    started = time.monotonic()
    try:
        async with asyncio.timeout(30):
            hang = await monitor.wait_for_hang()
    finally:
        await finish(proc)
    assert hang.never_pinged and hang.local_rank == 0
    assert 0.8 <= time.monotonic() - started < 1.5
    assert monitor.last_progress_at(0) is None


async def test_a_worker_that_keeps_pinging_is_never_hung(tmp_path: Path) -> None:
    """A worker pinging every 50 ms is not declared hung over many progress_timeouts."""
    monitor, proc = await _monitored(
        tmp_path, KEEPS_PINGING, ProgressSettings(progress_timeout=0.3, startup_timeout=5)
    )
    try:
        async with asyncio.timeout(30):
            await read_line(proc, b"up")
            waiter = asyncio.ensure_future(monitor.wait_for_hang())
            done, _ = await asyncio.wait({waiter}, timeout=1.5)
            assert not done, "a pinging worker was declared hung"
            proc.send_signal(signal.SIGSTOP)  # now it stops pinging: the same waiter catches it
            hang = await waiter
    finally:
        proc.send_signal(signal.SIGCONT)
        await finish(proc)
    assert hang.local_rank == 0 and not hang.never_pinged


async def test_a_finished_worker_is_no_longer_watched(tmp_path: Path) -> None:
    """finished() wakes the waiter; with every worker finished nothing can hang; on_check sees reads."""
    checks: list[list[Beat]] = []
    monitor = ProgressMonitor(
        {0: tmp_path / "hb0", 1: tmp_path / "hb1"},
        ProgressSettings(startup_timeout=0.5),
        on_check=checks.append,
    )
    monitor.prepare()
    monitor.started()
    monitor.finished(0)
    monitor.finished(1)
    waiter = asyncio.ensure_future(monitor.wait_for_hang())
    async with asyncio.timeout(10):
        done, _ = await asyncio.wait({waiter}, timeout=1.0)
    assert not done
    monitor.started(1)  # a restarted worker is watched again, from now
    async with asyncio.timeout(10):
        hang = await waiter
    assert hang.local_rank == 1 and hang.never_pinged
    assert checks[0] == [] and [b.local_rank for b in checks[-1]] == [1]  # on_check saw each read


# -- stack dumps -------------------------------------------------------------------------

STUCK_IN_FUNCTION = """
    import threading
    import elasticd.worker

    def stuck_in_allreduce():
        print("ready", flush=True)
        threading.Event().wait()

    stuck_in_allreduce()
"""


async def test_sigusr1_dumps_the_stacks_into_stderr_and_keeps_the_worker(tmp_path: Path) -> None:
    """Without py-spy, SIGUSR1 makes faulthandler write the stacks to stderr, and the worker lives on."""
    proc = await spawn(STUCK_IN_FUNCTION, child_env({"ELASTICD_JOB_ID": "j"}))
    try:
        async with asyncio.timeout(30):
            await read_line(proc, b"ready")
            assert catches_signal(proc.pid, signal.SIGUSR1)
            dump = await dump_stacks(proc.pid, use_py_spy=False)
            assert dump.to_stderr and "SIGUSR1" in dump.text and "stderr" in dump.text
            assert proc.stderr is not None
            for _ in range(2):  # the worker survives a dump and answers the next one
                text = b""
                while b"stuck_in_allreduce" not in text:
                    text += await proc.stderr.readline()
                assert b"most recent call first" in text
                await asyncio.sleep(0.2)
                assert proc.returncode is None and catches_signal(proc.pid, signal.SIGUSR1)
                await dump_stacks(proc.pid, use_py_spy=False)
    finally:
        await finish(proc)


async def test_a_worker_without_the_library_is_not_sent_a_deadly_signal() -> None:
    """SIGUSR1 would kill a process that does not catch it, so none is sent."""
    proc = await spawn(NEVER_PINGS, child_env())
    try:
        async with asyncio.timeout(30):
            await read_line(proc, b"up")
            dump = await dump_stacks(proc.pid, use_py_spy=False)
            await asyncio.sleep(0.2)
            assert proc.returncode is None
    finally:
        await finish(proc)
    # The note names the signal it did not send: that must not read as "sent".
    assert not dump.to_stderr and "no stacks" in dump.text and "would kill" in dump.text


def _fake_py_spy(tmp_path: Path, body: str) -> str:
    path = tmp_path / "py-spy"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


async def test_py_spy_output_is_returned_when_it_works(tmp_path: Path) -> None:
    """With py-spy available, its dump output is the result."""
    exe = _fake_py_spy(
        tmp_path, 'echo "Thread 1 (idle): MainThread"; echo "    train (train.py:12) pid $3"'
    )
    async with asyncio.timeout(10):
        dump = await dump_stacks(os.getpid(), py_spy=exe)
    assert "train (train.py:12)" in dump.text and str(os.getpid()) in dump.text
    assert not dump.to_stderr


async def test_a_failing_or_stuck_py_spy_falls_back_to_the_signal(tmp_path: Path) -> None:
    """py-spy refused (ptrace) or hanging: the note says so and the signal path is taken."""
    refused = _fake_py_spy(tmp_path, 'echo "Permission denied (os error 1)"; exit 1')
    stuck = tmp_path / "stuck"
    stuck.mkdir()
    slow = _fake_py_spy(stuck, "sleep 30")
    proc = await spawn(STUCK_IN_FUNCTION, child_env({"ELASTICD_JOB_ID": "j"}))
    try:
        async with asyncio.timeout(30):
            await read_line(proc, b"ready")
            dump = await dump_stacks(proc.pid, py_spy=refused)
            assert dump.text.startswith("py-spy failed (Permission denied") and dump.to_stderr
            started = time.monotonic()
            dump = await dump_stacks(proc.pid, py_spy=slow, timeout=0.5)
            assert time.monotonic() - started < 5
            assert "did not finish within 0.5 s" in dump.text and "sent SIGUSR1" in dump.text
    finally:
        await finish(proc)


# -- progress_timeout "auto" and checkpoint_timeout (pure) ------------------------------


def test_auto_timeout_warms_up_then_sizes_from_the_high_percentile() -> None:
    """Before the warm-up: the generous bound; then 4x the 95th percentile, floored at 10 s."""
    from elasticd.agent.progress import (
        AUTO_FLOOR_S,
        AUTO_MULTIPLIER,
        AUTO_WARMUP_SAMPLES,
        AUTO_WARMUP_TIMEOUT_S,
        auto_timeout,
    )

    assert auto_timeout([0.1] * (AUTO_WARMUP_SAMPLES - 1)) == AUTO_WARMUP_TIMEOUT_S
    assert auto_timeout([0.1] * AUTO_WARMUP_SAMPLES) == AUTO_FLOOR_S
    samples = [4.0] * 95 + [5.0] * 4 + [100.0]  # the 95th percentile is 4 s; outliers above
    assert auto_timeout(samples) == AUTO_MULTIPLIER * 4.0 == 16.0
    assert auto_timeout([5.0] * 20) == 20.0
    assert auto_timeout([1e9] * 20) == 86_400.0


@pytest.mark.parametrize(
    ("settings", "beat", "auto", "expected"),
    [
        # A checkpoint in progress without checkpoint_timeout: no deadline.
        (
            ProgressSettings(progress_timeout=1.0),
            Beat(0, 0.0, 10.0, 1, checkpointing_since=10.0),
            None,
            None,
        ),
        # ... with it: the later of the two.
        (
            ProgressSettings(progress_timeout=1.0, checkpoint_timeout=30.0),
            Beat(0, 0.0, 10.0, 1, checkpointing_since=9.0),
            None,
            (39.0, "checkpoint_timeout"),
        ),
        (
            ProgressSettings(progress_timeout=60.0, checkpoint_timeout=30.0),
            Beat(0, 0.0, 10.0, 1, checkpointing_since=9.0),
            None,
            (70.0, "progress_timeout"),
        ),
        # auto: the sized timeout, named; the warm-up bound when none is given.
        (
            ProgressSettings(auto=True),
            Beat(0, 0.0, 10.0, 1),
            12.5,
            (22.5, "progress_timeout = auto, 12.5 s"),
        ),
        (
            ProgressSettings(auto=True),
            Beat(0, 0.0, 10.0, 1),
            None,
            (610.0, "progress_timeout = auto, 600.0 s"),
        ),
        (
            ProgressSettings(auto=True, startup_timeout=5.0),
            Beat(0, 1.0, None),
            12.5,
            (6.0, "startup_timeout"),
        ),
    ],
)
def test_deadline_rules_for_checkpoints_and_auto(
    settings: ProgressSettings, beat: Beat, auto: float | None, expected: tuple[float, str] | None
) -> None:
    """Which rule sets a worker's deadline, and when."""
    from elasticd.agent.progress import deadline_of

    assert deadline_of(beat, settings, auto) == expected


def test_a_hang_names_the_rule_it_broke() -> None:
    """A stuck checkpoint is reported as checkpoint_timeout, not as a missed step."""
    settings = ProgressSettings(progress_timeout=1.0, checkpoint_timeout=5.0)
    beats = [Beat(0, 0.0, 10.0, 1, checkpointing_since=10.0)]
    assert next_deadline(beats, 12.0, settings) == (15.0, None)
    _, hang = next_deadline(beats, 15.5, settings)
    assert hang is not None and "(checkpoint_timeout)" in hang.describe()


def test_settings_of_a_spec() -> None:
    """ "auto" switches the sizing on; a number stays a fixed timeout."""
    assert ProgressSettings.of("auto").auto and ProgressSettings.of("auto").enabled
    assert ProgressSettings.of(2.0) == ProgressSettings(progress_timeout=2.0)
    assert not ProgressSettings.of(None).enabled
