"""Health checks before a (re)start: a custom command, and the built-in nvidia-smi GPU check."""

from __future__ import annotations

import asyncio
import os
import stat
import time
from pathlib import Path

from elasticd.node.health import (
    CommandCheck,
    GpuCheck,
    checks_for_job,
    parse_gpu_query,
    run_health_checks,
)

from .support import PY, child_env, pid_alive

GOOD = "0, 00000000:18:00.0, NVIDIA H100 80GB HBM3, 0, No\n1, 00000000:2A:00.0, NVIDIA H100 80GB HBM3, 0, No"
NO_ECC = "0, 00000000:01:00.0, NVIDIA GeForce RTX 4090, [N/A], [N/A]"


def fake_nvidia_smi(bin_dir: Path, stdout: str, code: int = 0) -> Path:
    """An executable `nvidia-smi` that records its arguments and prints `stdout`."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    path = bin_dir / "nvidia-smi"
    path.write_text(
        f"#!{PY}\n"
        "import sys, pathlib\n"
        f"pathlib.Path({str(bin_dir / 'args')!r}).write_text(' '.join(sys.argv[1:]))\n"
        f"sys.stdout.write({stdout!r})\n"
        f"sys.exit({code})\n"
    )
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def env_with(bin_dir: Path, **extra: str) -> dict[str, str]:
    env = child_env(extra)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', os.defpath)}"
    return env


async def check_gpu(env: dict[str, str]) -> tuple[bool, bool, str]:
    async with asyncio.timeout(30):
        [result] = await run_health_checks([GpuCheck()], env)
    assert result.name == "gpu" and result.duration_s >= 0
    return result.ok, result.skipped, result.message


async def test_good_gpus_pass_and_the_job_gpus_are_queried(tmp_path: Path) -> None:
    """Healthy GPUs pass; the query is limited to the job's CUDA_VISIBLE_DEVICES."""
    bin_dir = tmp_path / "bin"
    fake_nvidia_smi(bin_dir, GOOD)
    ok, skipped, message = await check_gpu(env_with(bin_dir, CUDA_VISIBLE_DEVICES="0,1"))
    assert ok and not skipped
    assert message == "2 GPU(s) healthy: GPU 0 NVIDIA H100 80GB HBM3, GPU 1 NVIDIA H100 80GB HBM3"
    args = (bin_dir / "args").read_text()
    assert (
        "--query-gpu=index,pci.bus_id,name,ecc.errors.uncorrected.volatile.total,retired_pages.pending"
        in args
    )
    assert "--format=csv,noheader,nounits" in args and args.endswith("-i 0,1")


async def test_a_lost_gpu_fails_naming_it(tmp_path: Path) -> None:
    """A GPU that nvidia-smi reports as lost makes the check fail with its index and bus id."""
    bin_dir = tmp_path / "bin"
    fake_nvidia_smi(
        bin_dir,
        "0, 00000000:18:00.0, NVIDIA H100 80GB HBM3, 0, No\n"
        "1, 00000000:2A:00.0, NVIDIA H100 80GB HBM3, [GPU is lost], [GPU is lost]\n",
    )
    ok, skipped, message = await check_gpu(env_with(bin_dir))
    assert not ok and not skipped
    assert message.startswith(
        "GPU 1 (NVIDIA H100 80GB HBM3, 00000000:2A:00.0) is unusable: [GPU is lost]"
    )


async def test_ecc_errors_and_pending_retirements_fail(tmp_path: Path) -> None:
    """Uncorrected volatile ECC errors and pages pending retirement both fail the GPU."""
    bin_dir = tmp_path / "bin"
    fake_nvidia_smi(bin_dir, "0, 00000000:18:00.0, NVIDIA A100-SXM4-80GB, 3, Yes\n")
    ok, _, message = await check_gpu(env_with(bin_dir))
    assert not ok
    assert "3 uncorrected ECC error(s)" in message and "needs a reset" in message


async def test_nvidia_smi_failing_or_finding_nothing_fails(tmp_path: Path) -> None:
    """A non-zero exit (driver gone) and an empty list both fail, with nvidia-smi's words."""
    bin_dir = tmp_path / "bin"
    fake_nvidia_smi(
        bin_dir, "Unable to determine the device handle for GPU0000:2A:00.0: Unknown Error\n", 15
    )
    ok, _, message = await check_gpu(env_with(bin_dir))
    assert not ok and message.startswith("nvidia-smi exited with code 15: Unable to determine")
    fake_nvidia_smi(bin_dir, "")
    ok, _, message = await check_gpu(env_with(bin_dir))
    assert not ok and message == "nvidia-smi listed no GPU"


async def test_the_gpu_check_is_skipped_without_nvidia_smi_or_gpus(tmp_path: Path) -> None:
    """No nvidia-smi on PATH, or a job given no GPUs: skipped, with the reason."""
    env = child_env()
    env["PATH"] = str(tmp_path / "empty")
    ok, skipped, message = await check_gpu(env)
    assert ok and skipped and "nvidia-smi is not on PATH" in message
    bin_dir = tmp_path / "bin"
    fake_nvidia_smi(bin_dir, "garbage")
    ok, skipped, message = await check_gpu(env_with(bin_dir, CUDA_VISIBLE_DEVICES=""))
    assert ok and skipped and "no GPUs" in message


def test_boards_without_ecc_are_healthy() -> None:
    """[N/A] cells (no ECC on consumer boards) are not errors; odd lines are."""
    assert parse_gpu_query(NO_ECC) == ([], ["GPU 0 NVIDIA GeForce RTX 4090"])
    problems, _ = parse_gpu_query("No devices were found")
    assert problems == ["nvidia-smi printed an unexpected line: 'No devices were found'"]


async def test_a_custom_command_passes_fails_or_times_out(tmp_path: Path) -> None:
    """Exit 0 passes; a non-zero exit fails with its output; a hang fails at its own timeout, killed."""
    pid_file = tmp_path / "pid"
    checks = [
        CommandCheck([PY, "-c", "print('disk ok')"], name="disk"),
        CommandCheck([PY, "-c", "import sys; print('IB port 1 down'); sys.exit(3)"], name="ib"),
        CommandCheck(
            ["sh", "-c", f"sleep 30 & echo $! > {pid_file}; wait"],
            name="slow",
            timeout=0.5,
        ),
        CommandCheck(["/nonexistent/check"], name="missing"),
    ]
    started = time.monotonic()
    async with asyncio.timeout(30):
        disk, ib, slow, missing = await run_health_checks(checks, child_env(), timeout=20)
    assert time.monotonic() - started < 10  # concurrent, and the slow one is cut at 0.5 s
    assert disk.ok and not disk.skipped and disk.message.endswith("passed: disk ok")
    assert not ib.ok and "exited with code 3: IB port 1 down" in ib.message
    assert (
        not slow.ok and "did not finish within 0.5 s" in slow.message and 0.5 <= slow.duration_s < 5
    )
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while pid_alive(grandchild) and time.monotonic() < deadline:  # the whole session was killed
        await asyncio.sleep(0.01)
    assert not pid_alive(grandchild)
    assert not missing.ok and "could not be started" in missing.message


def test_checks_for_job_orders_node_job_then_gpu() -> None:
    """A job's checks: the node's command, the job's command, then the GPU check when enabled."""
    checks = checks_for_job(["check.sh"], gpu=True, node_command=["node.sh"])
    assert [c.name for c in checks] == ["node_health_check", "health_check", "gpu"]
    assert checks_for_job(None, gpu=False) == []
