"""Warm restarts on a real `elasticd serve` (issue 27): a restart's workers take over standby
interpreters that imported the job's ``prewarm`` modules while the attempt ran, and start
exactly as a cold worker would; where that cannot be, they start cold and say why."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from elasticd.supervise.spawn import find_perl
from tests.conftest import events_of, wait_job
from tests.e2e.cluster import LocalCluster
from tests.hardening.support import eventually, pid_alive, serve
from tests.supervise.forker import FORKER, v1_pids_cgroup

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="a root daemon, as deployed"),
]

#: Dumps everything a program can observe of its own start to $OUT/r<local rank>_<restart>.json;
#: on the first attempt it then waits for $OUT/go and fails (the restart), else it succeeds.
PROBE = r"""
import json, os, signal, stat, sys, time

def kind(fd):
    st = os.fstat(fd)
    return [stat.S_IFMT(st.st_mode), st.st_rdev]

def status(*names):
    lines = open("/proc/self/status").read().splitlines()
    return [line for line in lines if line.split(":")[0] in names]

mask = os.umask(0)
os.umask(mask)
spec = globals().get("__spec__")
record = {
    "argv": sys.argv,
    "orig_argv": sys.orig_argv,
    "executable": sys.executable,
    "flags": repr(sys.flags),
    "name": __name__,
    "main_is_globals": sys.modules["__main__"].__dict__ is globals(),
    "dunders": sorted(k for k in globals() if k.startswith("__")),
    "file": globals().get("__file__"),
    "cached": globals().get("__cached__"),
    "package": globals().get("__package__"),
    "loader": type(globals().get("__loader__")).__name__,
    "spec": None if spec is None else [spec.name, spec.origin],
    "path": sys.path,
    "cwd": os.getcwd(),
    "env": dict(os.environ),
    "std": [kind(0), kind(1), kind(2)],
    "stdout": [sys.stdout.encoding, sys.stdout.line_buffering, sys.stdin.encoding],
    "fds": sorted(os.listdir("/proc/self/fd")),
    "handlers": {s.name: repr(signal.getsignal(s)) for s in signal.Signals
                 if s not in (signal.SIGKILL, signal.SIGSTOP)},
    "signals": status("SigBlk", "SigIgn", "SigCgt"),
    "umask": mask,
    "ids": [os.getresuid(), os.getresgid(), sorted(os.getgroups())],
    "session_leader": os.getsid(0) == os.getpid() == os.getpgid(0),
    "cgroup": open("/proc/self/cgroup").read(),
    "pid": os.getpid(),
}
out = os.environ["OUT"]
count = os.environ["TORCHELASTIC_RESTART_COUNT"]
with open(f"{out}/r{os.environ['LOCAL_RANK']}_{count}.json", "w") as f:
    json.dump(record, f)
print("out", count, flush=True)
print("err", count, file=sys.stderr, flush=True)
if count == "0":
    while not os.path.exists(f"{out}/go"):
        time.sleep(0.02)
    sys.exit(3)
"""

#: What differs between two attempts of one worker by design: the round's files and port.
#: An attempt's cgroup in /proc/self/cgroup (supervise/cgroup.py's attempt_name).
ATTEMPT_CGROUP = re.compile(r"/a(\d+)\.[0-9a-f]{8}\.[A-Za-z0-9._-]+$", re.MULTILINE)

PER_ATTEMPT = {
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_ERROR_FILE",
    "ELASTICD_HEARTBEAT_FILE",
    "ELASTICD_ATTEMPT",
    "ELASTICD_FLIGHT_RECORDER_FILE",
    "MASTER_PORT",
}


async def ready_standbys(
    c: httpx.AsyncClient, job_id: str, count: int, timeout: float = 60
) -> dict[int, int]:
    """{local rank: pid} once the job's group shows ``count`` ready standbys."""
    found: dict[int, int] = {}

    async def ready() -> bool:
        nonlocal found
        view = (await c.get(f"/jobs/{job_id}/workers")).json()
        for group in view.get("groups", []):
            standbys = group.get("standbys", [])
            if len(standbys) == count and all(s["state"] == "ready" for s in standbys):
                # A standby just killed (a zombie not reaped yet) is still listed, without
                # memory: look again until the pool has taken it out.
                if not all((s["rss_bytes"] or 0) > 0 for s in standbys):
                    continue
                found = {s["local_rank"]: s["pid"] for s in standbys}
                return True
        return False

    deadline = time.monotonic() + timeout
    while not await ready():
        assert time.monotonic() < deadline, f"no {count} ready standbys for {job_id}"
        await asyncio.sleep(0.05)
    return found


