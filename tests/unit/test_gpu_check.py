"""bench/gpu_check.py (`make gpu-check`): its decisions, its health check, its no-GPU path.

No GPU here: the health-check part runs against a fake `nvidia-smi` (an executable
script); the device and NCCL checks need a real GPU and a daemon, and are judged here
only through their pure parts.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

# bench/ is scripts, not a package of the project: importable from the checkout's root.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.gpu_check import (  # noqa: E402
    NO_GPU_EXIT,
    Outcome,
    check_health,
    exit_code,
    gpus_present,
    judge_devices,
    split_devices,
)

ROOT = Path(__file__).resolve().parents[2]

GOOD = "0, 00000000:18:00.0, NVIDIA H100, 0, No\n1, 00000000:2A:00.0, NVIDIA H100, 0, No\n"
LOST = "0, 00000000:18:00.0, NVIDIA H100, 0, No\n1, 00000000:2A:00.0, [GPU is lost], 0, No\n"


def fake_nvidia_smi(tmp_path: Path, query: str) -> Path:
    """An `nvidia-smi` answering `-L` with two GPUs and `--query-gpu` with `query`."""
    path = tmp_path / "nvidia-smi"
    path.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = -L ]; then\n'
        "  echo 'GPU 0: NVIDIA H100 (UUID: GPU-a)'; echo 'GPU 1: NVIDIA H100 (UUID: GPU-b)'\n"
        "else\n"
        f"  printf '%s' '{query}'\n"
        "fi\n"
    )
    path.chmod(0o755)
    return path


def test_the_health_check_runs_the_daemons_check_against_nvidia_smi(tmp_path):
    """Two healthy GPUs pass; a GPU nvidia-smi reports lost fails, naming it."""
    smi = fake_nvidia_smi(tmp_path, GOOD)
    assert gpus_present(str(smi)) == ["0", "1"]
    passed = check_health(str(smi))
    assert passed.status == "passed" and "2 GPU(s) healthy" in passed.detail, passed
    lost = check_health(str(fake_nvidia_smi(tmp_path, LOST)))
    assert lost.status == "failed" and "GPU is lost" in lost.detail, lost


def test_a_skipped_health_check_is_a_failure_on_a_gpu_node(tmp_path):
    """The check must run where GPUs were found: its 'skipped' (no nvidia-smi) fails it."""
    assert check_health(str(tmp_path / "absent" / "nvidia-smi")).status == "failed"


@pytest.mark.parametrize(
    ("gpus", "halves"),
    [(["0"], (["0"], [])), (["0", "1"], (["0"], ["1"])), (["0", "1", "2"], (["0", "1"], ["2"]))],
)
def test_split_devices(gpus, halves):
    """The two jobs share the node's GPUs in halves, the first taking the odd one."""
    assert split_devices(gpus) == halves


@pytest.mark.parametrize(
    ("seen", "sizes", "status"),
    [
        ({"a": {"0"}, "b": {"1"}}, {"a": 1, "b": 1}, "passed"),
        ({"a": {"0", "1"}, "b": {"2", "3"}}, {"a": 2, "b": 2}, "passed"),
        ({"a": {"0"}, "b": {"0"}}, {"a": 1, "b": 1}, "failed"),  # shared
        ({"a": {"0", "1"}, "b": {"1"}}, {"a": 1, "b": 1}, "failed"),  # too many
        ({"a": {"<unset>"}, "b": {"1"}}, {"a": 1, "b": 1}, "passed"),
    ],
)
def test_judge_devices(seen, sizes, status):
    """Disjoint sets of the right sizes pass; a shared device or a wrong count fails."""
    assert judge_devices(seen, sizes).status == status


def test_judge_devices_names_the_shared_gpu():
    """The failure says which GPU two jobs share."""
    assert "share GPU(s) ['0']" in judge_devices({"a": {"0"}, "b": {"0"}}, {"a": 1, "b": 1}).detail


@pytest.mark.parametrize(
    ("statuses", "code"),
    [([], 0), (["passed", "skipped"], 0), (["passed", "failed", "skipped"], 1)],
)
def test_exit_code(statuses, code):
    """A failed check fails the run; a skipped one (torch without CUDA) does not."""
    assert exit_code([Outcome(str(i), s, "") for i, s in enumerate(statuses)]) == code


@pytest.mark.parametrize(("flags", "code"), [((), 0), (("--require-gpu",), NO_GPU_EXIT)])
def test_without_a_gpu_it_says_so_plainly(tmp_path, flags, code):
    """No nvidia-smi: 'no GPU: skipped', exit 0 (77 with --require-gpu), and no daemon started."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_check.py"), *flags]
        + ["--nvidia-smi", str(tmp_path / "absent"), "--json", str(tmp_path / "summary.json")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == code, done.stdout + done.stderr
    assert done.stdout.startswith("no GPU: skipped"), done.stdout
    assert '"gpus": null' in (tmp_path / "summary.json").read_text()
