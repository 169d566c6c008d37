"""Helpers for the in-process restart tests: a group of real rank processes and their output.

Each rank is a real Python process with ``RANK``/``WORLD_SIZE`` and the
daemon's variables (``ELASTICD_URL`` pointing at a real store server from
:func:`tests.worker_lib.support.store_server`). Their stdout and stderr lines
are collected as they come, so a test can wait for a line instead of sleeping.
"""

from __future__ import annotations

import asyncio
import sys
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass, field

from tests.worker_lib.support import child_env, pid_alive


@dataclass
class Rank:
    """One rank process and everything it printed."""

    rank: int
    proc: asyncio.subprocess.Process
    out: list[str] = field(default_factory=list)
    err: list[str] = field(default_factory=list)

    def lines(self, prefix: str, stream: str = "out") -> list[str]:
        return [
            line for line in (self.out if stream == "out" else self.err) if line.startswith(prefix)
        ]

    def fields(self, prefix: str) -> list[dict[str, str]]:
        """The ``key=value`` fields of every stdout line starting with ``prefix``."""
        return [
            dict(part.split("=", 1) for part in line.split()[1:] if "=" in part)
            for line in self.lines(prefix)
        ]


class RankGroup:
    """Start ``world_size`` ranks of one script; collect output; wait for lines and exits."""

    def __init__(
        self, url: str, job: str, world_size: int, env: Mapping[str, str] | None = None
    ) -> None:
        self.url = url
        self.job = job
        self.world_size = world_size
        self.env = dict(env or {})
        self.ranks: list[Rank] = []
        self._readers: list[asyncio.Task[None]] = []
        self._changed = asyncio.Event()

    def rank_env(self, rank: int) -> dict[str, str]:
        return child_env(
            {
                "ELASTICD_URL": self.url,
                "ELASTICD_JOB_ID": self.job,
                "TORCHELASTIC_RESTART_COUNT": "0",
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(self.world_size),
                "PYTHONWARNINGS": "ignore",
                **self.env,
            }
        )

    async def start(self, code: str | None = None, script: str | None = None) -> None:
        argv = ["-c", textwrap.dedent(code)] if code is not None else [str(script)]
        for r in range(self.world_size):
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                *argv,
                env=self.rank_env(r),
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            rank = Rank(r, proc)
            self.ranks.append(rank)
            assert proc.stdout is not None and proc.stderr is not None
            self._readers.append(asyncio.create_task(self._read(proc.stdout, rank.out)))
            self._readers.append(asyncio.create_task(self._read(proc.stderr, rank.err)))

    async def _read(self, stream: asyncio.StreamReader, into: list[str]) -> None:
        while line := await stream.readline():
            into.append(line.decode(errors="replace").rstrip("\n"))
            self._changed.set()

    async def line(self, rank: int, prefix: str, stream: str = "out") -> str:
        """Wait until ``rank`` printed a line starting with ``prefix``; return it."""
        while True:
            found = self.ranks[rank].lines(prefix, stream)
            if found:
                return found[0]
            if self.ranks[rank].proc.returncode is not None and all(
                t.done() for t in self._readers
            ):
                raise AssertionError(
                    f"rank {rank} exited without printing {prefix!r}:\n{self.dump()}"
                )
            self._changed.clear()
            try:
                async with asyncio.timeout(0.5):  # also notice an exit
                    await self._changed.wait()
            except TimeoutError:
                pass

    async def wait(self) -> list[int | None]:
        """Wait for every rank to exit and its output to be read; the exit codes."""
        codes = [await r.proc.wait() for r in self.ranks]
        await asyncio.gather(*self._readers)
        return codes

    async def close(self) -> None:
        """Kill what still runs and reap it."""
        for r in self.ranks:
            if r.proc.returncode is None and pid_alive(r.proc.pid):
                try:
                    r.proc.kill()
                except ProcessLookupError:
                    pass
        for r in self.ranks:
            await r.proc.wait()
        for task in self._readers:
            task.cancel()
        await asyncio.gather(*self._readers, return_exceptions=True)

    def dump(self) -> str:
        """Everything the ranks printed, for assertion messages."""
        parts = []
        for r in self.ranks:
            parts.append(
                f"--- rank {r.rank} (exit {r.proc.returncode}) stdout:\n" + "\n".join(r.out)
            )
            parts.append(f"--- rank {r.rank} stderr:\n" + "\n".join(r.err[-40:]))
        return "\n".join(parts)
