"""The containment decisions, as tables; and the cgroup mechanics on a real cgroup v2 (root)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Collection, Iterator
from pathlib import Path

import pytest

from elasticd.errors import WorkerSpawnError
from elasticd.supervise.cgroup import (
    MOVE_BUDGET,
    PR_SET_CHILD_SUBREAPER,
    AttemptContainment,
    AttemptName,
    Cgroup,
    Containment,
    ContainmentChoice,
    attempt_name,
    cgroup2_mount,
    containment_fix,
    leftovers,
    own_cgroup,
    parse_attempt_name,
    partial_log_level,
    strays,
    subtree_name,
    zombies_to_reap,
)
from elasticd.supervise.spawn import SpawnPolicy, find_perl, live_children, start_process
from elasticd.supervise.sweep import own_children
from tests.supervise.forker import FORKER, v1_pids_cgroup

HYBRID = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
PURE_V2 = "29 23 0:26 / /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"
NONE = "22 1 0:21 / /proc rw - proc proc rw\n"
ESCAPED = r"41 31 0:38 / /mnt/my\040cgroups rw - cgroup2 none rw" + "\n"


@pytest.mark.parametrize(
    ("mountinfo", "mount"),
    [
        (HYBRID, "/sys/fs/cgroup/unified"),
        (PURE_V2, "/sys/fs/cgroup"),
        (NONE, None),
        (ESCAPED, "/mnt/my cgroups"),
    ],
)
def test_the_cgroup2_mount_is_read_from_mountinfo(mountinfo: str, mount: str | None) -> None:
    """Hybrid and pure-v2 hosts, none, and an escaped path."""
    assert cgroup2_mount(mountinfo) == mount


@pytest.mark.parametrize(
    ("text", "path"),
    [
        ("9:name=systemd:/\n4:memory:/x\n0::/\n", "/"),
        ("0::/system.slice/elasticd.service\n", "/system.slice/elasticd.service"),
        ("4:memory:/x\n", None),
    ],
)
def test_the_daemon_s_cgroup_is_its_0_line(text: str, path: str | None) -> None:
    """Only the v2 line counts: the root on a hybrid host, the unit's cgroup under systemd."""
    assert own_cgroup(text) == path


def test_attempt_names_round_trip_and_nothing_else_parses() -> None:
    """A name made for an attempt gives back its job and attempt; other names are not ours."""
    name = attempt_name("job.1-x", 3, "0a1b2c3d")
    assert parse_attempt_name(name) == AttemptName(name, "job.1-x", 3)
    assert parse_attempt_name(attempt_name("j", None, "0a1b2c3d")) == AttemptName(
        "a-.0a1b2c3d.j", "j", None
    )
    for other in ("cgroup.procs", "probe.0a1b2c3d", "a1.xyz.job", "a1.0a1b2c3d.", "daemon"):
        assert parse_attempt_name(other) is None, other


def test_leftovers_are_the_attempt_cgroups_not_live() -> None:
    """The sweep's choice: attempt cgroups not in use; foreign folders are left alone."""
    live = attempt_name("b", 0, "00000001")
    dead = [attempt_name("a", 0, "00000002"), attempt_name("c", 7, "00000003")]
    found = leftovers([live, *dead, "daemon", "probe.00000004"], {live})
    assert [f.name for f in found] == sorted(dead)
    assert [(f.job_id, f.attempt) for f in found] == [("a", 0), ("c", 7)]
    assert leftovers([], set()) == []


@pytest.mark.parametrize(
    ("members", "groups", "expected"),
    [
        ({}, {10}, []),
        ({10: 10, 11: 10}, {10}, []),  # the worker and its own children: not strays
        ({10: 10, 12: 12, 13: 12}, {10}, [12, 13]),  # a session of its own, and its child
        ({12: None}, {10}, []),  # gone meanwhile
        ({14: 14}, set(), [14]),
    ],
)
def test_strays_are_what_left_the_worker_groups(
    members: dict[int, int | None], groups: set[int], expected: list[int]
) -> None:
    """Processes still in a worker's process group were killed with it; the rest are strays."""
    assert strays(members, groups) == expected


def test_the_subtree_is_stable_per_node_and_state_folder() -> None:
    """A restarted daemon (same node, same state folder) finds its subtree; another does not."""
    assert subtree_name("n0", "/var/lib/e") == subtree_name("n0", "/var/lib/e")
    assert subtree_name("n0", "/var/lib/e") != subtree_name("n0", "/var/lib/f")
    assert subtree_name("n0", "/var/lib/e") != subtree_name("n1", "/var/lib/e")


