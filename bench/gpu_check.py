"""Every check that needs an NVIDIA GPU, in one run: ``make gpu-check`` (issue 28, item 10).

1. ``health``: the built-in GPU health check (:class:`elasticd.node.health.GpuCheck`)
   against the real ``nvidia-smi``: it must pass, not be skipped.
2. ``devices``: ``CUDA_VISIBLE_DEVICES`` per job on a shared node: a real daemon
   (``elasticd serve``, one slot per GPU) runs two jobs at once, each on half the GPUs;
   their workers must see disjoint device sets of the right size. On a one-GPU node
   the second job must wait (queued) and then get the GPU the first one gave back.
3. ``nccl``: an NCCL all-reduce job across all of the node's GPUs, one worker per
   GPU, whose last rank crashes after its first all-reduce in attempt 0: through the
   daemon it must restart once and succeed, every rank's sums right.
4. ``nccl-reexec``: the in-place upgrade (issue 25) under NCCL: a job all-reduces over
   every GPU without end; the daemon re-executes itself (SIGHUP) mid-run; the job must
   not notice: the same worker pids, no restart, ``job.readopted``, and it succeeds
   once told to stop, every rank's sums right throughout.
5. ``prewarm``: the NCCL job of ``nccl`` with ``prewarm: ["torch"]`` (issue 27): while
   attempt 0 runs, one standby per GPU imports torch and must neither load the CUDA
   driver nor open a GPU; the restart's workers must take over the standbys
   (``workers.warm_start``), find torch imported and CUDA not yet initialised, and then
   all-reduce over NCCL right.

Without a GPU (no ``nvidia-smi``, or it lists none) it prints ``no GPU: skipped`` and
exits 0, so that ``make gpu-check`` is harmless anywhere; ``--require-gpu`` makes that
exit 77 (automake's "skipped") for a CI job that must have run on a GPU. Any check that
fails exits 1. The NCCL check uses whatever torch the environment has (``make venv``
installs the CPU wheel from PyPI's default index; a GPU machine without network cannot
fetch the CUDA one): with a torch that lacks CUDA or NCCL, it is reported *skipped*,
with the reason, and does not fail the run.

It prints one line per check and a JSON summary (``--json PATH`` writes it too).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from bench._common import ElasticdServer, poll_until  # noqa: E402

#: The exit code of a run that found no GPU, with --require-gpu (automake's "skipped").
NO_GPU_EXIT = 77


@dataclass(frozen=True)
class Outcome:
    """One check's result: ``status`` is ``passed``, ``failed`` or ``skipped``."""

    name: str
    status: str
    detail: str


def exit_code(outcomes: Sequence[Outcome]) -> int:
    """1 if any check failed, else 0 (skipped checks say why, and do not fail the run)."""
    return 1 if any(o.status == "failed" for o in outcomes) else 0


def split_devices(gpus: Sequence[str]) -> tuple[list[str], list[str]]:
    """The two jobs' shares of the node's GPUs: halves (the first gets the odd one)."""
    half = (len(gpus) + 1) // 2
    return list(gpus[:half]), list(gpus[half:])


def judge_devices(seen: dict[str, set[str]], sizes: dict[str, int]) -> Outcome:
    """Two jobs' workers' ``CUDA_VISIBLE_DEVICES``: each the right size, no device shared."""
    for job, devices in seen.items():
        if len(devices) != sizes[job]:
            return Outcome(
                "devices", "failed", f"job {job} saw {sorted(devices)}, {sizes[job]} wanted"
            )
    (a, da), (b, db) = seen.items()
    if da & db:
        return Outcome("devices", "failed", f"jobs {a} and {b} share GPU(s) {sorted(da & db)}")
    return Outcome("devices", "passed", f"job {a}: GPUs {sorted(da)}, job {b}: GPUs {sorted(db)}")


def gpus_present(nvidia_smi: str = "nvidia-smi") -> list[str] | None:
    """The GPU indices ``nvidia-smi -L`` lists, or None without the tool or a GPU."""
    from elasticd.node.host import detect_gpus

    found = asyncio.run(detect_gpus(nvidia_smi))
    return found or None