def prepare(tmp_path: Path, text: str = PROBE) -> tuple[Path, Path]:
    """The output folder and the probe script of a test."""
    out, probe = tmp_path / "out", tmp_path / "probe.py"
    out.mkdir()
    probe.write_text(text)
    return out, probe


@contextlib.asynccontextmanager
async def served(
    tmp_path: Path, seconds: float = 100, env: dict[str, str] | None = None
) -> AsyncIterator[httpx.AsyncClient]:
    """A client of a fresh root `elasticd serve` (``env``: its settings), stopped at the end;
    the block is bounded."""
    daemon = serve(tmp_path, env=env)
    try:
        async with asyncio.timeout(seconds), daemon.client() as c:
            await daemon.wait_ready()
            yield c
    finally:
        daemon.stop()


def submit_body(job_id: str, out: Path, **spec: Any) -> dict[str, Any]:
    return {
        "id": job_id,
        "env": {"OUT": str(out)},
        "nproc_per_node": 2,
        "max_restarts": 1,
        "gpu_health_check": False,
        "prewarm": ["json"],
        **spec,
    }


@pytest.mark.parametrize("form", ["script", "module"])
async def test_a_warm_start_is_observably_the_same_as_a_cold_one(tmp_path: Path, form: str) -> None:
    """Attempt 0 starts cold, attempt 1 from the standbys: argv, __main__, __file__,
    sys.path, cwd, env, stdin/stdout/stderr, signals, umask, ids, cgroup and open fds are the
    same, the output lands in attempt 1's logs, and the workers are the standbys' pids."""
    code = tmp_path / "code"
    code.mkdir()
    out, probe = prepare(tmp_path)
    probe.rename(code / "probe.py")
    args = [str(code / "probe.py"), "a b", "--x"] if form == "script" else ["-m", "probe", "y"]
    async with served(tmp_path) as c:
        body = submit_body("warm", out, entrypoint=sys.executable, args=args, cwd=str(code))
        r = await c.post("/jobs", json=body)
        assert r.status_code == 201, r.text
        standbys = await ready_standbys(c, "warm", 2)
        metrics = (await c.get("/metrics")).text
        (out / "go").touch()
        job = await wait_job(c, "warm")
        assert job["state"] == "SUCCEEDED", job
        events = await events_of(c, "warm")
        logs = [
            (await c.get("/jobs/warm/logs", params={"attempt": 1, "stream": s})).text
            for s in ("stdout", "stderr")
        ]
    assert 'elasticd_standby_processes{job_id="warm"} 2.0' in metrics
    memory = re.search(r'elasticd_standby_resident_bytes\{job_id="warm"\} (\S+)', metrics)
    assert memory is not None and float(memory.group(1)) > 1e6, metrics
    warm = [e for e in events if e["kind"] == "workers.warm_start"]
    assert len(warm) == 1, [e["kind"] for e in events]
    assert sorted(warm[0]["pids"]) == sorted(standbys.values())
    assert not [e for e in events if e["kind"] == "worker.cold_start"]
    assert logs == ["out 1\n", "err 1\n"]
    for rank in (0, 1):
        cold = json.loads((out / f"r{rank}_0.json").read_text())
        hot = json.loads((out / f"r{rank}_1.json").read_text())
        assert hot.pop("pid") == standbys[rank]
        cold.pop("pid")
        for name in PER_ATTEMPT:
            assert cold["env"].pop(name) != hot["env"].pop(name) or name == "MASTER_PORT"
        # Each attempt has a cgroup of its own (when the daemon can make them): the warm
        # worker is in attempt 1's, as a cold one would be.
        for record, attempt in ((cold, "0"), (hot, "1")):
            found = ATTEMPT_CGROUP.findall(record["cgroup"])
            assert found in ([], [attempt]), record["cgroup"]
            record["cgroup"] = ATTEMPT_CGROUP.sub("/a<n>", record["cgroup"])
        assert hot == cold


