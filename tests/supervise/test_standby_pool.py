"""StandbyPool against real standby interpreters (review of issue 27): the daemon never waits
unboundedly on a standby that does not read, and a hand-off cut short leaves no process."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elasticd.supervise import standby as standby_mod
from elasticd.supervise.process import WorkerLaunch
from elasticd.supervise.spawn import DEFAULT_POLICY
from elasticd.supervise.standby import StandbyPool


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _launch(tmp_path: Path, env: dict[str, str] | None = None) -> WorkerLaunch:
    script = tmp_path / "w.py"
    script.write_text("import sys\nsys.exit(0)\n")
    base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "RANK": "0"}
    base.update(env or {})
    return WorkerLaunch(
        local_rank=0, argv=[sys.executable, str(script)], env=base, cwd=str(tmp_path),
        log_dir=tmp_path / "logs",
    )  # fmt: skip


async def _ready_pool(tmp_path: Path, launch: WorkerLaunch, modules: list[str]) -> StandbyPool:
    pool = StandbyPool("j", modules, DEFAULT_POLICY)
    await pool.fill([launch], None)
    return pool


async def _wait_ready(pool: StandbyPool) -> int:
    async with asyncio.timeout(30):
        while not (infos := pool.infos()) or infos[0].state != "ready":
            await asyncio.sleep(0.02)
    return infos[0].pid


async def test_a_hand_off_to_a_standby_that_does_not_read_is_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ready standby that stops reading (SIGSTOP: a debugger, the job's own kill) and a job
    environment larger than a socket's buffer: the hand-off gives up within HANDOFF_TIMEOUT
    and the worker starts cold, instead of waiting forever in sock_sendall."""
    monkeypatch.setattr(standby_mod, "HANDOFF_TIMEOUT", 1.0)
    big = {f"BIG{i}": "x" * 100_000 for i in range(4)}
    launch = _launch(tmp_path, big)
    pool = await _ready_pool(tmp_path, launch, ["json"])
    try:
        pid = await _wait_ready(pool)
        os.kill(pid, signal.SIGSTOP)
        r, w = os.pipe()
        try:
            started = time.monotonic()
            async with asyncio.timeout(15):  # without the bound: forever
                got = await pool.hand_off(
                    launch, None, stdout=w, stderr=w, stdin=None, containment=None
                )
            assert got is None
            assert time.monotonic() - started < 10
            assert "hand-off" in pool.cold[0]
            assert not _alive(pid)
        finally:
            os.close(r)
            os.close(w)
    finally:
        await pool.aclose()


