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
