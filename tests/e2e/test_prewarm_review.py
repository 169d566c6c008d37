"""Review of issue 27 on a real root daemon: the daemon's death or stop, an attempt's end and
a standby's own end leave no standby, and no process a standby's imports started."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import sys
from collections.abc import Collection
from pathlib import Path

import pytest

from elasticd.supervise.standby import FIRST_FILL_AFTER_S
from elasticd.supervise.sweep import process_start_time
from tests.e2e.test_prewarm import ready_standbys, submit_body
from tests.hardening.support import (
    cgroup_home,
    daemon_subtree,
    eventually,
    pid_alive,
    running_program,
    serve,
)

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="a root daemon, as deployed"),
]

#: A prewarm module that, like many (a compile server, a tokenizer pool), starts a helper.
HELPER = r"""
import os, time
pid = os.fork()
if pid == 0:
    os.setsid()
    time.sleep(600)
    os._exit(0)
with open(os.path.join(os.environ["OUT"], f"helper.{os.getpid()}"), "w") as f:
    f.write(str(pid))
"""


def _job_files(tmp_path: Path, worker: str, helper: str | None) -> tuple[Path, Path]:
    """(code, out): the worker ``w.py`` and the prewarm module ``helper_mod``, and a folder
    for what they write."""
    code, out = tmp_path / "code", tmp_path / "out"
    code.mkdir()
    out.mkdir()
    (code / "w.py").write_text(worker)
    if helper is not None:
        (code / "helper_mod.py").write_text(helper)
    return code, out


def _helpers(out: Path) -> list[int]:
    return [int(p.read_text()) for p in out.glob("helper.*")]


def _recorded(state_dir: Path, pids: Collection[int]) -> bool:
    """Whether the daemon's database names each of ``pids`` for the next daemon's sweep."""
    db = sqlite3.connect(f"file:{state_dir / 'elasticd.sqlite3'}?mode=ro", uri=True)
    try:
        return set(pids) <= {pid for (pid,) in db.execute("SELECT pid FROM workers")}
    finally:
        db.close()


@pytest.mark.parametrize("how", ["kill9", "stop"])
async def test_the_daemons_end_leaves_no_standby(tmp_path: Path, how: str) -> None:
    code, out = _job_files(tmp_path, "import time\ntime.sleep(600)\n", HELPER)
    daemon = serve(tmp_path)
    helpers: list[int] = []
    standbys: dict[int, int] = {}
    try:
        async with asyncio.timeout(90), daemon.client() as c:
            await daemon.wait_ready()
            body = submit_body(
                "d", out, entrypoint=sys.executable, args=[str(code / "w.py")],
                cwd=str(code), prewarm=["helper_mod"],
            )  # fmt: skip
            assert (await c.post("/jobs", json=body)).status_code == 201
            standbys = await ready_standbys(c, "d", 2)
            helpers = _helpers(out)
            assert len(helpers) == 2
            assert all(pid_alive(p) for p in helpers)
            if how == "kill9":
                daemon.kill9()
            else:
                daemon.stop()
            await eventually(
                lambda: not any(pid_alive(p) for p in standbys.values()), 20, "standbys"
            )
            if how == "stop":  # after a kill -9 the next daemon sweeps them (below)
                await eventually(lambda: not any(pid_alive(p) for p in helpers), 20, "helpers")
    finally:
        daemon.kill9()
        # After a kill -9 the job's worker outlives its daemon (no next daemon here).
        for pid in [*helpers, *standbys.values(), *running_program(str(code / "w.py"))]:
            if pid_alive(pid):
                os.kill(pid, 9)


#: A helper that stays in the standby's process group (no setsid): a worker's such helper is
#: swept by the next daemon (the registry names the worker's group); a standby's must be too.
GROUP_HELPER = HELPER.replace("    os.setsid()\n", "")


@pytest.mark.parametrize("containment", ["cgroup", "subreaper"])
async def test_a_standbys_helper_is_swept_by_the_next_daemon_after_a_kill9(
    tmp_path: Path, containment: str
) -> None:
    code, out = _job_files(tmp_path, "import time\ntime.sleep(600)\n", GROUP_HELPER)
    if containment == "cgroup" and cgroup_home() is None:
        pytest.skip("no cgroup v2 here")
    env = {"ELASTICD_CONTAINMENT": containment}
    daemon = serve(tmp_path, env=env)
    again = None
    helpers: list[int] = []
    try:
        async with asyncio.timeout(90), daemon.client() as c:
            await daemon.wait_ready()
            body = submit_body(
                "g", out, entrypoint=sys.executable, args=[str(code / "w.py")],
                cwd=str(code), prewarm=["helper_mod"],
            )  # fmt: skip
            assert (await c.post("/jobs", json=body)).status_code == 201
            standbys = await ready_standbys(c, "g", 2)
            helpers = _helpers(out)
            assert len(helpers) == 2
            # The fault's precondition, not a wait that hopes: the standbys are in the
            # database the next daemon sweeps from (written at their start, or queued).
            await eventually(
                lambda: _recorded(daemon.state_dir, standbys.values()), 20, "their records"
            )
            daemon.kill9()
            await eventually(
                lambda: not any(pid_alive(p) for p in standbys.values()), 20, "standbys"
            )
            assert all(pid_alive(p) for p in helpers)  # no parent-death signal for them
            again = serve(tmp_path, state_dir=daemon.state_dir, port=daemon.port, env=env)
            await again.wait_ready()
            await eventually(lambda: not any(pid_alive(p) for p in helpers), 20, "helpers")
    finally:
        daemon.kill9()
        if again is not None:
            again.kill9()
        # The next daemon resumed the job: its worker outlives that daemon's kill -9 too.
        for pid in [*helpers, *running_program(str(code / "w.py"))]:
            if pid_alive(pid):
                os.kill(pid, 9)


ATTEMPTS = r"""
import os, sys, time
out, count = os.environ["OUT"], os.environ["TORCHELASTIC_RESTART_COUNT"]
flag = os.path.join(out, "go" + count if count in ("0", "1") else "end")
while not os.path.exists(flag):
    time.sleep(0.02)
