"""elasticd's daemons as the node service under a real Slurm (issue 38, form 2), on 4
namespaced nodes: a batch script's ``elasticd submit --slurm --wait`` runs its job on exactly
the allocation's nodes, ``scancel`` cancels it with nothing left, the epilog verifies that;
an admin's drain through
elasticd's API drains the node in Slurm, and a restarted daemon still resumes it.

One ``elasticd serve`` runs in each Slurm node's namespaces (n1's serves the embedded store,
the others join it); each listens on the same port in its own network namespace, so the
batch script's ``ELASTICD_URL=http://127.0.0.1:PORT`` is its node's own daemon.
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

import httpx
import pytest

from tests.conftest import ROOT
from tests.e2e.cluster import TOKEN, free_port
from tests.e2e.slurm_cluster import KILL_WAIT, SlurmCluster, require_slurm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(200)]

#: Each worker writes ``{"node", "pid", "rank"}`` to NOTES, then sleeps SLEEP seconds.
WORKER = """
import json, os, time
with open(os.environ["NOTES"], "a") as f:
    f.write(json.dumps({"node": os.uname().nodename, "pid": os.getpid(),
                        "rank": int(os.environ["RANK"])}) + "\\n")
time.sleep(float(os.environ["SLEEP"]))
"""


class NodeService:
    """A Slurm cluster with one ``elasticd serve`` per node, sharing n1's store."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port()
        self.token = root / "token"
        self.token.write_text(TOKEN)
        self.token.chmod(0o600)
        epilog = root / "elasticd-epilog"
        epilog.write_text(
            f"#!/bin/sh\nexec {sys.executable} -m elasticd slurm epilog "
            f"--url http://127.0.0.1:{self.port} --token-file {self.token} "
            f">>{root}/epilog-$SLURMD_NODENAME.log 2>&1\n"
        )
        epilog.chmod(0o755)
        (root / "slurm").mkdir()
        self.slurm = SlurmCluster(root / "slurm", size=4, extra_conf=(f"Epilog={epilog}",))
        self.daemons: dict[str, subprocess.Popen[bytes]] = {}

    def start(self) -> None:
        self.slurm.start()
        for name in self.slurm.nodes:
            self.spawn(name)
        self.wait_nodes(set(self.slurm.nodes))

    def spawn(self, name: str) -> None:
        """Start node ``name``'s daemon (n1's serves the store, the others join it)."""
        first, node = self.slurm.nodes["n1"], self.slurm.nodes[name]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTICD_", "SLURM_"))}
        env.update(ELASTICD_LEASE_TTL="2", ELASTICD_ALLOW_ROOT="true", PYTHONPATH=str(ROOT))
        # Jobs as root, as the test's workers need, whether or not this machine has an
        # `elasticd` user just now (another test may make one for a while).
        env["ELASTICD_RUN_AS"] = "root"
        # The workers' `python` is this checkout's, as an installed elasticd's would be.
        env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
        # slurm_drain: a quarantine drains the node in Slurm (scontrol, with the cluster's conf).
        env.update(ELASTICD_SLURM_DRAIN="true", SLURM_CONF=str(self.slurm.conf))
        args = [
            sys.executable, "-m", "elasticd", "serve", "--host", "0.0.0.0",
            "--port", str(self.port), "--advertise-addr", node.addr, "--node-name", name,
            "--state-dir", str(self.root / name), "--slots", "2",
            "--token-file", str(self.token),
        ]  # fmt: skip
        if name != "n1":
            args += ["--store-url", f"http://{first.addr}:{self.port}"]
        with (self.root / f"daemon-{name}.log").open("ab") as out:
            self.daemons[name] = subprocess.Popen(
                node.nsenter(*args),
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def stop(self, name: str) -> None:
        """Stop node ``name``'s daemon (SIGTERM); :meth:`spawn` starts a fresh one."""
        proc = self.daemons[name]
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)

    def api(self) -> httpx.Client:
        """The API of n1's daemon, from the host (over the bridge)."""
        url = f"http://{self.slurm.nodes['n1'].addr}:{self.port}"
        return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)

    def wait_nodes(self, names: set[str], timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        with self.api() as api:
            while True:
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    if {n["name"] for n in api.get("/nodes").json()} >= names:
                        return
                for name, proc in self.daemons.items():
                    assert proc.poll() is None, f"{name} exited:\n{self.logs()}"
                assert time.monotonic() < deadline, f"nodes not up:\n{self.logs()}"
                time.sleep(0.1)

    def logs(self) -> str:
        files = sorted(self.root.glob("daemon-*.log")) + sorted(self.root.glob("epilog-*.log"))
        text = "\n".join(f"== {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in files)
        return text + "\n" + self.slurm.logs()

    def close(self) -> None:
        for proc in self.daemons.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.daemons.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        self.slurm.close()


@pytest.fixture
def service(tmp_path: Path) -> Iterator[NodeService]:
    require_slurm()
    cluster = NodeService(tmp_path)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.close()


def sbatch(service: NodeService, tmp_path: Path, sleep: float) -> str:
    """Submit the batch script (``sbatch -N3``, exec'ing ``elasticd submit --slurm --wait``);
    its Slurm job id."""
    (tmp_path / "worker.py").write_text(textwrap.dedent(WORKER))
    notes = tmp_path / "notes.jsonl"
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/sh\n#SBATCH -N3\n"
        f"exec {sys.executable} -m elasticd submit --slurm --wait --termination-grace 2 "
        f"--env NOTES={notes} --env SLEEP={sleep} -- {sys.executable} {tmp_path / 'worker.py'}\n"
    )
    env = {
        **service.slurm.env,
        "ELASTICD_URL": f"http://127.0.0.1:{service.port}",
        "ELASTICD_TOKEN_FILE": str(service.token),
        "PYTHONPATH": str(ROOT),
    }
    done = subprocess.run(
        ["sbatch", "--parsable", "-o", str(tmp_path / "batch.out"), str(script)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done
    return done.stdout.strip().split(";")[0]


def slurm_job(service: NodeService, job_id: str) -> dict[str, str]:
    text = service.slurm.run("scontrol", "-o", "show", "job", job_id).stdout
    return dict(re.findall(r"(\w+)=(\S*)", text))


def wait_slurm_end(service: NodeService, job_id: str, timeout: float) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while True:
        fields = slurm_job(service, job_id)
        if fields.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
            return fields
        assert time.monotonic() < deadline, f"{fields}\n{service.logs()}"
        time.sleep(0.2)


def notes(tmp_path: Path) -> list[dict[str, Any]]:
    path = tmp_path / "notes.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.strip()]


def elasticd_job(service: NodeService, slurm_job_id: str) -> dict[str, Any]:
    with service.api() as api:
        jobs = api.get("/jobs").json()["jobs"]
    mine = [j for j in jobs if j["spec"]["slurm_job_id"] == slurm_job_id]
    assert len(mine) == 1, jobs
    return mine[0]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not Path(f"/proc/{pid}/stat").read_text().split(") ")[-1].startswith("Z")


def test_a_batch_job_runs_on_exactly_its_nodes_and_exits_with_the_result(service, tmp_path):
    """``sbatch -N3`` of 4 nodes: one worker on each allocated node, none elsewhere; the
    batch script exits 0 and the elasticd job records the Slurm job and its nodes."""
    job_id = sbatch(service, tmp_path, sleep=1)
    fields = wait_slurm_end(service, job_id, timeout=120)
    out = (tmp_path / "batch.out").read_text(errors="replace")
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), out + service.logs()
    allocated = sorted(
        subprocess.run(
            ["scontrol", "show", "hostnames", fields["NodeList"]],
            env=service.slurm.env, capture_output=True, text=True, check=True,
        ).stdout.split()
    )  # fmt: skip
    assert len(allocated) == 3
    assert sorted(n["node"] for n in notes(tmp_path)) == allocated, notes(tmp_path)
    job = elasticd_job(service, job_id)
    assert job["state"] == "SUCCEEDED"
    assert sorted(job["spec"]["nodes"]) == allocated
    assert (job["spec"]["min_nodes"], job["spec"]["max_nodes"]) == (3, 3)


def test_scancel_cancels_the_elasticd_job_with_no_process_left(service, tmp_path):
    """``scancel`` while the workers run: the batch script's ``submit --wait`` cancels the
    elasticd job within its grace, every worker on every node is gone, the epilogs pass."""
    job_id = sbatch(service, tmp_path, sleep=300)
    deadline = time.monotonic() + 90
    while len(notes(tmp_path)) < 3:
        assert time.monotonic() < deadline, service.logs()
        time.sleep(0.1)
    pids = [n["pid"] for n in notes(tmp_path)]
    assert all(alive(pid) for pid in pids)
    cancelled = service.slurm.run("scancel", job_id)
    assert cancelled.returncode == 0, cancelled
    stopped = time.monotonic()
    wait_slurm_end(service, job_id, timeout=60)
    while any(alive(pid) for pid in pids):
        assert time.monotonic() - stopped < KILL_WAIT, [p for p in pids if alive(p)]
        time.sleep(0.05)
    deadline = time.monotonic() + 30
    while elasticd_job(service, job_id)["state"] != "CANCELLED":
        assert time.monotonic() < deadline, elasticd_job(service, job_id)
        time.sleep(0.1)
    out = (tmp_path / "batch.out").read_text(errors="replace")
    assert "cancelling job" in out, out
    # Every node of the job ran the epilog, and it found nothing left.
    deadline = time.monotonic() + 30
    logs = {n["node"]: tmp_path / f"epilog-{n['node']}.log" for n in notes(tmp_path)}
    while not all(p.exists() for p in logs.values()):
        assert time.monotonic() < deadline, service.logs()
        time.sleep(0.1)
    assert "left on this node" not in "".join(p.read_text() for p in logs.values())


def slurm_node(service: NodeService, name: str) -> tuple[str, str]:
    """``scontrol show node``'s State and Reason of ``name``."""
    text = service.slurm.run("scontrol", "-o", "show", "node", name).stdout
    state = re.search(r"\bState=(\S+)", text)
    return (state.group(1) if state else ""), text.partition(" Reason=")[2].strip()


def test_an_elasticd_drain_drains_the_node_in_slurm_and_undrain_resumes_it(service):
    """``slurm_drain = true``: an admin's drain of n2 through the API shows in ``scontrol show
    node`` as DRAIN with elasticd's reason; the undrain, made while n2's daemon is down,
    resumes n2 in Slurm once a fresh daemon starts: Slurm's reason says the drain is ours."""
    with service.api() as api:
        drained = api.post("/nodes/n2/drain", json={"reason": "bad HBM on gpu3"})
        assert drained.status_code == 200, drained.text
        deadline = time.monotonic() + 30
        while "DRAIN" not in slurm_node(service, "n2")[0]:
            assert time.monotonic() < deadline, f"{slurm_node(service, 'n2')}\n{service.logs()}"
            time.sleep(0.1)
        state, reason = slurm_node(service, "n2")
        assert reason.startswith("elasticd: bad HBM on gpu3"), (state, reason)
        assert "DRAIN" not in slurm_node(service, "n1")[0]
        # Released while n2's daemon is down: the fresh one, which remembers nothing, resumes.
        service.stop("n2")
        undrained = api.post("/nodes/n2/undrain", json={"reason": "replaced"})
        assert undrained.status_code == 200, undrained.text
        service.spawn("n2")
        deadline = time.monotonic() + 30
        while "DRAIN" in slurm_node(service, "n2")[0]:
            assert time.monotonic() < deadline, f"{slurm_node(service, 'n2')}\n{service.logs()}"
            time.sleep(0.1)
    assert service.slurm.run("srun", "-N1", "-w", "n2", "true", timeout=60).returncode == 0


def test_the_readme_batch_script_runs_as_written(service, tmp_path):
    """The README's form-2 batch script, sbatch'ed as it is (its ``train.py`` writes notes in
    the job's folder), runs 2 workers on each of its 3 nodes and exits 0."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("### As the node service, with Slurm as the allocator") :]
    match = re.search(r"```sh\n(.*?)```", section, re.S)
    assert match, "no sh block in the README's form-2 section"
    (tmp_path / "job.sh").write_text(match.group(1))
    worker = WORKER.replace('os.environ["NOTES"]', '"notes.jsonl"').replace(
        'os.environ["SLEEP"]', '"1"'
    )
    (tmp_path / "train.py").write_text(textwrap.dedent(worker))
    env = {
        **service.slurm.env,
        "ELASTICD_URL": f"http://127.0.0.1:{service.port}",
        "ELASTICD_TOKEN_FILE": str(service.token),
        "PYTHONPATH": str(ROOT),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    done = subprocess.run(
        ["sbatch", "--wait", "-o", str(tmp_path / "job.out"), str(tmp_path / "job.sh")],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=150, check=False,
    )  # fmt: skip
    output = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else ""
    assert done.returncode == 0, f"{done.stdout}{done.stderr}\n{output}\n{service.logs()}"
    seen = notes(tmp_path)
    assert len({n["node"] for n in seen}) == 3, seen
    assert sorted(n["rank"] for n in seen) == list(range(6)), seen