def check_health(nvidia_smi: str = "nvidia-smi") -> Outcome:
    """The daemon's own GPU check, as it runs before every start of a job's workers."""
    from elasticd.node.health import GpuCheck, run_health_checks

    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    (result,) = asyncio.run(run_health_checks([GpuCheck(nvidia_smi=nvidia_smi)], env, 60))
    if result.skipped or not result.ok:
        return Outcome("health", "failed", result.message)  # on a GPU node it must run and pass
    return Outcome("health", "passed", f"{result.message} ({result.duration_s:.2f} s)")


SHOW_DEVICES = """
import os, pathlib, sys, time
out = pathlib.Path(sys.argv[1])
(out / f"{os.environ['ELASTICD_JOB_ID']}-{os.environ['LOCAL_RANK']}").write_text(
    os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>"))
deadline = time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline and not (out / "release").exists():
    time.sleep(0.05)
"""


def check_devices(server: ElasticdServer, gpus: Sequence[str], work: Path) -> Outcome:
    """Two jobs on one daemon: disjoint CUDA_VISIBLE_DEVICES (one GPU: the second waits)."""
    out = work / "devices"
    out.mkdir()
    script = work / "show_devices.py"
    script.write_text(SHOW_DEVICES)
    first, second = split_devices(gpus) if len(gpus) > 1 else (list(gpus), list(gpus))
    sizes = {"dev-a": len(first), "dev-b": len(second)}
    for job_id, n in sizes.items():
        server.submit(
            {
                "id": job_id,
                "entrypoint": sys.executable,
                "args": [str(script), str(out), "60"],
                "nproc_per_node": n,
                "max_restarts": 0,
            }
        )

    def written(job_id: str) -> set[str] | None:
        files = list(out.glob(f"{job_id}-*"))
        if len(files) < sizes[job_id]:
            return None
        return {d for f in files for d in f.read_text().split(",")}

    if len(gpus) == 1:
        seen_a = poll_until(lambda: written("dev-a"), 60, "job dev-a's worker")
        queued = server.job("dev-b")
        if queued["state"] != "PENDING":
            return Outcome("devices", "failed", f"with one GPU held, dev-b is {queued['state']}")
        (out / "release").touch()
        seen_b = poll_until(lambda: written("dev-b"), 60, "job dev-b's worker")
        for job_id in sizes:
            server.wait_terminal(job_id, 60)
        if seen_a != seen_b or seen_a != set(gpus):
            return Outcome("devices", "failed", f"dev-a saw {seen_a}, dev-b then {seen_b}")
        return Outcome("devices", "passed", f"one GPU {sorted(seen_a)}: dev-b waited, then got it")
    seen = {
        job_id: poll_until(lambda j=job_id: written(j), 60, f"job {job_id}") for job_id in sizes
    }
    (out / "release").touch()
    for job_id in sizes:
        server.wait_terminal(job_id, 60)
    return judge_devices(seen, sizes)


def torch_cuda() -> str | None:
    """Why this environment's torch cannot run the NCCL check, or None when it can."""
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import torch, torch.distributed as d; "
            "print(torch.__version__, torch.version.cuda, torch.cuda.is_available(), "
            "d.is_nccl_available())",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if probe.returncode != 0:
        return f"torch cannot be imported: {probe.stderr.strip().splitlines()[-1:]}"
    version, cuda, available, nccl = probe.stdout.split()
    if cuda == "None":
        return f"torch {version} is built without CUDA (install a CUDA wheel in .venv)"
    if available != "True":
        return f"torch {version} (CUDA {cuda}) sees no GPU"
    if nccl != "True":
        return f"torch {version} has no NCCL"
    return None


ALLREDUCE = """
import os, sys, torch, torch.distributed as dist
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl")
for step in range(20):
    t = torch.full((1 << 20,), float(rank + 1), device="cuda")
    dist.all_reduce(t)
    expected = world * (world + 1) / 2
    assert torch.all(t == expected).item(), (step, t[0].item(), expected)
    if attempt == 0 and step == 0 and rank == world - 1:
        sys.exit(3)  # the crash: its peers block in the next all-reduce until stopped
print(f"rank {rank} of {world}: 20 all-reduces right, attempt {attempt}", flush=True)
dist.destroy_process_group()
"""