def _writable_cgroup2() -> bool:
    try:
        Containment.setup("cgroup", node="unit-probe", state_dir=Path("/nonexistent-x")).close()
    except OSError:
        return False
    return True


NEEDS_CGROUPS = pytest.mark.skipif(
    os.geteuid() != 0 or not _writable_cgroup2(), reason="needs root and a writable cgroup v2"
)


@NEEDS_CGROUPS
def test_the_freezer_fallback_kills_every_member(tmp_path: Path) -> None:
    """Without cgroup.kill (kernels < 5.14): freeze, SIGKILL each pid of cgroup.procs, thaw."""
    containment = Containment.setup("cgroup", node="unit-freeze", state_dir=tmp_path)
    assert containment.base is not None
    cgroup = Cgroup(containment.base / attempt_name("j", 0, "00000009"))
    cgroup.path.mkdir()
    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(3)]
    try:
        for proc in procs:
            (cgroup.path / "cgroup.procs").write_text(str(proc.pid))
        assert sorted(cgroup.pids()) == sorted(p.pid for p in procs)
        cgroup._kill_frozen()
        assert [p.wait(10) for p in procs] == [-9, -9, -9]
        assert not cgroup.populated()
        assert cgroup.remove()
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        cgroup.remove()
        containment.close()
    assert not containment.base.exists()


def _leads(pid: int) -> bool:
    try:
        return os.getsid(pid) == pid
    except ProcessLookupError:
        return False


@NEEDS_CGROUPS
async def test_a_hand_over_moves_every_member_and_removes_the_folder(tmp_path: Path) -> None:
    """A standby's cgroup with it and a child in a session of its own, forking on: every
    member moves into the attempt's cgroup, the standby's folder goes, and the attempt's
    stop then kills them all. (The budget is the maximum: what the move may take is the
    tests below; one write may wait a few hundred ms on a loaded machine.)"""
    containment = Containment.setup(
        "cgroup", node="unit-handover", state_dir=tmp_path, move_budget=5.0
    )
    standby = containment.open_attempt("h", None, None)
    attempt = containment.open_attempt("h", 1, None)
    assert standby.procs_fd is not None and standby.cgroup is not None
    assert attempt.cgroup is not None
    forker = (  # a helper that keeps forking (short-lived children) while it is moved
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    while True:\n"
        "        pid = os.fork()\n"
        "        if pid == 0: time.sleep(0.01); os._exit(0)\n"
        "        os.waitpid(pid, 0)\n"
        "time.sleep(60)\n"
    )
    proc = await start_process(
        [sys.executable, "-c", forker], dict(os.environ), identity=None,
        cgroup_procs=standby.procs_fd,
    )  # fmt: skip
    try:
        helpers: list[int] = []
        async with asyncio.timeout(20):  # the helper: the member leading a session of its own
            while not helpers:
                helpers = [p for p in standby.cgroup.pids() if p != proc.pid and _leads(p)]
                await asyncio.sleep(0.01)
        standby.hand_over(attempt)
        assert standby.stopped and standby.procs_fd is None
        assert not standby.cgroup.path.exists()
        assert {proc.pid, *helpers} <= set(attempt.cgroup.pids())
        assert (attempt.cgroup.path / "cgroup.freeze").read_text().strip() == "0"
        # Frozen for the move, thawed where they land: the helper forks on in its new cgroup.
        seen = set(attempt.cgroup.pids())
        async with asyncio.timeout(10):
            while set(attempt.cgroup.pids()) <= seen:
                await asyncio.sleep(0.01)
        await attempt.stop([proc.pid])
        assert await asyncio.wait_for(proc.wait(), 10) == -9
        assert not attempt.cgroup.path.exists()
    finally:  # the process is in one of the two: their stops kill it
        await standby.stop(())
        await attempt.stop(())
        await asyncio.wait_for(proc.wait(), 10)
        containment.close()


CHAINS = 16
#: Sleepers beside the chains where a test needs members that stay where they are.
SLEEPERS = 8
#: How long the real-clock test gives the chains to outrun a move (one try takes ~0.15 s).
ROUNDS_FOR = 10.0
#: What a move may take past its budget: the one write under way when the budget ran out
#: (a write to cgroup.procs may wait for the forks under way and an RCU grace period:
#: seen up to 0.47 s on a loaded 2-core machine), the kills of what it moved, two reads.
MOVE_MARGIN = 0.6