sys.exit(3 if count in ("0", "1") else 0)
"""


def _cgroup_of(pid: int) -> str:
    return Path(f"/proc/{pid}/cgroup").read_text()


@pytest.mark.parametrize("containment", ["cgroup", "subreaper"])
async def test_an_attempt_that_ends_leaves_nothing_its_warm_workers_imports_started(
    tmp_path: Path, containment: str
) -> None:
    """A warm worker's helper, started by its imports in a session of its own while it was a
    standby, dies with the worker's attempt, as a cold worker's would. With cgroups it went
    with the standby into the attempt's cgroup at the hand-off; under the subreaper it is
    orphaned to the daemon when the worker ends and the attempt's end kills it (its job's id).
    """
    if containment == "cgroup" and cgroup_home() is None:
        pytest.skip("no cgroup v2 here")
    code, out = _job_files(tmp_path, ATTEMPTS, HELPER)
    daemon = serve(tmp_path, env={"ELASTICD_CONTAINMENT": containment})
    helpers: list[int] = []
    try:
        async with asyncio.timeout(100), daemon.client() as c:
            await daemon.wait_ready()
            body = submit_body(
                "a", out, entrypoint=sys.executable, args=[str(code / "w.py")],
                cwd=str(code), prewarm=["helper_mod"], nproc_per_node=1, max_restarts=2,
            )  # fmt: skip
            assert (await c.post("/jobs", json=body)).status_code == 201
            first = (await ready_standbys(c, "a", 1))[0]
            (out / "go0").touch()  # attempt 1: the first standby's
            second = first
            while second == first:
                second = (await ready_standbys(c, "a", 1))[0]
            helper_of_attempt_1 = int((out / f"helper.{first}").read_text())
            helpers = _helpers(out)
            if containment == "cgroup":  # the helper is where its worker is: the attempt's
                assert _cgroup_of(helper_of_attempt_1) == _cgroup_of(first)
                assert _cgroup_of(first) != _cgroup_of(second)
            (out / "go1").touch()  # attempt 1 ends; attempt 2: the second standby's
            while (await c.get("/jobs/a")).json().get("restart_count") != 2:
                await asyncio.sleep(0.05)
            await eventually(lambda: not pid_alive(helper_of_attempt_1), 20, "attempt 1's")
            (out / "end").touch()
    finally:
        daemon.kill9()
        for pid in _helpers(out) + helpers:
            if pid_alive(pid):
                os.kill(pid, 9)


def _standby_cgroups(home: Path | None, daemon_state: Path, job_id: str) -> list[Path]:
    """The job's cgroup folders without an attempt (``a-.*``): its standbys' own."""
    if home is None:
        return []
    subtree = daemon_subtree(home, "hard-node", daemon_state)
    return sorted(subtree.glob(f"a-.*.{job_id}"))


@pytest.mark.parametrize("containment", ["cgroup", "subreaper"])
async def test_a_standby_killed_replaced_or_closed_leaves_no_process_and_no_cgroup(
    tmp_path: Path, containment: str
) -> None:
    """A standby killed with ``kill -9`` is replaced, and what its imports started in a session
    of their own dies with it, its cgroup folder removed; the job's cancel then leaves no
    standby, no helper and no standby cgroup folder."""
    home = cgroup_home() if containment == "cgroup" else None
    if containment == "cgroup" and home is None:
        pytest.skip("no cgroup v2 here")
    code, out = _job_files(tmp_path, "import time\ntime.sleep(600)\n", HELPER)
    daemon = serve(tmp_path, env={"ELASTICD_CONTAINMENT": containment})
    try:
        async with asyncio.timeout(100), daemon.client() as c:
            await daemon.wait_ready()
            body = submit_body(
                "k", out, entrypoint=sys.executable, args=[str(code / "w.py")],
                cwd=str(code), prewarm=["helper_mod"], nproc_per_node=1,
            )  # fmt: skip
            assert (await c.post("/jobs", json=body)).status_code == 201
            first = (await ready_standbys(c, "k", 1))[0]
            helper = int((out / f"helper.{first}").read_text())
            if home is not None:
                own = _standby_cgroups(home, daemon.state_dir, "k")
                assert len(own) == 1
                assert _cgroup_of(first).strip().endswith(own[0].name)
                assert _cgroup_of(helper) == _cgroup_of(first)
            os.kill(first, 9)
            second = first
            while second == first:
                second = (await ready_standbys(c, "k", 1))[0]
            await eventually(lambda: not pid_alive(helper), 20, "the killed standby's helper")
            if home is not None:
                await eventually(
                    lambda: len(_standby_cgroups(home, daemon.state_dir, "k")) == 1,
                    20,
                    "the killed standby's cgroup removed",
                )
            helpers = _helpers(out)
            assert len(helpers) == 2
            assert (await c.post("/jobs/k/cancel", json={})).status_code in (200, 202)
            await eventually(
                lambda: not any(pid_alive(p) for p in [second, *helpers]), 30, "nothing left"
            )
            await eventually(
                lambda: not _standby_cgroups(home, daemon.state_dir, "k"), 20, "no cgroup left"
            )
    finally:
        daemon.kill9()
        for pid in _helpers(out):
            if pid_alive(pid):
                os.kill(pid, 9)


#: A worker that writes its pid, pings its heartbeat at once (``ping``), or never.
PINGS = r"""
import os, sys, time
if sys.argv[1] == "ping":
    from elasticd.worker.heartbeat import ping
    ping()