def check_nccl(server: ElasticdServer, gpus: Sequence[str], work: Path) -> Outcome:
    """An NCCL all-reduce job over every GPU whose last rank crashes once: restart, success."""
    why = torch_cuda()
    if why is not None:
        return Outcome("nccl", "skipped", why)
    script = work / "allreduce.py"
    script.write_text(ALLREDUCE)
    began = time.monotonic()
    server.submit(
        {
            "id": "nccl",
            "entrypoint": sys.executable,
            "args": [str(script)],
            "nproc_per_node": len(gpus),
            "max_restarts": 1,
            "termination_grace": 10,
        }
    )
    job = server.wait_terminal("nccl", 300)
    took = time.monotonic() - began
    restarted = [e for e in server.events("nccl") if e["kind"] == "group.restarting"]
    if job["state"] != "SUCCEEDED" or job["restart_count"] != 1 or len(restarted) != 1:
        return Outcome(
            "nccl",
            "failed",
            f"{job['state']}, {job['restart_count']} restart(s): {job.get('reason')}; "
            f"{job.get('error')}",
        )
    return Outcome(
        "nccl",
        "passed",
        f"{len(gpus)} rank(s), crash of rank {len(gpus) - 1} restarted once, SUCCEEDED "
        f"in {took:.1f} s ({restarted[0]['message']})",
    )


NCCL_LOOP = """
import os, pathlib, sys, time, torch, torch.distributed as dist
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl")
folder, steps = pathlib.Path(sys.argv[1]), 0
while True:
    t = torch.full((1 << 20,), float(rank + 1), device="cuda")
    dist.all_reduce(t)
    assert torch.all(t == world * (world + 1) / 2).item(), (steps, t[0].item())
    steps += 1
    if rank == 0 and steps == 50:
        (folder / "steady").touch()
    stop = torch.tensor([int(rank == 0 and (folder / "stop").exists())], device="cuda")
    dist.broadcast(stop, 0)  # every rank stops at the same step
    if stop.item():
        break
    time.sleep(0.01)
print(f"rank {rank} of {world}: {steps} all-reduces right", flush=True)
dist.destroy_process_group()
"""


NCCL_HANG = """
import os, time, torch, torch.distributed as dist
import elasticd.worker as w
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl")


def slow_step():
    time.sleep(600)  # the others wait for it in the next all-reduce


t = torch.ones(1 << 16, device="cuda")
for step in range(1000):
    w.ping(step=step)
    if rank == world - 1 and step == 3:
        slow_step()
    dist.all_reduce(t)
    torch.cuda.synchronize()
    time.sleep(0.05)
"""


def check_flight_recorder(server: ElasticdServer, gpus: Sequence[str], work: Path) -> Outcome:
    """An NCCL job with torch's flight recorder on whose last rank stops issuing collectives:
    the hang's root cause names that rank as behind in collectives (issue 37)."""
    why = torch_cuda()
    if why is not None:
        return Outcome("flight-recorder", "skipped", why)
    if len(gpus) < 2:
        return Outcome("flight-recorder", "skipped", "one GPU: no rank to be behind another")
    script = work / "hang.py"
    script.write_text(NCCL_HANG)
    spec: dict[str, Any] = {"id": "fr", "entrypoint": sys.executable, "args": [str(script)]}
    spec.update(nproc_per_node=len(gpus), max_restarts=0, progress_timeout=10)
    spec.update(termination_grace=5, env={"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"})
    server.submit(spec)
    job = server.wait_terminal("fr", 300)
    error = job.get("error") or {}
    message = str(error.get("message", ""))
    if error.get("rank") != len(gpus) - 1 or "behind in collectives" not in message:
        return Outcome("flight-recorder", "failed", f"{job['state']}: {message or job}")
    return Outcome("flight-recorder", "passed", message)