@contextlib.contextmanager
def _pids_bound(limit: int, base: Path, *cgroups: Cgroup) -> Iterator[Path | None]:
    """A pids.max over everything a forker starts, or a skip: each cgroup's own (v2, the
    pids controller enabled in ``base``), and on a hybrid host (v2's controllers bound to
    v1) a cgroup of v1's pids hierarchy that the forker joins (its ``cgroup.procs``)."""
    with contextlib.suppress(OSError):
        (base / "cgroup.subtree_control").write_text("+pids")
    bounded = all((c.path / "pids.max").exists() for c in cgroups)
    for cgroup in cgroups if bounded else ():
        (cgroup.path / "pids.max").write_text(str(limit))
    with v1_pids_cgroup(limit) as procs:
        if procs is None and not bounded:
            pytest.skip("no pids controller to bound the forker with")
        yield procs


@contextlib.contextmanager
def _reaping(known: Callable[[], Collection[int]]) -> Iterator[None]:
    """The test as a child subreaper: a forker's orphans, killed with the subreaper that
    reaped them, come to it (not to a pid 1 that may not reap) and are reaped at the end."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    try:
        yield
    finally:
        libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
        deadline = time.monotonic() + 20
        while (orphans := own_children() - set(known())) and time.monotonic() < deadline:
            for pid in orphans:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)
            time.sleep(0.01)


def _thaw_until(stop: threading.Event, *cgroups: Cgroup) -> None:
    """What a kernel without a freezer looks like: every freeze undone at once."""
    while not stop.is_set():
        for cgroup in cgroups:
            with contextlib.suppress(OSError):
                (cgroup.path / "cgroup.freeze").write_text("0")


@contextlib.contextmanager
def _thawed(*cgroups: Cgroup | None) -> Iterator[None]:
    """:func:`_thaw_until` on a thread of its own for the block."""
    stop = threading.Event()
    thawing = threading.Thread(target=_thaw_until, args=(stop, *filter(None, cgroups)))
    thawing.start()
    try:
        yield
    finally:
        stop.set()
        thawing.join()


Forked = tuple[AttemptContainment, AttemptContainment, asyncio.subprocess.Process]


@contextlib.asynccontextmanager
async def _forker_in_a_standby(
    tmp_path: Path, chains: int, sleepers: int = 0
) -> AsyncIterator[Forked]:
    """A standby's cgroup and an attempt's, and FORKER running in the standby's with
    ``chains`` chains and ``sleepers`` sleepers (all started), under a pids.max. At the end
    both are stopped, the forker reaped, and neither folder is left."""
    perl = find_perl()
    if perl is None:
        pytest.skip("no perl for the forker")
    containment = Containment.setup("cgroup", node="unit-forker", state_dir=tmp_path)
    assert containment.base is not None
    standby = containment.open_attempt("f", None, None)
    attempt = containment.open_attempt("f", 1, None)
    assert standby.cgroup is not None and attempt.cgroup is not None
    run = tmp_path / "run"
    run.touch()
    proc: asyncio.subprocess.Process | None = None
    known = lambda: () if proc is None else (proc.pid,)  # noqa: E731 - asyncio reaps it
    bound = _pids_bound(1024, containment.base, standby.cgroup, attempt.cgroup)
    with bound as pids_procs, _reaping(known):  # reaped first, then the bound emptied
        try:
            proc = await start_process(
                [sys.executable, "-I", "-c", FORKER, str(pids_procs or ""), str(run), perl,
                 str(chains), str(sleepers)],
                dict(os.environ), identity=None, cgroup_procs=standby.procs_fd,
            )  # fmt: skip
            async with asyncio.timeout(30):  # every chain and sleeper started
                while len(standby.cgroup.pids()) <= chains + sleepers:
                    await asyncio.sleep(0.01)
            yield standby, attempt, proc
        finally:
            run.unlink(missing_ok=True)
            await standby.stop(())
            await attempt.stop(())
            if proc is not None:
                await asyncio.wait_for(proc.wait(), 10)
            containment.close()
    assert not standby.cgroup.path.exists() and not attempt.cgroup.path.exists()


def _budget_out_after(writes: int) -> Callable[[], float]:
    """A clock for ``move_all`` with a budget of 1 s: its start and the looks before its
    first ``writes`` writes read 0, every later look 10. The budget runs out after exactly
    that many writes, however fast the machine moves them."""
    looks = itertools.count()
    return lambda: 0.0 if next(looks) <= writes else 10.0


@NEEDS_CGROUPS
async def test_a_move_that_members_outrun_gives_up_within_its_budget(tmp_path: Path) -> None:
    """No freezer that holds, members that fork without end, the real clock: each move
    returns within MOVE_BUDGET plus a margin, and one given up says not done while members
    still arrive; the stops kill and remove all that is left. Whether the forks outrun a
    move is the machine's to decide (a loaded one keeps the chains off the CPU, a fast one
    may move every chain at once): a move that wins is timed too, and the next goes back,
    for ROUNDS_FOR at most; if every move won, the test still passes. The give-up itself
    is shown whatever the machine by the next test, on a scripted clock."""
    gave_up = False
    async with _forker_in_a_standby(tmp_path, CHAINS) as (standby, attempt, proc):
        with _thawed(standby.cgroup, attempt.cgroup):
            source, target, took = standby, attempt, []
            rounds_end = time.monotonic() + ROUNDS_FOR
            while not gave_up and time.monotonic() < rounds_end:
                assert source.cgroup is not None and target.cgroup is not None
                assert target.procs_fd is not None
                start = time.monotonic()
                move = source.cgroup.move_all(target.cgroup, target.procs_fd)
                took.append(time.monotonic() - start)
                assert took[-1] < MOVE_BUDGET + MOVE_MARGIN, took
                gave_up = not move.done
                if gave_up:
                    assert move.left > 0, move
                else:
                    assert not source.cgroup.pids()
                    source, target = target, source
                    await asyncio.sleep(0.05)
        assert source.cgroup is not None
        await source.stop(())  # the standby's stop: what is left goes, and its folder
        assert not source.cgroup.path.exists()
        await target.stop(())  # what the moved ones forked before the give-up killed them
        assert await asyncio.wait_for(proc.wait(), 10) == -9


@NEEDS_CGROUPS
async def test_a_move_given_up_among_forking_members_leaves_them_to_the_stops(
    tmp_path: Path,
) -> None:
    """No freezer that holds, members that fork without end, and a budget that runs out
    after 4 writes (a scripted clock): the move says not done, with the members it did not
    reach still in the standby's cgroup; the standby's stop kills and removes them, the
    attempt's what the moved ones forked there before the give-up killed them."""
    async with _forker_in_a_standby(tmp_path, CHAINS, SLEEPERS) as (standby, attempt, proc):
        assert standby.cgroup is not None and attempt.cgroup is not None
        assert attempt.procs_fd is not None
        with _thawed(standby.cgroup, attempt.cgroup):
            move = standby.cgroup.move_all(
                attempt.cgroup, attempt.procs_fd, budget=1.0, clock=_budget_out_after(4)
            )
        # At most 4 of the forker and its sleepers moved: the others cannot have left.
        assert not move.done and move.moved <= 4 and move.left >= SLEEPERS + 1 - 4, move
        await standby.stop(())
        assert not standby.cgroup.path.exists()
        await attempt.stop(())
        assert not attempt.cgroup.path.exists()
        assert await asyncio.wait_for(proc.wait(), 10) == -9


