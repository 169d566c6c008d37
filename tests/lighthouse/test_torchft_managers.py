"""Stock torchft Managers (torchft 0.2.0, CPU, gloo) on elasticd's Lighthouse: a killed group
leaves the others committing with a smaller quorum and rejoins healed; the loss of the
leader's node costs the other groups one bounded stall and no quorum of one."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from elasticd.lighthouse.rules import Settings
from elasticd.lighthouse.server import Lighthouse
from elasticd.testing import MemoryStore

pytest.importorskip("torchft")
pytest.importorskip("grpc")
pytestmark = [pytest.mark.slow, pytest.mark.torch, pytest.mark.timeout(240)]

WORKER = Path(__file__).with_name("torchft_worker.py")
SETTINGS = Settings(min_replicas=2, join_timeout=1.0, heartbeat_timeout=1.0)
LEASE_TTL = 2.0


class Group:
    """One replica group's worker process and the steps it printed."""

    def __init__(self, group: int, lighthouse: str, tmp: Path) -> None:
        self.group, self.lighthouse, self.tmp = group, lighthouse, tmp
        self.lines: list[dict[str, Any]] = []
        self.proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None
        self.starts = 0

    async def start(self) -> None:
        self.starts += 1
        env = {**os.environ, "TORCHFT_LIGHTHOUSE": self.lighthouse, "PYTHONUNBUFFERED": "1"}
        err = (self.tmp / f"group{self.group}.{self.starts}.err").open("wb")
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(WORKER),
            "--group",
            str(self.group),
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=err,
        )
        err.close()
        self._reader = asyncio.create_task(self._read(self.proc))

    async def _read(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        async for raw in proc.stdout:
            with contextlib.suppress(ValueError):
                self.lines.append(json.loads(raw))

    async def kill(self) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGKILL)
        await self.proc.wait()
        if self._reader is not None:
            # A child of the worker may still hold its stdout: read on for a moment only.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._reader), 5.0)
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader

    def stderr(self) -> str:
        return "\n".join(
            f"-- group {self.group} start {i}:\n"
            + (self.tmp / f"group{self.group}.{i}.err").read_text(errors="replace")[-3000:]
            for i in range(1, self.starts + 1)
        )


async def until(check: Callable[[], bool], seconds: float, groups: list[Group], what: str) -> None:
    try:
        async with asyncio.timeout(seconds):
            while not check():
                await asyncio.sleep(0.05)
    except TimeoutError:
        tails = "\n".join(g.stderr() for g in groups)
        pytest.fail(f"{what} did not happen within {seconds} s\n{tails}")


def committed(group: Group, since: int = 0, **match: int) -> list[dict[str, Any]]:
    return [line for line in group.lines[since:] if all(line[k] == v for k, v in match.items())]


async def start_together(groups: list[Group]) -> None:
    """Start every group; return once each committed five steps in a quorum of all."""
    for g in groups:
        await g.start()
    await until(
        lambda: all(len(committed(g, participants=len(groups))) >= 5 for g in groups),
        120,
        groups,
        "every group committing together",
    )


class LeasedNode:
    """A daemon's share: its node lease, kept alive until it dies, and its Lighthouse."""

    def __init__(self, store: MemoryStore, name: str) -> None:
        self.store, self.name = store, name
        self.lease = 0
        self.lighthouse: Lighthouse | None = None
        self._keeper: asyncio.Task[None] | None = None

    async def start(self, job: str) -> str:
        self.lease = await self.store.grant(LEASE_TTL)
        self._keeper = asyncio.create_task(self._keep())

        async def lease() -> int:
            return self.lease

        self.lighthouse = Lighthouse(self.store, self.name, lease)
        return await self.lighthouse.serve(job, uid=os.getuid(), settings=SETTINGS)

    async def _keep(self) -> None:
        while True:
            await asyncio.sleep(LEASE_TTL / 4)
            with contextlib.suppress(Exception):
                await self.store.keep_alive(self.lease)

    async def die(self) -> None:
        """kill -9 of the daemon: nothing is cleaned up; its lease lapses after its TTL."""
        if self._keeper is not None:
            self._keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keeper
            self._keeper = None
        if self.lighthouse is not None:
            await self.lighthouse.aclose(leave=False)


@pytest.fixture
async def store() -> AsyncIterator[MemoryStore]:
    async with MemoryStore() as s:
        yield s