async def test_cancel_and_job_end_leave_no_standby(tmp_path: Path) -> None:
    """The standbys of a cancelled job, and of a job that ended, are gone with it."""
    out, probe = prepare(tmp_path)
    async with served(tmp_path) as c:
        body = submit_body("cancelled", out, entrypoint=sys.executable, args=[str(probe)])
        assert (await c.post("/jobs", json=body)).status_code == 201
        cancelled = await ready_standbys(c, "cancelled", 2)
        assert (await c.post("/jobs/cancelled/cancel", json={})).status_code in (200, 202)
        job = await wait_job(c, "cancelled")
        assert job["state"] == "CANCELLED", job
        await eventually(
            lambda: not any(pid_alive(p) for p in cancelled.values()), 30, "no standby"
        )
        ends = tmp_path / "ends.py"
        ends.write_text(f"import os, time\nwhile not os.path.exists({str(out / 'end')!r}):\n"
                        "    time.sleep(0.02)\n")  # fmt: skip
        body = submit_body("ends", out, entrypoint=sys.executable, args=[str(ends)])
        assert (await c.post("/jobs", json=body)).status_code == 201
        ended = await ready_standbys(c, "ends", 2)
        (out / "end").touch()
        job = await wait_job(c, "ends")
        assert job["state"] == "SUCCEEDED", job
        await eventually(lambda: not any(pid_alive(p) for p in ended.values()), 30, "none")


async def test_a_killed_standby_is_replaced_and_the_restart_is_still_warm(
    tmp_path: Path,
) -> None:
    """SIGKILL a ready standby: ``standby.lost``, a new one takes its place, and the restart
    hands off to the new one."""
    out, probe = prepare(tmp_path)
    async with served(tmp_path) as c:
        body = submit_body("killed", out, entrypoint=sys.executable, args=[str(probe)])
        assert (await c.post("/jobs", json=body)).status_code == 201
        first = await ready_standbys(c, "killed", 2)
        os.kill(first[1], signal.SIGKILL)
        second: dict[int, int] = {}
        deadline = time.monotonic() + 60
        while second.get(1) in (None, first[1]):
            assert time.monotonic() < deadline, "the killed standby was not replaced"
            second = await ready_standbys(c, "killed", 2)
        (out / "go").touch()
        job = await wait_job(c, "killed")
        assert job["state"] == "SUCCEEDED", job
        events = await events_of(c, "killed")
    lost = [e for e in events if e["kind"] == "standby.lost"]
    assert [e["local_rank"] for e in lost] == [1], lost
    assert "killed by signal 9" in lost[0]["message"]
    warm = [e for e in events if e["kind"] == "workers.warm_start"]
    assert sorted(warm[0]["pids"]) == sorted(second.values())


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        ({"entrypoint": "/bin/sh"}, "is not a Python interpreter"),
        ({"entrypoint": sys.executable, "prewarm": ["no_such_module_x"]}, "imports failed"),
    ],
)
async def test_where_prewarm_cannot_apply_the_restart_starts_cold_and_says_why(
    tmp_path: Path, spec: dict[str, Any], reason: str
) -> None:
    """A shell entrypoint, or a module the standby cannot import: the restart's workers start
    cold, each with a ``worker.cold_start`` event that says why, and the job still runs."""
    out, probe = prepare(tmp_path)
    args = [str(probe)]
    if spec["entrypoint"] == "/bin/sh":
        args = ["-c", f'exec {sys.executable} "$0"', str(probe)]
    async with served(tmp_path) as c:
        body = submit_body("cold", out, args=args, **spec)
        assert (await c.post("/jobs", json=body)).status_code == 201
        await eventually(lambda: (out / "r1_0.json").exists(), 60, "attempt 0")
        if "prewarm" in spec:  # let the standbys fail their imports first

            async def lost() -> bool:
                kinds = [e["kind"] for e in await events_of(c, "cold")]
                return kinds.count("standby.lost") == 2

            deadline = time.monotonic() + 60
            while not await lost():
                assert time.monotonic() < deadline, "no standby.lost"
                await asyncio.sleep(0.05)
        (out / "go").touch()
        job = await wait_job(c, "cold")
        assert job["state"] == "SUCCEEDED", job
        events = await events_of(c, "cold")
    cold = [e for e in events if e["kind"] == "worker.cold_start"]
    assert sorted(e["local_rank"] for e in cold) == [0, 1], [e["kind"] for e in events]
    assert all(reason in e["message"] for e in cold), cold
    assert not [e for e in events if e["kind"] == "workers.warm_start"]