@NEEDS_CGROUPS
async def test_a_move_given_up_leaves_nothing_in_the_target(tmp_path: Path) -> None:
    """With a freezer that holds, a budget that runs out after 20 of 51 members (a scripted
    clock): the move gives up, kills the 20 it moved (frozen where they landed: they started
    nothing there), so the target is left as it was (empty, thawed), the other 31 are still
    in the source, and the standby's stop kills them."""
    async with _forker_in_a_standby(tmp_path, 0, 50) as (standby, attempt, proc):
        assert standby.cgroup is not None and attempt.cgroup is not None
        assert attempt.procs_fd is not None
        members = set(standby.cgroup.pids())
        assert len(members) == 51  # the forker and its sleepers, none of which forks
        move = standby.cgroup.move_all(
            attempt.cgroup, attempt.procs_fd, budget=1.0, clock=_budget_out_after(20)
        )
        assert (move.done, move.moved, move.left) == (False, 20, 31), move
        async with asyncio.timeout(10):  # SIGKILLed: gone from the target
            while attempt.cgroup.pids():
                await asyncio.sleep(0.01)
        assert (attempt.cgroup.path / "cgroup.freeze").read_text().strip() == "0"
        left = set(standby.cgroup.pids())
        assert len(left) == 31 and left <= members
        await standby.stop(())
        assert not standby.cgroup.path.exists()
        assert await asyncio.wait_for(proc.wait(), 10) == -9


