"""Review of issue 27 on a real root daemon: the daemon's death, or its stop, leaves no
standby, and no process a standby's imports started."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

from tests.e2e.test_prewarm import ready_standbys, submit_body
from tests.hardening.support import cgroup_home, eventually, pid_alive, serve

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


def _helpers(out: Path) -> list[int]:
    return [int(p.read_text()) for p in out.glob("helper.*")]


@pytest.mark.parametrize("how", ["kill9", "stop"])
async def test_the_daemons_end_leaves_no_standby(tmp_path: Path, how: str) -> None:
    code = tmp_path / "code"
    code.mkdir()
    (code / "helper_mod.py").write_text(HELPER)
    (code / "w.py").write_text("import time\ntime.sleep(600)\n")
    out = tmp_path / "out"
    out.mkdir()
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
        for pid in [*helpers, *standbys.values()]:
            if pid_alive(pid):
                os.kill(pid, 9)


#: A helper that stays in the standby's process group (no setsid): a worker's such helper is
#: swept by the next daemon (the registry names the worker's group); a standby's must be too.
GROUP_HELPER = HELPER.replace("    os.setsid()\n", "")


@pytest.mark.parametrize("containment", ["cgroup", "subreaper"])
async def test_a_standbys_helper_is_swept_by_the_next_daemon_after_a_kill9(
    tmp_path: Path, containment: str
) -> None:
    code = tmp_path / "code"
    code.mkdir()
    (code / "helper_mod.py").write_text(GROUP_HELPER)
    (code / "w.py").write_text("import time\ntime.sleep(600)\n")
    out = tmp_path / "out"
    out.mkdir()
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
            await asyncio.sleep(0.5)  # the records reach the database (a backlog)
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
        for pid in helpers:
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


@pytest.mark.xfail(
    strict=True,
    reason="review of issue 27: what a standby's imports started "
    "outside its process group stays in the pool's cgroup after the hand-off",
)
async def test_an_attempt_that_ends_leaves_nothing_its_warm_workers_imports_started(
    tmp_path: Path,
) -> None:
    """A cold worker's helper (its own session) is in its attempt's cgroup and dies with the
    attempt (a stray, reported). A warm worker's helper, started by its imports while it was
    a standby, stays in the pool's cgroup: it outlives the attempt, one more every restart."""
    if cgroup_home() is None:
        pytest.skip("no cgroup v2 here")
    code = tmp_path / "code"
    code.mkdir()
    (code / "helper_mod.py").write_text(HELPER)
    (code / "w.py").write_text(ATTEMPTS)
    out = tmp_path / "out"
    out.mkdir()
    daemon = serve(tmp_path)
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
            (out / "go1").touch()  # attempt 1 ends; attempt 2: the second standby's
            while (await c.get("/jobs/a")).json().get("restart_count") != 2:
                await asyncio.sleep(0.05)
            await eventually(lambda: not pid_alive(helper_of_attempt_1), 10, "attempt 1's")
            (out / "end").touch()
    finally:
        daemon.kill9()
        for pid in _helpers(out) + helpers:
            if pid_alive(pid):
                os.kill(pid, 9)