#: Says whether torch was imported before its own first statement, and whether CUDA is set up.
TORCH_PROBE = r"""
import sys
imported_before = "torch" in sys.modules
import json, os, time
import torch
count = os.environ["TORCHELASTIC_RESTART_COUNT"]
with open(f"{os.environ['OUT']}/t{count}.json", "w") as f:
    json.dump({"imported_before": imported_before, "cuda": torch.cuda.is_initialized()}, f)
if count == "0":
    while not os.path.exists(f"{os.environ['OUT']}/go"):
        time.sleep(0.02)
    sys.exit(3)
"""


def _touches_the_gpu(pid: int) -> list[str]:
    """What of the CUDA driver ``pid`` has loaded or opened (libcuda, /dev/nvidia*)."""
    maps = Path(f"/proc/{pid}/maps").read_text()
    found = sorted({line.split()[-1] for line in maps.splitlines() if "libcuda" in line})
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            if os.readlink(fd).startswith("/dev/nvidia"):
                found.append(os.readlink(fd))
    return found


@pytest.mark.torch
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
async def test_a_standby_imports_torch_but_never_initialises_cuda(tmp_path: Path) -> None:
    """prewarm torch with CUDA_VISIBLE_DEVICES set: the standby has torch imported and has
    neither loaded the CUDA driver nor opened a GPU; the warm worker finds torch already
    imported and ``torch.cuda.is_initialized()`` false."""
    out, probe = prepare(tmp_path, TORCH_PROBE)
    async with served(tmp_path, 110) as c:
        body = submit_body(
            "torch", out, entrypoint=sys.executable, args=[str(probe)], nproc_per_node=1,
            prewarm=["torch"], env={"OUT": str(out), "CUDA_VISIBLE_DEVICES": "0"},
        )  # fmt: skip
        assert (await c.post("/jobs", json=body)).status_code == 201
        standbys = await ready_standbys(c, "torch", 1, timeout=90)
        assert _touches_the_gpu(standbys[0]) == []
        (out / "go").touch()
        job = await wait_job(c, "torch")
        assert job["state"] == "SUCCEEDED", job
    cold = json.loads((out / "t0.json").read_text())
    warm = json.loads((out / "t1.json").read_text())
    assert cold == {"imported_before": False, "cuda": False}
    assert warm == {"imported_before": True, "cuda": False}