@NEEDS_CGROUPS
async def test_the_sweep_kills_and_removes_leftover_attempts(tmp_path: Path) -> None:
    """An attempt cgroup left with a process in it (a killed daemon's): killed, reported, gone."""
    containment = Containment.setup("cgroup", node="unit-sweep", state_dir=tmp_path)
    attempt = containment.open_attempt("left", 2, None)
    assert attempt.procs_fd is not None
    proc = await start_process(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        dict(os.environ),
        identity=None,
        cgroup_procs=attempt.procs_fd,
    )
    try:
        os.close(attempt.procs_fd)
        assert attempt.cgroup is not None and attempt.cgroup.pids() == [proc.pid]
        found = containment.sweep()
        assert [(f.name.job_id, f.name.attempt, f.pids) for f in found] == [
            ("left", 2, (proc.pid,))
        ]
        assert await asyncio.wait_for(proc.wait(), 10) == -9
        assert not attempt.cgroup.path.exists()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        attempt.cgroup.stop_now()  # a no-op when the test got that far
        containment.close()
    assert proc.pid not in live_children()


@NEEDS_CGROUPS
async def test_a_cgroup_that_cannot_be_joined_fails_the_start_clearly(tmp_path: Path) -> None:
    """The stage reports a failed join on the verdict pipe: a WorkerSpawnError, no process."""
    containment = Containment.setup("cgroup", node="unit-join", state_dir=tmp_path)
    attempt = containment.open_attempt("gone", 0, None)
    assert attempt.cgroup is not None and attempt.procs_fd is not None
    attempt.cgroup.remove()  # the descriptor now names a removed cgroup
    try:
        with pytest.raises(WorkerSpawnError, match="cannot join its cgroup"):
            await start_process(
                ["true"], dict(os.environ), identity=None, cgroup_procs=attempt.procs_fd
            )
    finally:
        os.close(attempt.procs_fd)
        containment.close()


def test_forced_cgroup_without_a_cgroup2_mount_raises(tmp_path: Path) -> None:
    """containment = cgroup where none can be made: OSError (the daemon refuses to start)."""
    fake = tmp_path / "proc"
    fake.mkdir()
    (fake / "mountinfo").write_text(NONE)
    (fake / "cgroup").write_text("0::/\n")
    with pytest.raises(OSError, match="no cgroup2"):
        Containment.setup("cgroup", node="n", state_dir=tmp_path, proc=fake)


def test_auto_without_cgroups_falls_back_to_a_subreaper(tmp_path: Path) -> None:
    """containment = auto where no cgroup2 is mounted: the daemon becomes a child subreaper
    (checked in a child process, which it changes for good), and says why."""
    fake = tmp_path / "proc"
    fake.mkdir()
    (fake / "mountinfo").write_text(NONE)
    (fake / "cgroup").write_text("0::/\n")
    code = (
        "import sys; from pathlib import Path; from elasticd.supervise.cgroup import Containment\n"
        f"c = Containment.setup('auto', node='n', state_dir=Path({str(tmp_path)!r}), "
        f"proc=Path({str(fake)!r}))\n"
        "print(c.mode, c.partial, c.reason)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=30
    ).stdout
    assert out.split(" ", 2)[:2] == ["subreaper", "True"]
    assert "no cgroup2" in out
    probe = (
        "import ctypes; from pathlib import Path\n"
        "from elasticd.supervise.cgroup import Containment\n"
        f"Containment.setup('subreaper', node='n', state_dir=Path({str(tmp_path)!r}))\n"
        "v = ctypes.c_int(); ctypes.CDLL(None).prctl(37, ctypes.byref(v), 0, 0, 0)\n"
        "print(v.value)\n"
    )
    flag = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=30
    ).stdout
    assert flag.strip() == "1"  # PR_GET_CHILD_SUBREAPER


def _own_status() -> str:
    return Path("/proc/self/status").read_text()


def _ignored(status: str) -> int:
    return int(next(x for x in status.splitlines() if x.startswith("SigIgn:")).split()[1], 16)


def _status_and_environ(pid: int) -> tuple[str, dict[str, str]]:
    raw = Path(f"/proc/{pid}/environ").read_text()
    environ = dict(item.split("=", 1) for item in raw.split("\0") if item)
    return Path(f"/proc/{pid}/status").read_text(), environ


STAGES = pytest.mark.parametrize("stage", [True, False], ids=["perl-stage", "python-stage"])