with open(os.path.join(os.environ["OUT"], f"worker.{os.getpid()}"), "w") as f:
    f.write("")
time.sleep(600)
"""


@pytest.mark.parametrize(
    ("worker", "cpus", "beside"),
    [("silent", 1, False), ("ping", 1, False), ("silent", 2, True)],
)
async def test_a_first_attempts_standbys_start_after_its_workers_imports_unless_cpus_are_spare(
    tmp_path: Path, worker: str, cpus: int, beside: bool
) -> None:
    """On a node with no CPU to spare (the daemon on one CPU, a worker on it), the standbys of
    a first attempt start only once its workers have pinged (they are past their imports),
    or FIRST_FILL_AFTER_S after they started: never beside their imports. With a CPU to
    spare for the standby (two, one worker), it starts with the worker, ready for an early
    crash (issue 40). Measured on the processes' own start times (the kernel's)."""
    code, out = _job_files(tmp_path, PINGS, None)
    daemon = serve(tmp_path, cpus=cpus)
    try:
        async with asyncio.timeout(100), daemon.client() as c:
            await daemon.wait_ready()
            body = submit_body(
                "f", out, entrypoint=sys.executable, args=[str(code / "w.py"), worker],
                cwd=str(code), nproc_per_node=1,
            )  # fmt: skip
            body["env"]["PYTHONPATH"] = str(ROOT)
            assert (await c.post("/jobs", json=body)).status_code == 201
            standby = (await ready_standbys(c, "f", 1))[0]
            (pid,) = (int(p.name.split(".")[1]) for p in out.glob("worker.*"))
            ticks = os.sysconf("SC_CLK_TCK")
            after = (_started(standby) - _started(pid)) / ticks
            if beside:  # with the worker, not after its imports (nor the bound)
                assert after < 1.5, after
            elif worker == "silent":
                assert after >= FIRST_FILL_AFTER_S
            else:  # the ping came well before the bound (its poll: FILL_POLL_S)
                assert after < FIRST_FILL_AFTER_S - 1
    finally:
        daemon.kill9()


def _started(pid: int) -> int:
    started = process_start_time(pid)
    assert started is not None, pid
    return started
