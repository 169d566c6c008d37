"""Helpers for the worker-group tests: real worker processes made from tiny Python snippets.

Children are ``sys.executable -c <code>``: no torch, so they start in tens of
milliseconds. A child that must be in a known state before the test acts
(signal handler installed, grandchild started) prints a line; the test waits
for that line through the group's output sink instead of sleeping.
"""

from __future__ import annotations

import asyncio
import os
import sys
import textwrap
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest

from elasticd.supervise import WorkerExit, WorkerGroupProcesses, WorkerLaunch


def worker_folder(tmp_path: Path) -> Path:
    """A worker's own folder as the daemon lays it out: ``attempt_0/0`` (its parent the
    daemon's), for the readers of the files a worker writes."""
    rank = tmp_path / "attempt_0" / "0"
    rank.mkdir(parents=True)
    return rank


def pid_alive(pid: int) -> bool:
    """True while `pid` is a running process (a zombie counts as gone: it cannot act)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    state = stat.rsplit(")", 1)[1].split()[0]
    return state not in ("Z", "X")


async def eventually(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    """Poll `condition` until it holds; fail the test if it does not within `timeout`."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"condition not met within {timeout} s")
        await asyncio.sleep(0.01)


class Output:
    """An output sink that records every forwarded line and can wait for one."""

    def __init__(self) -> None:
        self.lines: list[tuple[int, str, bytes]] = []
        self._changed = asyncio.Event()

    def __call__(self, local_rank: int, stream: str, line: bytes) -> None:
        self.lines.append((local_rank, stream, line))
        self._changed.set()

    def of(self, local_rank: int, stream: str = "stdout") -> list[bytes]:
        return [line for rank, name, line in self.lines if rank == local_rank and name == stream]

    async def line_starting(self, local_rank: int, prefix: bytes, stream: str = "stdout") -> bytes:
        """Wait until rank `local_rank` printed a line starting with `prefix`; return it."""
        while True:
            for line in self.of(local_rank, stream):
                if line.startswith(prefix):
                    return line
            self._changed.clear()
            await self._changed.wait()


class Workers:
    """Builds launches of Python snippets under one temporary folder and starts groups."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.output = Output()
        self.exits: list[WorkerExit] = []
        self._groups: list[WorkerGroupProcesses] = []

    def log_dir(self, local_rank: int) -> Path:
        return self.root / "logs" / str(local_rank)

    def launch(
        self,
        local_rank: int,
        code: str,
        *,
        console_stdout: bool = True,
        console_stderr: bool = False,
        env: Mapping[str, str] | None = None,
        argv: list[str] | None = None,
        cwd: str | None = None,
    ) -> WorkerLaunch:
        log_dir = self.log_dir(local_rank)
        full_env = dict(os.environ)
        full_env["PYTHONUNBUFFERED"] = "1"
        full_env["TORCHELASTIC_ERROR_FILE"] = str(log_dir / "error.json")
        full_env.update(env or {})
        return WorkerLaunch(
            local_rank=local_rank,
            argv=argv if argv is not None else [sys.executable, "-c", textwrap.dedent(code)],
            env=full_env,
            cwd=cwd,
            log_dir=log_dir,
            console_stdout=console_stdout,
            console_stderr=console_stderr,
        )

    async def start(self, *launches: WorkerLaunch) -> WorkerGroupProcesses:
        group = await WorkerGroupProcesses.start(
            launches, on_output=self.output, on_exit=self.exits.append
        )
        self._groups.append(group)
        return group

    async def stop_all(self) -> None:
        for group in self._groups:
            await group.stop(0.0)