@NEEDS_CGROUPS
@STAGES
@pytest.mark.parametrize("setpriv", [True, False], ids=["through-setpriv", "python-only"])
@pytest.mark.parametrize("groups", [(), (4, 20)], ids=["no-groups", "two-groups"])
async def test_a_process_is_born_in_its_cgroup_as_the_job_user_with_the_job_env(
    tmp_path: Path, setpriv: bool, stage: bool, groups: tuple[int, ...]
) -> None:
    """The root stage (Perl, or Python where Perl is missing) joins the cgroup, switches to
    nobody (real, effective and saved ids, exactly the supplementary groups) and hands over
    exactly the job's environment, with setpriv for the parent-death signal or without it."""
    if stage and find_perl() is None:
        pytest.skip("no usable perl here: the Python stage is the one used")
    import pwd

    from elasticd.security import Identity

    nobody = pwd.getpwnam("nobody")
    identity = Identity(
        user="nobody", uid=nobody.pw_uid, gid=nobody.pw_gid, home=nobody.pw_dir, groups=groups
    )
    containment = Containment.setup("cgroup", node="unit-stage", state_dir=tmp_path)
    attempt = containment.open_attempt("stage", 0, None)
    assert attempt.cgroup is not None and attempt.procs_fd is not None
    env = {"PATH": "/usr/bin:/bin", "MARKER": "a=b c\nd", "EMPTY": "", "X": "=\u00e9"}
    proc = await start_process(
        ["sleep", "60"],
        env,
        identity=identity,
        cgroup_procs=attempt.procs_fd,
        policy=SpawnPolicy(setpriv=setpriv, stage=stage),
    )
    try:
        assert attempt.cgroup.pids() == [proc.pid]
        status, environ = _status_and_environ(proc.pid)
        u, g = nobody.pw_uid, nobody.pw_gid
        assert f"Uid:\t{u}\t{u}\t{u}\t{u}\n" in status
        assert f"Gid:\t{g}\t{g}\t{g}\t{g}\n" in status
        sup = next(line for line in status.splitlines() if line.startswith("Groups:"))
        assert sorted(int(x) for x in sup.split()[1:]) == sorted(groups)
        assert environ["MARKER"] == "a=b c\nd" and environ["USER"] == "nobody"
        assert environ["EMPTY"] == "" and environ["X"] == "=\u00e9"
        # Nothing of the stage's own: the daemon's inherited dispositions, less the two
        # Python ignores for itself (subprocess resets them for its children).
        assert _ignored(status) == _ignored(_own_status()) & ~(
            (1 << (signal.SIGPIPE - 1)) | (1 << (signal.SIGXFSZ - 1))
        )
        assert set(environ) <= {"PATH", "MARKER", "EMPTY", "X", "HOME", "USER", "LOGNAME", "PWD"}
        assert await attempt.stop(set()) == [proc.pid]  # not in a worker group: a stray
        assert await asyncio.wait_for(proc.wait(), 10) == -9
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        attempt.cgroup.stop_now()  # a no-op when the test got that far
        containment.close()


@NEEDS_CGROUPS
@STAGES
async def test_the_job_code_runs_in_its_cgroup_from_its_first_statement(
    tmp_path: Path, stage: bool
) -> None:
    """The program's very first look at /proc/self/cgroup already shows the attempt's cgroup
    (the root stage joined it before anything of the job ran)."""
    containment = Containment.setup("cgroup", node="unit-gate", state_dir=tmp_path)
    attempt = containment.open_attempt("gate", 0, None)
    assert attempt.cgroup is not None and attempt.procs_fd is not None
    out = tmp_path / "cgroup.txt"
    proc = await start_process(
        ["sh", "-c", f"cat /proc/self/cgroup > {out}"],
        {"PATH": "/usr/bin:/bin"},
        identity=None,
        cgroup_procs=attempt.procs_fd,
        policy=SpawnPolicy(stage=stage),
    )
    try:
        assert await asyncio.wait_for(proc.wait(), 10) == 0
        assert out.read_text().strip().endswith("/" + attempt.cgroup.path.name)
    finally:
        attempt.cgroup.stop_now()
        containment.close()


@NEEDS_CGROUPS
@STAGES
async def test_a_process_that_cannot_join_its_cgroup_never_runs_the_job(
    tmp_path: Path, stage: bool
) -> None:
    """When the process cannot join its cgroup (here: a cgroup.procs descriptor that refuses the
    write), the spawn fails clearly and nothing of the job has run."""
    marker = tmp_path / "ran"
    r, w = os.pipe()  # a read-only end: writing the pid to it fails (EBADF)
    try:
        with pytest.raises(WorkerSpawnError, match="cannot join its cgroup"):
            await start_process(
                ["sh", "-c", f"touch {marker}"],
                {"PATH": "/usr/bin:/bin"},
                identity=None,
                cgroup_procs=r,
                policy=SpawnPolicy(stage=stage),
            )
    finally:
        os.close(r)
        os.close(w)
    assert not marker.exists()
    assert not live_children()