async def test_a_killed_group_leaves_the_others_committing_and_rejoins_healed(
    store: MemoryStore, tmp_path: Path
) -> None:
    """3 groups; kill -9 one: the other two commit with a quorum of 2 (the id rises);
    restart it: it rejoins the quorum of 3 and its weights equal its peers'."""
    node = LeasedNode(store, "n1")
    address = await node.start("job1")
    groups = [Group(g, address, tmp_path) for g in range(3)]
    try:
        await start_together(groups)
        before = max(line["quorum"] for g in groups for line in g.lines)
        await groups[2].kill()
        mark = [len(g.lines) for g in groups]
        await until(
            lambda: all(
                len([ln for ln in committed(g, mark[i], participants=2) if ln["quorum"] > before])
                >= 5
                for i, g in enumerate(groups[:2])
            ),
            60,
            groups,
            "the two survivors committing with a quorum of 2",
        )
        assert all(ln["participants"] >= 2 for g in groups for ln in g.lines)
        survivors_pids = [g.proc.pid for g in groups[:2] if g.proc is not None]
        groups[2].lines.clear()
        await groups[2].start()
        await until(
            lambda: len(committed(groups[2], participants=3)) >= 3,
            120,
            groups,
            "the restarted group committing in a quorum of 3",
        )
        # Its weights at a step equal its peers' at that step: it healed from them.
        await until(
            lambda: any(
                ln["step"] in {x["step"] for x in groups[0].lines} for ln in groups[2].lines
            ),
            30,
            groups,
            "a step committed by both",
        )
        theirs = {ln["step"]: ln["weights"] for ln in groups[0].lines}
        common = [ln for ln in groups[2].lines if ln["step"] in theirs]
        assert common and all(ln["weights"] == theirs[ln["step"]] for ln in common)
        assert [g.proc.pid for g in groups[:2] if g.proc is not None] == survivors_pids
        assert all(g.proc is not None and g.proc.returncode is None for g in groups)
    finally:
        for g in groups:
            if g.proc is not None:
                await g.kill()
        await node.die()


async def test_the_loss_of_the_leaders_node_costs_one_bounded_stall(
    store: MemoryStore, tmp_path: Path
) -> None:
    """Two daemons' Lighthouses over one store; group 0 talks to the leader's, groups 1 and 2
    to the other's. The leader's node dies (its Lighthouse stops, its lease lapses, its group
    is killed): groups 1 and 2 commit again within lease TTL + heartbeat timeout (+ the
    steps' own slack), with quorum ids rising and never a quorum of one."""
    n1, n2 = LeasedNode(store, "n1"), LeasedNode(store, "n2")
    a1 = await n1.start("job1")
    a2 = await n2.start("job1")
    assert n1.lighthouse is not None and n2.lighthouse is not None
    q1, q2 = n1.lighthouse.quorum("job1"), n2.lighthouse.quorum("job1")
    assert q1 is not None and q2 is not None
    groups = [Group(0, a1, tmp_path), Group(1, a2, tmp_path), Group(2, a2, tmp_path)]
    try:
        await start_together(groups)
        assert q1.leading and not q2.leading
        before = max(line["quorum"] for g in groups for line in g.lines)
        mark = [len(g.lines) for g in groups]
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await n1.die()
        await groups[0].kill()
        await until(
            lambda: all(
                any(ln["quorum"] > before for ln in committed(g, mark[i]))
                for i, g in enumerate(groups[1:], start=1)
            ),
            60,
            groups,
            "the survivors committing again",
        )
        stall = loop.time() - t0
        assert q2.leading
        # lease TTL + heartbeat timeout, plus a join timeout and a few steps of slack
        assert stall < LEASE_TTL + SETTINGS.heartbeat_timeout + SETTINGS.join_timeout + 4.0, stall
        quorums = [ln["quorum"] for g in groups[1:] for ln in g.lines]
        for g in groups[1:]:
            ids = [ln["quorum"] for ln in g.lines]
            assert ids == sorted(ids)  # never back
        assert all(ln["participants"] >= 2 for g in groups for ln in g.lines), quorums
    finally:
        for g in groups:
            if g.proc is not None:
                await g.kill()
        await n2.die()
        if n2.lighthouse is not None:
            await n2.lighthouse.aclose()


async def test_a_reexec_of_the_daemon_costs_no_group_a_restart(
    store: MemoryStore, tmp_path: Path
) -> None:
    """The daemon re-executes: its Lighthouse closes without leaving (record and leadership
    stay on the node's lease) and is served again on the same port a second later. Every
    group goes on in a quorum of 3 with its pid, and no quorum below it was ever seen."""
    node = LeasedNode(store, "n1")
    address = await node.start("job1")
    groups = [Group(g, address, tmp_path) for g in range(3)]
    try:
        await start_together(groups)
        pids = [g.proc.pid for g in groups if g.proc is not None]
        assert node.lighthouse is not None
        await node.lighthouse.close("job1", leave=False)
        mark = [len(g.lines) for g in groups]
        await asyncio.sleep(1.0)
        port = int(address.rsplit(":", 1)[1])
        again = await node.lighthouse.serve("job1", uid=os.getuid(), settings=SETTINGS, port=port)
        assert again == address
        await until(
            lambda: all(
                len(committed(g, mark[i], participants=3)) >= 5 for i, g in enumerate(groups)
            ),
            60,
            groups,
            "every group committing again after the re-exec",
        )
        assert [g.proc.pid for g in groups if g.proc is not None] == pids
        assert all(g.proc is not None and g.proc.returncode is None for g in groups)
        assert all(
            ln["participants"] == 3 for i, g in enumerate(groups) for ln in g.lines[mark[i] :]
        )
    finally:
        for g in groups:
            if g.proc is not None:
                await g.kill()
        await node.die()