def check_nccl_reexec(server: ElasticdServer, gpus: Sequence[str], work: Path) -> Outcome:
    """An NCCL job runs on while its daemon re-executes itself in place (issue 25)."""
    why = torch_cuda()
    if why is not None:
        return Outcome("nccl-reexec", "skipped", why)
    folder = work / "reexec"
    folder.mkdir()
    script = work / "nccl_loop.py"
    script.write_text(NCCL_LOOP)
    server.submit(
        {
            "id": "nccl-reexec",
            "entrypoint": sys.executable,
            "args": [str(script), str(folder)],
            "nproc_per_node": len(gpus),
            "max_restarts": 0,
            "termination_grace": 10,
        }
    )
    poll_until(lambda: (folder / "steady").exists() or None, 300, "50 all-reduces")

    def pids() -> list[int]:
        groups = server.client.get("/jobs/nccl-reexec/workers").json()["groups"]
        return sorted(w["pid"] for g in groups for w in g["workers"] if w.get("pid"))

    before, started_at = pids(), server.client.get("/healthz").json()["started_at"]
    assert server.proc is not None
    began = time.monotonic()
    server.proc.send_signal(signal.SIGHUP)

    def back() -> bool | None:
        try:
            health = server.client.get("/healthz", timeout=2).json()
            ready = server.client.get("/readyz", timeout=2).status_code == 200
        except (httpx.HTTPError, ValueError):
            return None
        return True if health["started_at"] != started_at and ready else None

    poll_until(back, 120, "the re-executed daemon ready")
    took = time.monotonic() - began
    after = pids()
    (folder / "stop").touch()
    job = server.wait_terminal("nccl-reexec", 120)
    kinds = [e["kind"] for e in server.events("nccl-reexec")]
    if (
        job["state"] != "SUCCEEDED"
        or job["restart_count"] != 0
        or after != before
        or "job.readopted" not in kinds
    ):
        return Outcome(
            "nccl-reexec",
            "failed",
            f"{job['state']}, {job['restart_count']} restart(s), pids {before} -> {after}, "
            f"readopted: {'job.readopted' in kinds}; {job.get('reason')}",
        )
    return Outcome(
        "nccl-reexec",
        "passed",
        f"{len(gpus)} rank(s) all-reducing; daemon re-executed in {took:.1f} s (SIGHUP to "
        "ready), same pids, no restart, SUCCEEDED",
    )


PREWARM_ALLREDUCE = """
import sys
imported = "torch" in sys.modules  # a warm worker: its standby imported torch
import json, os, time, torch, torch.distributed as dist
cuda_before = torch.cuda.is_initialized()
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
out = os.environ["OUT"]
with open(f"{out}/seen-{attempt}-{rank}.json", "w") as f:
    json.dump({"imported": imported, "cuda_before": cuda_before}, f)
while attempt == 0 and not os.path.exists(f"{out}/go"):  # the standbys are ready first
    time.sleep(0.05)
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl")
for step in range(20):
    t = torch.full((1 << 20,), float(rank + 1), device="cuda")
    dist.all_reduce(t)
    assert torch.all(t == world * (world + 1) / 2).item(), (step, t[0].item())
    if attempt == 0 and step == 0 and rank == world - 1:
        sys.exit(3)
print(f"rank {rank}: warm={imported}, 20 all-reduces right, attempt {attempt}", flush=True)
dist.destroy_process_group()
"""


def touches_the_gpu(pid: int) -> list[str]:
    """What of the CUDA driver ``pid`` has loaded or opened (libcuda, /dev/nvidia*)."""
    maps = Path(f"/proc/{pid}/maps").read_text()
    found = sorted({line.split()[-1] for line in maps.splitlines() if "libcuda" in line})
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("/dev/nvidia"):
            found.append(target)
    return found