async def test_a_cancelled_hand_off_leaves_no_standby(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The start is cancelled (the job is cancelled) while the hand-off waits for the
    standby's answer: the standby is no longer the pool's, so it must be killed right there,
    or it outlives the job (aclose does not know it)."""
    launch = _launch(tmp_path)
    pool = await _ready_pool(tmp_path, launch, ["json"])
    pid = await _wait_ready(pool)
    os.kill(pid, signal.SIGSTOP)  # it does not answer: the hand-off waits (HANDOFF_TIMEOUT)
    r, w = os.pipe()
    try:
        task = asyncio.create_task(
            pool.hand_off(launch, None, stdout=w, stderr=w, stdin=None, containment=None)
        )
        await asyncio.sleep(0.5)
        assert not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await pool.aclose()
        deadline = time.monotonic() + 5
        while _alive(pid) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        alive = _alive(pid)
    finally:
        os.close(r)
        os.close(w)
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    assert not alive, "the standby outlived its pool's close"


async def _warm_run(tmp_path: Path, launch: WorkerLaunch, before: object = None) -> tuple[int, str]:
    """Hand ``launch`` to a ready standby; its exit code and its stderr."""
    pool = await _ready_pool(tmp_path, launch, ["json"])
    try:
        await _wait_ready(pool)
        if callable(before):
            before()
        r, w = os.pipe()
        try:
            process = await pool.hand_off(
                launch, None, stdout=w, stderr=w, stdin=None, containment=None
            )
        finally:
            os.close(w)
        assert process is not None, pool.cold
        code = await process.wait()
        with os.fdopen(r, "rb") as f:
            return code, f.read().decode()
    finally:
        await pool.aclose()


def _cold_run(launch: WorkerLaunch) -> tuple[int, str]:
    import subprocess

    done = subprocess.run(
        list(launch.argv), cwd=launch.cwd, env=dict(launch.env), capture_output=True, check=False
    )
    return done.returncode, done.stderr.decode()


async def test_a_script_that_cannot_be_opened_exits_as_a_cold_start_would(
    tmp_path: Path,
) -> None:
    """The script is gone by the restart: ``python x.py`` exits 2 saying it cannot open it;
    the warm worker must too (not 1, with the standby's frames in a traceback)."""
    launch = _launch(tmp_path)
    script = Path(launch.argv[1])
    warm = await _warm_run(tmp_path, launch, script.unlink)
    cold = _cold_run(launch)
    assert cold[0] == 2
    assert warm == cold


async def test_a_script_with_a_syntax_error_fails_as_a_cold_start_would(tmp_path: Path) -> None:
    launch = _launch(tmp_path)
    script = Path(launch.argv[1])
    warm = await _warm_run(tmp_path, launch, lambda: script.write_text("def (\n"))
    cold = _cold_run(launch)
    assert cold[0] == 1
    assert warm == cold


async def test_a_cancelled_standby_start_leaks_no_descriptor_of_the_daemon(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fill cancelled during the standby's start (the job ends): the daemon's end of the
    control socket is closed, not left open until garbage collection."""

    async def cancelled(*_args: object, **_kwargs: object) -> None:
        raise asyncio.CancelledError

    monkeypatch.setattr(standby_mod, "start_process", cancelled)
    launch = _launch(tmp_path)
    pool = StandbyPool("j", ["json"], DEFAULT_POLICY)
    before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(asyncio.CancelledError):
        await pool.fill([launch], None)
    after = set(os.listdir("/proc/self/fd"))
    await pool.aclose()
    assert after - before == set()


async def test_a_standby_still_importing_is_never_waited_for(tmp_path: Path) -> None:
    """A rank whose standby is not ready starts cold at once (issue 40): the hand-off returns
    within a small bound, says why, and the standby (its kill, reap) ends all the same."""
    (tmp_path / "stuck_mod.py").write_text("import time\ntime.sleep(600)\n")
    launch = _launch(tmp_path)
    pool = await _ready_pool(tmp_path, launch, ["stuck_mod"])
    (pid,) = (info.pid for info in pool.infos())
    r, w = os.pipe()
    try:
        started = time.monotonic()
        async with asyncio.timeout(10):
            got = await pool.hand_off(
                launch, None, stdout=w, stderr=w, stdin=None, containment=None
            )
        took = time.monotonic() - started
        assert got is None
        assert took < 0.5, took  # no wait on it: a cold start would be as long as a spawn
        assert "still importing" in pool.cold[0] and "at once" in pool.cold[0], pool.cold
        assert pool.infos() == []
        await pool.aclose()  # awaits the dropped standby's end
        assert not _alive(pid)
    finally:
        os.close(r)
        os.close(w)
        await pool.aclose()


@pytest.mark.parametrize(
    ("age", "observed", "words"),
    [
        (0.4, [], "still importing (0.4 s after it started): the worker started cold at once"),
        (1.0, [2.0, 3.5], "(1.0 s after it started; imports here took 3.5 s at most)"),
    ],
)
def test_a_cold_start_past_a_standby_still_importing_says_so(
    age: float, observed: list[float], words: str
) -> None:
    assert words in standby_mod.still_importing(age, observed)


@pytest.mark.parametrize(
    ("spare", "wanted", "warm", "pinged", "age", "observed", "wait"),
    [
        # A node without a spare CPU per standby (this 2-core one): after the imports.
        (0, 2, False, False, 0.0, [], 5.0),  # a first attempt: its workers import first
        (0, 2, False, False, 2.0, [], 3.0),
        (0, 2, False, False, 6.0, [], 0.0),  # past the bound, pings or not
        (1, 2, False, False, 0.0, [], 5.0),  # one spare CPU is not one per standby
        (-3, 2, False, False, 0.0, [], 5.0),  # more workers than CPUs
        (0, 2, False, True, 0.0, [], 0.0),  # every worker pinged: past its imports
        (0, 2, True, False, 0.0, [], 0.0),  # every worker took over a standby: nothing to import
        (0, 2, False, False, 0.0, [2.0], 4.0),  # as long as an import took: 2 s x 1.5 + 1 s
        (0, 2, False, False, 1.0, [2.0, 4.0], 6.0),  # the slowest counts
        (0, 2, False, False, 0.0, [1000.0], 30.0),  # never past MAX_FILL_AFTER_S
        (0, 2, True, True, 0.0, [9.0], 0.0),
        # A spare CPU for each (a GPU node's dozens): with the workers, ready for an early crash.
        (2, 2, False, False, 0.0, [], 0.0),
        (40, 8, False, False, 0.0, [9.0], 0.0),
        (40, 8, True, False, 0.0, [], 0.0),
    ],
)
def test_standbys_start_with_the_workers_only_beside_spare_cpus(
    spare: int,
    wanted: int,
    warm: bool,
    pinged: bool,
    age: float,
    observed: list[float],
    wait: float,
) -> None:
    """A cold attempt's standbys start at once with a spare CPU each; else they wait for its
    workers' first pings or an import's time."""
    got = standby_mod.fill_wait(
        spare_cpus=spare, wanted=wanted, warm=warm, pinged=pinged, age=age, observed=observed
    )
    assert got == pytest.approx(wait)


STANDBY_RELEASE = """
import asyncio, ctypes, os, subprocess, sys, time
from elasticd.supervise.cgroup import STANDBY_MARKER, AttemptContainment
from elasticd.supervise.sweep import own_children, start_time_of

async def main():
    assert ctypes.CDLL(None).prctl(36, 1, 0, 0, 0) == 0  # a subreaper, as the daemon
    base = {"ELASTICD_JOB_ID": "j1", "PATH": "/bin:/usr/bin"}
    # The running attempt's orphan, and one a standby's imports left (both re-parented here).
    for env in ({**base, "ELASTICD_ATTEMPT": "a3"}, {**base, STANDBY_MARKER: "m1"}):
        subprocess.run(["/bin/sh", "-c", "sleep 1000 >/dev/null 2>&1 &"], env=env, check=True)
    deadline = time.monotonic() + 10
    while len(own_children()) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    def env_of(pid):
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read()
    found = {pid: env_of(pid) for pid in own_children()}
    attempt = next(p for p, e in found.items() if b"ELASTICD_ATTEMPT=a3" in e)
    standby = next(p for p, e in found.items() if b"=m1" in e)
    release = AttemptContainment(cgroup=None, job_id="j1", attempt_tag=None, marker="m1")
    killed = await release.stop(())
    print(sorted(killed) == [standby], start_time_of(attempt) is not None, flush=True)
    os.kill(attempt, 9)
    os.waitpid(attempt, 0)

asyncio.run(main())
"""


def test_a_standbys_release_kills_its_own_strays_not_the_running_attempts(tmp_path) -> None:
    """Under the subreaper, a standby that dies (or is replaced) takes with it what its
    imports left (marked with its token), never an orphan of the attempt that runs."""
    out = subprocess.run(
        [sys.executable, "-c", STANDBY_RELEASE],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True"], out.stdout + out.stderr