@pytest.mark.skipif(find_perl() is None, reason="no usable perl here")
@pytest.mark.parametrize(
    ("env_write_only", "program", "verdict"),
    [
        (True, "/bin/sh", b"env\0EIO\0"),  # the environment cannot be read: nothing runs
        (False, "sh", b"exec\0ENOENT\0"),  # a bare name would be looked up on the job's PATH
    ],
)
def test_the_perl_stage_reports_a_failed_step_and_runs_nothing(
    tmp_path: Path, env_write_only: bool, program: str, verdict: bytes
) -> None:
    """Each step after the cgroup's reports its failure on the verdict pipe (a clear
    WorkerSpawnError for the daemon) and exits before anything of the job runs."""
    from elasticd.supervise.spawn import perl_stage

    stage = perl_stage()
    perl = find_perl()
    assert stage is not None and perl is not None
    marker = tmp_path / "ran"
    procs_r, procs_w = os.pipe()  # stands in for cgroup.procs: the join's write succeeds
    env_r, env_w = os.pipe()
    os.write(env_w, b"PATH=/usr/bin:/bin")
    os.close(env_w)
    env_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY) if env_write_only else env_r
    verdict_r, verdict_w = os.pipe()
    try:
        fds = (procs_w, env_fd)
        argv = [perl, "-e", stage, "--", str(procs_w), str(env_fd), str(os.getpid())]
        argv += ["-1", "-1", "", "", program, "sh", "-c", f"touch {marker}"]
        done = subprocess.run(argv, stdin=verdict_w, pass_fds=fds, env={}, timeout=30)
        os.close(verdict_w)
        verdict_w = -1
        assert os.read(verdict_r, 100) == verdict
        assert done.returncode == 127
        assert os.read(procs_r, 10) == b"0"
        assert not marker.exists()
    finally:
        for fd in (procs_r, procs_w, env_r, verdict_r, verdict_w):
            if fd >= 0:
                os.close(fd)
        if env_write_only:
            os.close(env_fd)


@pytest.mark.skipif(find_perl() is None, reason="no usable perl here")
def test_the_perl_stage_reads_as_its_name_in_ps(tmp_path: Path) -> None:
    """While the stage runs (here: held reading the job's environment), its command line and
    its comm read `elasticd-stage`, not the program's text; it then goes on as before."""
    from elasticd.supervise.spawn import perl_stage

    stage, perl = perl_stage(), find_perl()
    assert stage is not None and perl is not None
    marker = tmp_path / "ran"
    env_r, env_w = os.pipe()
    verdict_r, verdict_w = os.pipe()
    argv = [perl, "-e", stage, "--", "-1", str(env_r), str(os.getpid())]
    argv += ["-1", "-1", "", "", "/bin/sh", "sh", "-c", f"touch {marker}"]
    proc = subprocess.Popen(argv, stdin=verdict_w, pass_fds=(env_r,), env={})
    try:
        os.close(verdict_w)
        verdict_w = -1
        deadline = time.monotonic() + 10
        # Until the exec and the name's write are done, /proc shows this process's command
        # line, then perl's with the program, then the name.
        name = b"elasticd-stage\0"
        while not (cmdline := Path(f"/proc/{proc.pid}/cmdline").read_bytes()).startswith(name):
            assert time.monotonic() < deadline, cmdline
            time.sleep(0.005)
        assert b"syscall" not in cmdline
        assert Path(f"/proc/{proc.pid}/comm").read_text() == "elasticd-stage\n"
        os.write(env_w, b"PATH=/usr/bin:/bin")
        os.close(env_w)
        env_w = -1
        assert proc.wait(30) == 0 and marker.exists()
        assert os.read(verdict_r, 100) == b""  # EOF, no verdict: it started
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for fd in (env_r, env_w, verdict_r, verdict_w):
            if fd >= 0:
                os.close(fd)


def _cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