def check_prewarm(server: ElasticdServer, gpus: Sequence[str], work: Path) -> Outcome:
    """The NCCL job with prewarmed standbys: they never touch a GPU; the restart is warm."""
    why = torch_cuda()
    if why is not None:
        return Outcome("prewarm", "skipped", why)
    out = work / "prewarm"
    out.mkdir()
    script = work / "prewarm_allreduce.py"
    script.write_text(PREWARM_ALLREDUCE)
    server.submit(
        {
            "id": "nccl-prewarm",
            "entrypoint": sys.executable,
            "args": [str(script)],
            "env": {"OUT": str(out)},
            "nproc_per_node": len(gpus),
            "max_restarts": 1,
            "termination_grace": 10,
            "prewarm": ["torch"],
        }
    )

    def ready() -> list[int] | None:
        view = server.client.get("/jobs/nccl-prewarm/workers").json()
        for group in view.get("groups", []):
            standbys = group.get("standbys", [])
            if len(standbys) == len(gpus) and all(s["state"] == "ready" for s in standbys):
                return [s["pid"] for s in standbys]
        return None

    pids = poll_until(ready, 180, "the standbys to import torch", interval=0.1)
    touched = {pid: touches_the_gpu(pid) for pid in pids}
    (out / "go").touch()
    job = server.wait_terminal("nccl-prewarm", 300)
    events = server.events("nccl-prewarm")
    warm = [e for e in events if e["kind"] == "workers.warm_start"]
    seen = [json.loads(p.read_text()) for p in sorted(out.glob("seen-1-*.json"))]
    problems = [f"standby {pid} touched the GPU: {what}" for pid, what in touched.items() if what]
    if job["state"] != "SUCCEEDED" or job["restart_count"] != 1:
        problems.append(f"{job['state']}, {job['restart_count']} restart(s): {job.get('error')}")
    if not warm or sorted(warm[0]["pids"]) != sorted(pids):
        problems.append(f"the restart did not take over the standbys {pids}: {warm}")
    if len(seen) != len(gpus) or any(not s["imported"] or s["cuda_before"] for s in seen):
        problems.append(f"the warm workers saw {seen} (want torch imported, CUDA not initialised)")
    if problems:
        return Outcome("prewarm", "failed", "; ".join(problems))
    return Outcome(
        "prewarm",
        "passed",
        f"{len(gpus)} standby(s) imported torch without touching a GPU; the restart took "
        f"them over ({warm[0]['message']}) and all-reduced over NCCL",
    )


def run(nvidia_smi: str = "nvidia-smi") -> tuple[list[str] | None, list[Outcome]]:
    """The node's GPUs and every check's outcome (none without a GPU)."""
    gpus = gpus_present(nvidia_smi)
    if gpus is None:
        return None, []
    outcomes = [check_health(nvidia_smi)]
    with tempfile.TemporaryDirectory(prefix="elasticd-gpu-check-") as tmp:
        work = Path(tmp)
        with ElasticdServer(work, name="gpu") as server:
            checks = (
                check_devices,
                check_nccl,
                check_nccl_reexec,
                check_prewarm,
                check_flight_recorder,
            )
            for check in checks:
                try:
                    outcomes.append(check(server, gpus, work))
                except Exception as exc:  # one check's breakage must not hide the others
                    name = check.__name__.removeprefix("check_").replace("_", "-")
                    outcomes.append(Outcome(name, "failed", f"{type(exc).__name__}: {exc}"))
    return gpus, outcomes


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--require-gpu", action="store_true", help=f"no GPU: exit {NO_GPU_EXIT}")
    parser.add_argument("--nvidia-smi", default="nvidia-smi", help="the nvidia-smi to use")
    parser.add_argument("--json", type=Path, help="also write the summary here")
    args = parser.parse_args(argv)
    gpus, outcomes = run(args.nvidia_smi)
    summary: dict[str, Any] = {
        "gpus": gpus,
        "nvidia_smi": shutil.which(args.nvidia_smi),
        "checks": [asdict(o) for o in outcomes],
    }
    if gpus is None:
        print("no GPU: skipped (nvidia-smi is not on PATH or lists no GPU)")
        code = NO_GPU_EXIT if args.require_gpu else 0
    else:
        print(f"{len(gpus)} GPU(s): {', '.join(gpus)}")
        for o in outcomes:
            print(f"{o.name:8} {o.status.upper():8} {o.detail}")
        code = exit_code(outcomes)
    summary["exit"] = code
    print(json.dumps(summary))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