async def test_every_node_of_a_multi_node_job_hands_off_locally(tmp_path: Path) -> None:
    """Two daemons, one job over both: after the crash each node's workers take over that
    node's own standbys (a ``workers.warm_start`` per node, with its standbys' pids)."""
    out = tmp_path / "out"
    out.mkdir()
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE.replace("r{os.environ['LOCAL_RANK']}", "r{os.environ['RANK']}"))
    with LocalCluster(tmp_path) as cluster:
        await cluster.start_all("n0", "n1")
        async with asyncio.timeout(110), cluster.client("n0") as c:
            body = submit_body(
                "nodes", out, entrypoint=sys.executable, args=[str(probe)], nproc_per_node=1,
                min_nodes=2, max_nodes=2,
            )  # fmt: skip
            assert (await c.post("/jobs", json=body)).status_code == 201, cluster.logs()
            pids: dict[str, int] = {}
            deadline = time.monotonic() + 90
            while len(pids) < 2:
                assert time.monotonic() < deadline, f"no ready standbys: {cluster.logs()}"
                await asyncio.sleep(0.05)
                view = (await c.get("/jobs/nodes/workers")).json()
                pids = {
                    g["node"]: g["standbys"][0]["pid"]
                    for g in view.get("groups", [])
                    if [s["state"] for s in g.get("standbys", [])] == ["ready"]
                }
            (out / "go").touch()
            job = await wait_job(c, "nodes", timeout=90)
            assert job["state"] == "SUCCEEDED", cluster.logs()
            events = await events_of(c, "nodes")
    warm = {e["node"]: e["pids"] for e in events if e["kind"] == "workers.warm_start"}
    assert warm == {node: [pid] for node, pid in pids.items()}, [e["kind"] for e in events]
    for rank in (0, 1):
        hot = json.loads((out / f"r{rank}_1.json").read_text())
        assert hot["env"]["WORLD_SIZE"] == "2"
        assert hot["env"]["TORCHELASTIC_RESTART_COUNT"] == "1"


#: Attempt 0 waits for its job's standby to be ready (a process whose command line names the
#: standby's namespace and whose environment names the job, blocked reading its socket for
#: the hand-off: ``recvmsg``, which it calls only once it said it is ready), then fails: a
#: standby not ready at a crash is never waited for (issue 40). Every attempt prints whether
#: ``colorsys`` was imported before its first line.
RUN_PROBE = r"""
import sys
print("colorsys imported before:", "colorsys" in sys.modules, flush=True)
import os, time
RECVMSG = {"47", "212"}  # x86_64, aarch64
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    mine = ("ELASTICD_JOB_ID=" + os.environ["ELASTICD_JOB_ID"]).encode()
    def standby():  # this job's: its environment names the job
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                command = open(f"/proc/{pid}/cmdline", "rb").read()
                environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            except OSError:
                continue
            if b"elasticd_standby" in command and mine in environ:
                try:
                    return open(f"/proc/{pid}/syscall").read().split()[0] in RECVMSG
                except PermissionError:  # not ours to look into: its being there must do
                    return True
                except (OSError, IndexError):
                    continue
        return False
    while not standby():
        time.sleep(0.02)
    sys.exit(3)
"""


