"""``elasticd run --nnodes`` inside a real Slurm step (issue 38, form 1), on 3 namespaced nodes.

The cluster is :class:`tests.e2e.slurm_cluster.SlurmCluster` (slurmctld, a
slurmd per node, munge); the workers are tiny Python scripts that write a note
per start, so the test sees every attempt on every node.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT
from tests.e2e.slurm_cluster import KILL_WAIT, SlurmCluster, require_slurm
from tests.store.etcd_server import EtcdProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(200)]

#: The job's ``--termination-grace``: well under the cluster's KillWait, so that a worker
#: gone within it was stopped by elasticd, not by Slurm's SIGKILL.
GRACE = 2

#: Each start of a worker writes a line ``{"node", "rank", "restart", "pid"}`` to the notes
#: file; rank 1 of the first attempt crashes (exit 3) when CRASH is set; the others sleep
#: SLEEP seconds (SLEEP_SMALLER in a world smaller than 3 nodes'), pinging, then exit 0.
#: With DEAF set they ignore SIGTERM (only a SIGKILL ends them). A SIGUSR1 (a checkpoint
#: request) writes a line to the ``.usr1`` notes.
WORKER = """
import json, os, signal, sys, time
from elasticd.worker import ping
if os.environ.get("DEAF"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
def warned(sig, frame):
    with open(os.environ["NOTES"] + ".usr1", "a") as f:
        f.write(json.dumps({"node": os.uname().nodename, "rank": int(os.environ["RANK"])}) + "\\n")
signal.signal(signal.SIGUSR1, warned)
note = {"node": os.uname().nodename, "rank": int(os.environ["RANK"]),
        "restart": int(os.environ["TORCHELASTIC_RESTART_COUNT"]), "pid": os.getpid(),
        "world": int(os.environ["WORLD_SIZE"]), "master": os.environ["MASTER_ADDR"]}
with open(os.environ["NOTES"], "a") as f:
    f.write(json.dumps(note) + "\\n")
if os.environ.get("CRASH") and note["rank"] == 1 and note["restart"] == 0:
    sys.exit(3)
sleep = os.environ["SLEEP"] if note["world"] == 6 else os.environ.get("SLEEP_SMALLER", "0")
end = time.monotonic() + float(sleep)
step = 0
while time.monotonic() < end:
    step += 1
    ping(step=step)
    time.sleep(0.1)
"""


@pytest.fixture
def slurm(tmp_path: Path) -> Iterator[SlurmCluster]:
    require_slurm()
    (tmp_path / "slurm").mkdir()
    cluster = SlurmCluster(tmp_path / "slurm")
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.close()


def srun(
    slurm: SlurmCluster,
    tmp_path: Path,
    *,
    crash: bool = False,
    deaf: bool = False,
    sleep: float,
    sleep_smaller: float = 0,
    store_url: str | None = None,
    slurm_flags: tuple[str, ...] = (),
    nodes: int = 3,
) -> subprocess.Popen[str]:
    """``srun -N3 --no-kill --ntasks-per-node=1 elasticd run --nnodes 2:3 ...`` in the cluster
    (``-N{nodes}``)."""
    worker = tmp_path / "worker.py"
    worker.write_text(textwrap.dedent(WORKER))
    home = tmp_path / "home"  # the shared token is made here, as in a shared home
    home.mkdir(exist_ok=True)
    env = {
        **slurm.env,
        "HOME": str(home),
        "NOTES": str(tmp_path / "notes.jsonl"),
        "SLEEP": str(sleep),
        "SLEEP_SMALLER": str(sleep_smaller),
        "PYTHONPATH": str(ROOT),
        **({"CRASH": "1"} if crash else {}),
        **({"DEAF": "1"} if deaf else {}),
        # The test's etcd has no users; its network is the test's own.
        **({"ELASTICD_ALLOW_INSECURE_STORE": "true"} if store_url else {}),
    }
    args = [
        "srun", f"-N{nodes}", "--no-kill", "--ntasks-per-node=1", "--label", *slurm_flags,
        sys.executable, "-m", "elasticd", "run", "--nnodes", "2:3", "--nproc-per-node", "2",
        "--max-restarts", "2", "--termination-grace", str(GRACE),
        *(["--store-url", store_url] if store_url else []), "--", str(worker),
    ]  # fmt: skip
    with (tmp_path / "srun.out").open("w") as out:
        return subprocess.Popen(
            args,
            env=env,
            cwd=tmp_path,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )


def notes(tmp_path: Path) -> list[dict[str, int | str]]:
    path = tmp_path / "notes.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def task_codes(output: str) -> dict[str, str]:
    """Each task's last line, by srun's ``--label`` (``0: ...``)."""
    last: dict[str, str] = {}
    for line in output.splitlines():
        label, sep, text = line.partition(": ")
        if sep and label.strip().isdigit():
            last[label.strip()] = text
    return last


def srun_to_end(
    slurm: SlurmCluster, tmp_path: Path, **how: Any
) -> tuple[int, str, list[dict[str, int | str]]]:
    """:func:`srun` until it ends (killed past 120 s): its exit code, output and the notes."""
    proc = srun(slurm, tmp_path, **how)
    try:
        code = proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return code, (tmp_path / "srun.out").read_text(), notes(tmp_path)


def test_a_crash_restarts_the_group_and_every_task_exits_0(slurm, tmp_path):
    """One rank's crash restarts the whole group on all 3 nodes once; the job succeeds and
    srun (so every task) exits 0."""
    code, output, seen = srun_to_end(slurm, tmp_path, crash=True, sleep=2)
    assert code == 0, f"{output}\n{slurm.logs()}"
    first = [n for n in seen if n["restart"] == 0]
    second = [n for n in seen if n["restart"] == 1]
    assert sorted(n["rank"] for n in first) == list(range(6)), seen
    assert sorted(n["rank"] for n in second) == list(range(6)), seen
    assert {n["node"] for n in second} == {"n1", "n2", "n3"}, seen
    assert not [n for n in seen if int(n["restart"]) > 1], seen
    # torch's store is on rank 0's node, at its address on the cluster's network.
    masters = {n["master"] for n in second}
    assert len(masters) == 1 and masters <= {node.addr for node in slurm.nodes.values()}, seen
    # srun's exit is its tasks' highest: each task also says the job's result.
    ends = task_codes(output)
    assert sorted(ends) == ["0", "1", "2"], output
    assert all("SUCCEEDED after 1 restart" in text for text in ends.values()), output


def test_b_scancel_ends_every_worker_within_the_grace(slurm, tmp_path):
    """``scancel`` of the job stops the workers on every node within the job's grace, even
    workers that ignore SIGTERM (long before Slurm's own SIGKILL at KillWait): no process of
    the job is left in any node's namespaces, and every task exits 143."""
    proc = srun(slurm, tmp_path, deaf=True, sleep=300)
    try:
        _wait_started(proc, tmp_path)
        workers = [int(n["pid"]) for n in notes(tmp_path)]
        jobs = slurm.run("squeue", "-h", "-o", "%i").stdout.split()
        assert len(jobs) == 1, jobs
        cancelled = time.monotonic()
        assert slurm.run("scancel", jobs[0]).returncode == 0
        while any(_alive(pid) for pid in workers):
            left = [p for p in workers if _alive(p)]
            assert time.monotonic() - cancelled < GRACE + 2.5 < KILL_WAIT, left
            time.sleep(0.05)
        proc.wait(KILL_WAIT + 30)
        output = (tmp_path / "srun.out").read_text()
        ends = task_codes(output)
        assert sorted(ends) == ["0", "1", "2"], output
        assert all("stopped by SIGTERM" in text and "exit 143" in text for text in ends.values())
        for name, node in slurm.nodes.items():
            assert not _job_processes(node.pids()), (name, _job_processes(node.pids()))
    finally:
        if proc.poll() is None:
            proc.kill()


def test_c_the_loss_of_a_node_other_than_the_store_host_reforms_on_2(slurm, tmp_path):
    """n3 lost whole (its slurmd and every process of its task killed): the job re-forms
    on n1 and n2 (MIN is 2) and succeeds there; their tasks say so."""
    proc = srun(slurm, tmp_path, sleep=300, sleep_smaller=2)
    try:
        _wait_started(proc, tmp_path)
        _lose(slurm, "n3")
        deadline = time.monotonic() + 90
        while not any(n["world"] == 4 for n in notes(tmp_path)):
            assert time.monotonic() < deadline, (tmp_path / "srun.out").read_text()
            time.sleep(0.1)
        proc.wait(90)
        output = (tmp_path / "srun.out").read_text()
        reformed = [n for n in notes(tmp_path) if n["world"] == 4]
        assert {n["node"] for n in reformed} == {"n1", "n2"}, notes(tmp_path)
        assert sorted(n["rank"] for n in reformed) == [0, 1, 2, 3], notes(tmp_path)
        ends = task_codes(output)
        assert "SUCCEEDED" in ends.get("0", "") and "SUCCEEDED" in ends.get("1", ""), output
    finally:
        if proc.poll() is None:
            proc.kill()


def test_d_the_loss_of_the_store_host_ends_the_job_on_every_node(slurm, tmp_path):
    """n1, the store host, lost whole: the other tasks cannot go on without the store; they
    stop their workers and exit 1 within a bounded time, naming the lost store host."""
    proc = srun(slurm, tmp_path, sleep=300, sleep_smaller=300)
    try:
        _wait_started(proc, tmp_path)
        workers = [int(n["pid"]) for n in notes(tmp_path) if n["node"] != "n1"]
        lost = time.monotonic()
        _lose(slurm, "n1")
        while any(_alive(pid) for pid in workers):
            assert time.monotonic() - lost < 30, [p for p in workers if _alive(p)]
            time.sleep(0.1)
        proc.wait(90)
        output = (tmp_path / "srun.out").read_text()
        ends = task_codes(output)
        for task in ("1", "2"):
            assert "the store host n1 has not answered" in ends.get(task, ""), output
        assert "Traceback" not in output, output
        for name in ("n2", "n3"):
            assert not _job_processes(slurm.nodes[name].pids()), name
    finally:
        if proc.poll() is None:
            proc.kill()


def test_e_with_etcd_the_loss_of_the_first_node_reforms_on_2(slurm, tmp_path):
    """With ``--store-url etcd://`` (an etcd on the bridge), n1 is a node like the others:
    lost whole, the job re-forms on n2 and n3 and succeeds there."""
    (tmp_path / "etcd").mkdir()
    etcd = EtcdProcess(tmp_path / "etcd" / "data", host=slurm.controller_addr)
    etcd.start()
    try:
        url = etcd.url.replace("http://", "etcd://")
        proc = srun(slurm, tmp_path, sleep=300, sleep_smaller=2, store_url=url)
        try:
            _wait_started(proc, tmp_path)
            _lose(slurm, "n1")
            proc.wait(120)
            output = (tmp_path / "srun.out").read_text()
            reformed = [n for n in notes(tmp_path) if n["world"] == 4]
            assert {n["node"] for n in reformed} == {"n2", "n3"}, (notes(tmp_path), output)
            ends = task_codes(output)
            assert "SUCCEEDED" in ends.get("1", "") and "SUCCEEDED" in ends.get("2", ""), output
        finally:
            if proc.poll() is None:
                proc.kill()
    finally:
        etcd.kill()


def test_f_the_time_limit_warns_then_stops_the_workers(slurm, tmp_path):
    """``--signal=USR1@50`` with a 1-minute limit: every worker gets SIGUSR1 once (from
    Slurm; elasticd does not die of it and records the request), then the limit's SIGTERM
    stops the workers and every task exits 143."""
    proc = srun(slurm, tmp_path, sleep=300, slurm_flags=("--time=1", "--signal=USR1@50"))
    try:
        _wait_started(proc, tmp_path)
        proc.wait(150)
        output = (tmp_path / "srun.out").read_text()
        usr1 = tmp_path / "notes.jsonl.usr1"
        warned = [json.loads(x) for x in usr1.read_text().splitlines()] if usr1.exists() else []
        assert sorted(n["rank"] for n in warned) == list(range(6)), (warned, output)
        for task in ("0", "1", "2"):
            lines = [x for x in output.splitlines() if x.startswith(f"{task}: ")]
            assert any("Slurm's warning SIGUSR1" in x for x in lines), output
        ends = task_codes(output)
        assert all("stopped by SIGTERM" in ends.get(t, "") for t in "012"), output
        for name, node in slurm.nodes.items():
            assert not _job_processes(node.pids()), (name, _job_processes(node.pids()))
    finally:
        if proc.poll() is None:
            proc.kill()


def test_g_a_node_beyond_max_is_a_spare(tmp_path):
    """On 4 nodes with --nnodes 2:3, three run the job and the fourth stands by; its task
    still exits with the job's result."""
    require_slurm()
    (tmp_path / "slurm").mkdir()
    slurm = SlurmCluster(tmp_path / "slurm", size=4)
    slurm.start()
    try:
        code, output, seen = srun_to_end(slurm, tmp_path, sleep=2, nodes=4)
        assert code == 0, output
        assert len({n["node"] for n in seen}) == 3, seen
        assert sorted(n["rank"] for n in seen) == list(range(6)), seen
        ends = task_codes(output)
        assert sorted(ends) == ["0", "1", "2", "3"], output
        assert all("SUCCEEDED" in text for text in ends.values()), output
    finally:
        slurm.close()


def _wait_started(proc: subprocess.Popen[str], tmp_path: Path, count: int = 6) -> None:
    """Until ``count`` workers have written their note (the job runs everywhere)."""
    deadline = time.monotonic() + 60
    while len({n["pid"] for n in notes(tmp_path)}) < count:
        assert proc.poll() is None, (tmp_path / "srun.out").read_text()
        assert time.monotonic() < deadline, (tmp_path / "srun.out").read_text()
        time.sleep(0.1)


def _lose(slurm: SlurmCluster, name: str) -> None:
    """The node lost whole: its slurmd and every process of its task SIGKILLed."""
    slurm.kill_slurmd(name)
    for pid in slurm.nodes[name].pids():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_the_readme_batch_script_runs_as_written(slurm, tmp_path):
    """The README's form-1 batch script, read from README.md and sbatch'ed as it is (its
    ``python train.py`` is the tiny worker), runs the job on the 3 nodes and exits 0."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("### Inside an allocation, with no daemon installed") :]
    match = re.search(r"```sh\n(.*?)```", section, re.S)
    assert match, "no sh block in the README's Slurm section"
    (tmp_path / "job.sh").write_text(match.group(1))
    (tmp_path / "train.py").write_text(textwrap.dedent(WORKER))
    home = tmp_path / "home"
    home.mkdir()
    env = {
        **slurm.env,
        "HOME": str(home),
        "NOTES": str(tmp_path / "notes.jsonl"),
        "SLEEP": "1",
        "PYTHONPATH": str(ROOT),
        # `elasticd` and `python` are this checkout's, as an installed elasticd would be.
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    done = subprocess.run(
        ["sbatch", "--wait", "-o", str(tmp_path / "job.out"), str(tmp_path / "job.sh")],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    output = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else ""
    assert done.returncode == 0, f"{done.stdout}{done.stderr}\n{output}"
    seen = notes(tmp_path)
    assert {n["node"] for n in seen} == {"n1", "n2", "n3"}, seen
    assert sorted(n["rank"] for n in seen) == list(range(6)), seen
    assert output.count("SUCCEEDED") == 3, output


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"
    except OSError:
        return False


def _job_processes(pids: list[int]) -> list[str]:
    """The command lines among ``pids`` that are the job's (elasticd, the workers)."""
    found = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "elasticd" in cmdline or "worker.py" in cmdline:
            found.append(f"{pid}: {cmdline}")
    return found