@STAGES
async def test_the_root_stage_of_a_start_reads_as_its_name_in_ps(
    tmp_path: Path, stage: bool
) -> None:
    """A start through the root stage (Perl, or the Python fallback it is forced to here), held
    at its cgroup join: its command line is short and names `elasticd-stage` (neither
    stage's program text nor the resolver's shows); let go, the program runs."""
    if stage and find_perl() is None:
        pytest.skip("no usable perl here: the Python stage is the one used")
    marker = tmp_path / "ran"
    procs_r, procs_w = os.pipe()  # stands in for cgroup.procs: a full pipe holds the join
    os.set_blocking(procs_w, False)
    with contextlib.suppress(BlockingIOError):
        while os.write(procs_w, b"x" * 65536):
            pass
    os.set_blocking(procs_w, True)
    before = live_children()
    start = asyncio.create_task(
        start_process(
            ["sh", "-c", f"touch {marker}"],
            {"PATH": "/usr/bin:/bin"},
            identity=None,
            cgroup_procs=procs_w,
            policy=SpawnPolicy(stage=stage),
        )
    )
    try:
        async with asyncio.timeout(10):
            while not (pids := live_children() - before):
                await asyncio.sleep(0.005)
        (pid,) = pids
        # Perl names itself as its first statement; until then /proc shows perl's own line.
        deadline = time.monotonic() + 10
        while b"elasticd-stage\0" not in (cmdline := _cmdline(pid)):
            assert time.monotonic() < deadline, cmdline[:200]
            await asyncio.sleep(0.005)
        shown = cmdline.replace(b"\0", b" ").strip()  # what ps shows (Perl pads with spaces)
        assert len(shown) < len(sys.executable) + 64, shown
        assert b"import" not in shown and b"syscall" not in shown and b"exec" not in shown
        os.set_blocking(procs_r, False)
        with contextlib.suppress(BlockingIOError):
            while os.read(procs_r, 65536):
                pass
        async with asyncio.timeout(10):
            proc = await start
            assert await proc.wait() == 0
        assert marker.exists()
    finally:
        start.cancel()
        with contextlib.suppress(BaseException):
            await start
        os.close(procs_r)
        os.close(procs_w)


@pytest.mark.parametrize(
    ("zombies", "before", "known", "reaped"),
    [
        ({5}, set(), set(), set()),  # a new zombie: its own waiter may not have run yet
        ({5}, {5}, set(), {5}),  # a zombie for a whole interval: nobody waits for it
        ({5, 6}, {5, 6}, {6}, {5}),  # 6 is the daemon's own: asyncio takes its status
        ({6}, {5}, set(), set()),  # 5 was reaped meanwhile, 6 is new
        (set(), {5}, set(), set()),
    ],
)
def test_zombies_to_reap(
    zombies: set[int], before: set[int], known: set[int], reaped: set[int]
) -> None:
    """Only a zombie seen at two looks in a row, and not one the daemon started, is reaped."""
    assert zombies_to_reap(zombies, before, known) == reaped


async def test_a_daemon_without_cgroups_says_so_once_with_the_fix(tmp_path: Path) -> None:
    """Partial containment is the daemon's, not each job's: its first group carries the
    reason and the fix (for the ``containment.partial`` event), every later group nothing."""
    from elasticd.supervise import WorkerGroupProcesses, WorkerLaunch

    containment = Containment("subreaper", reason="EACCES on /sys/fs/cgroup")
    containment.fix = containment_fix("auto", 1000)
    policy = SpawnPolicy(containment=containment)
    said = []
    for job in ("first", "second"):
        launch = WorkerLaunch(0, ["/bin/true"], {"PATH": "/usr/bin:/bin"}, None, tmp_path / job)
        group = await WorkerGroupProcesses.start([launch], policy=policy)
        said.append(group.containment_partial)
        await group.stop(5.0)
    assert said[1] is None, said
    assert said[0] is not None and said[0].startswith("EACCES on /sys/fs/cgroup; "), said
    assert "Delegate=yes" in said[0], said


@pytest.mark.parametrize(
    ("choice", "euid", "level", "fix"),
    [
        ("auto", 0, "WARNING", "Delegate=yes"),
        ("auto", 1000, "INFO", "delegated to its user"),
        ("subreaper", 0, "INFO", 'containment = "auto"'),
    ],
)
def test_no_cgroups_is_a_warning_only_where_they_were_expected(
    choice: ContainmentChoice, euid: int, level: str, fix: str
) -> None:
    """A root daemon on `auto` expected cgroups (a warning); a user's daemon cannot have them
    and `subreaper` was chosen (info); each says what would give the attempts cgroups."""
    import logging

    assert logging.getLevelName(partial_log_level(choice, euid)) == level
    assert fix in containment_fix(choice, euid)