def test_elasticd_run_prewarm_restarts_warm(tmp_path: Path) -> None:
    """`elasticd run --prewarm colorsys`: the restart's worker finds the module imported."""
    probe = tmp_path / "probe.py"
    probe.write_text(RUN_PROBE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICD_")}
    env["ELASTICD_ALLOW_ROOT"] = "true"
    done = subprocess.run(
        [sys.executable, "-m", "elasticd", "run", "--max-restarts", "1", "--prewarm",
         "colorsys", str(probe)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=100, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if "colorsys" in line]
    assert lines == [
        "colorsys imported before: False",
        "colorsys imported before: True",
    ], done.stdout


async def test_a_node_that_joins_late_starts_cold_and_says_so(tmp_path: Path) -> None:
    """A job of 1-2 nodes runs on n0; n1 joins: the new round's worker on n0 takes over n0's
    standby, n1's (which has none yet) starts cold with ``worker.cold_start`` saying why."""
    out, probe = prepare(
        tmp_path,
        "import os, time\nwhile not os.path.exists(os.path.join(os.environ['OUT'], 'end')):\n"
        "    time.sleep(0.02)\n",
    )
    with LocalCluster(tmp_path) as cluster:
        await cluster.start_all("n0")
        async with asyncio.timeout(110), cluster.client("n0") as c:
            body = submit_body(
                "late", out, entrypoint=sys.executable, args=[str(probe)], nproc_per_node=1,
                min_nodes=1, max_nodes=2,
            )  # fmt: skip
            assert (await c.post("/jobs", json=body)).status_code == 201, cluster.logs()
            standby = (await ready_standbys(c, "late", 1))[0]
            cluster.start("n1")
            await cluster.wait_ready("n1")

            async def both_started() -> list[dict[str, Any]]:
                events = await events_of(c, "late")
                return [
                    e for e in events if e["kind"] in ("workers.warm_start", "worker.cold_start")
                ]

            deadline = time.monotonic() + 60
            while len(starts := await both_started()) < 2:
                assert time.monotonic() < deadline, f"no second round: {cluster.logs()}"
                await asyncio.sleep(0.05)
            (out / "end").touch()
            job = await wait_job(c, "late", timeout=60)
            assert job["state"] == "SUCCEEDED", cluster.logs()
    by_node = {e["node"]: e for e in starts}
    assert by_node["n0"]["kind"] == "workers.warm_start"
    assert by_node["n0"]["pids"] == [standby]
    assert by_node["n1"]["kind"] == "worker.cold_start"
    assert "joined the job late" in by_node["n1"]["message"]


#: A prewarm module whose standby forks without end (tests/supervise/forker.py's FORKER, 24
#: chains, in a session of its own) until $OUT/run is gone; bounded by the
#: v1 pids cgroup $PIDS_PROCS names.
FORKING = r"""
import os, subprocess, sys
subprocess.Popen(
    [sys.executable, "-I", "-c", open(os.environ["FORKER"]).read(), os.environ["PIDS_PROCS"],
     os.environ["OUT"] + "/run", os.environ["PERL"], "24"],
    start_new_session=True,
)
"""

#: Attempt n waits for $OUT/go<n> and fails, or for $OUT/done and succeeds.
UNTIL_DONE = r"""
import os, sys, time
out, n = os.environ["OUT"], os.environ["TORCHELASTIC_RESTART_COUNT"]
while not os.path.exists(f"{out}/go{n}") and not os.path.exists(f"{out}/done"):
    time.sleep(0.02)
sys.exit(0 if os.path.exists(f"{out}/done") else 3)
"""


def _members(procs: Path) -> list[str]:
    return procs.read_text().split()


async def _how_restarted(c: httpx.AsyncClient, job_id: str, attempt: int) -> dict[str, Any]:
    """The ``worker.cold_start`` or ``workers.warm_start`` event of ``attempt``."""
    deadline = time.monotonic() + 120
    while True:
        for e in await events_of(c, job_id):
            kinds = ("worker.cold_start", "workers.warm_start")
            if e["kind"] in kinds and e.get("attempt") == attempt:
                return e
        assert time.monotonic() < deadline, f"attempt {attempt} did not start"
        await asyncio.sleep(0.05)


async def test_a_hand_off_that_cannot_move_its_standby_starts_the_rank_cold(
    tmp_path: Path,
) -> None:
    """A standby that forks without end, on a node whose ``prewarm_move_budget`` is 0: the
    hand-off gives up its move at once (deterministically: a move the budget allows races
    the forks, which tests/supervise/test_cgroup.py covers), the rank starts cold and says
    why, the job succeeds, ``/healthz`` answers all along, and no process of the standby is
    left: neither the refused one's nor the next standby's, killed at the job's end."""
    perl = find_perl()
    if perl is None:
        pytest.skip("no perl for the forking chains")
    out, probe = prepare(tmp_path, UNTIL_DONE)
    modules = tmp_path / "mods"
    modules.mkdir()
    (modules / "mb_forking.py").write_text(FORKING)
    forker = tmp_path / "forker.py"
    forker.write_text(FORKER)
    (out / "run").touch()
    latencies: list[float] = []
    with v1_pids_cgroup(1024) as pids_procs:
        if pids_procs is None:
            pytest.skip("no v1 pids cgroup to bound the forker with")
        try:
            at_once = {"ELASTICD_PREWARM_MOVE_BUDGET": "0"}
            async with served(tmp_path, seconds=300, env=at_once) as c:
                env = {"OUT": str(out), "PYTHONPATH": str(modules), "PERL": perl,
                       "FORKER": str(forker), "PIDS_PROCS": str(pids_procs)}  # fmt: skip
                body = submit_body(
                    "forks", out, entrypoint=sys.executable, args=[str(probe)],
                    nproc_per_node=1, prewarm=["mb_forking"], env=env, max_restarts=1,
                )  # fmt: skip
                assert (await c.post("/jobs", json=body)).status_code == 201
                await ready_standbys(c, "forks", 1, timeout=120)

                async def healthz() -> None:
                    while True:
                        started = time.monotonic()
                        assert (await c.get("/healthz")).status_code == 200
                        latencies.append(time.monotonic() - started)
                        await asyncio.sleep(0.01)

                poll = asyncio.get_running_loop().create_task(healthz())
                try:
                    (out / "go0").touch()
                    refused = await _how_restarted(c, "forks", 1)
                    (out / "done").touch()
                    job = await wait_job(c, "forks")
                finally:
                    poll.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await poll
                assert job["state"] == "SUCCEEDED", job
                # Before the stop file goes (the chains would end by themselves): every
                # process the standbys started was killed (the refused one's, and the next
                # standby's at the job's end).
                await eventually(lambda: not _members(pids_procs), 30, "no process left")
        finally:
            (out / "run").unlink(missing_ok=True)
    assert refused["kind"] == "worker.cold_start", refused
    assert "did not all move into the attempt's cgroup within 0 s" in refused["message"], refused
    assert latencies and max(latencies) < 5.0, latencies


async def test_a_stopped_standby_starts_the_restart_cold_and_names_why(tmp_path: Path) -> None:
    """Both standbys stopped with SIGSTOP (a debugger, the job's own kill) when the restart
    comes: each hand-off gives up after HANDOFF_TIMEOUT, the rank starts cold, and its
    ``worker.cold_start`` event names the cause (it timed out), never an empty one."""
    from elasticd.supervise.standby import HANDOFF_TIMEOUT

    out, probe = prepare(tmp_path)
    async with served(tmp_path) as c:
        body = submit_body("stopped", out, entrypoint=sys.executable, args=[str(probe)])
        assert (await c.post("/jobs", json=body)).status_code == 201
        standbys = await ready_standbys(c, "stopped", 2)
        for pid in standbys.values():
            os.kill(pid, signal.SIGSTOP)
        (out / "go").touch()
        job = await wait_job(c, "stopped")
        assert job["state"] == "SUCCEEDED", job
        events = await events_of(c, "stopped")
    cold = [e for e in events if e["kind"] == "worker.cold_start"]
    assert sorted(e["local_rank"] for e in cold) == [0, 1], [e["kind"] for e in events]
    for event in cold:
        assert not event["message"].rstrip().endswith(":"), event
        assert f"timed out after {HANDOFF_TIMEOUT:g} s" in event["message"], event
    assert not any(pid_alive(pid) for pid in standbys.values())
