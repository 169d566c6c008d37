"""Real frameworks under torchrun and under `elasticd run`, with one restart.

Each framework trains a tiny model for 4 steps on 2 CPU processes (gloo); rank 1 crashes after
its first step in attempt 0 (TORCHELASTIC_RESTART_COUNT == 0). Both launchers run it with
`--max-restarts 1 --nproc-per-node 2` (torchrun also `--standalone`), side by side. Each rank of
a finished run writes ``rank<RANK>.json``: world size, steps, restart count.

`elasticd run` must finish: exit 0 and both ranks' records from attempt 1. torchrun 2.13's
restart is unreliable on this CPU gloo setup: its restarted workers meet again in the agent's
store on the same MASTER_PORT, and there gloo's `connectFullMesh` often fails ("Connection
refused") or hangs, so the run exits 1 or never ends (seen with plain torch and with each of
these frameworks); sometimes it finishes. So torchrun's run is bounded (until
`elasticd run` is done plus TORCHRUN_GRACE seconds) and its outcome is printed (`pytest -rA`
shows it), not asserted; when torchrun finishes, its records must equal `elasticd run`'s.

A missing framework skips its test, unless CI is set: .ci/run installs requirements-dev.txt,
so there a missing package fails.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.compat.launchers import EXIT_ABORT, Outcome, started

pytestmark = [pytest.mark.slow, pytest.mark.torch, pytest.mark.timeout(150)]

SCRIPTS = Path(__file__).resolve().parent / "frameworks"
TORCHRUN_GRACE = 15.0
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}  # build from configs only
FRAMEWORKS = {  # script -> the module it needs
    "accelerate_train.py": "accelerate",
    "transformers_train.py": "transformers",
    "fabric_train.py": "lightning_fabric",
}


def run_side_by_side(home: Path, args: list[str]) -> dict[str, Outcome]:
    """Both launchers at once; torchrun is given until `elasticd run` ends plus TORCHRUN_GRACE."""
    with started(home, args, env=OFFLINE) as procs:
        procs["elasticd"][0].wait(120)
        try:
            procs["torchrun"][0].wait(TORCHRUN_GRACE)
        except subprocess.TimeoutExpired:
            pass  # killed on leaving the block: returncode -9
    return {
        name: Outcome(
            returncode=proc.returncode,
            stdout=(out.parent / "stdout").read_text(errors="replace"),
            stderr=(out.parent / "stderr").read_text(errors="replace"),
            out=out,
        )
        for name, (proc, out) in procs.items()
    }


def records(out: Path) -> dict[str, dict[str, object]]:
    return {p.name: json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))}


@pytest.mark.parametrize("script", list(FRAMEWORKS), ids=[s.split("_")[0] for s in FRAMEWORKS])
def test_framework_recovers_from_a_crash_of_rank_1(tmp_path, script):
    """Under `elasticd run` the framework's job restarts once and finishes on both ranks; torchrun's
    outcome is printed and, if it finished, compared."""
    module = FRAMEWORKS[script]
    if importlib.util.find_spec(module) is None and not os.environ.get("CI"):
        pytest.skip(f"{module} is not installed (pip install -r requirements-dev.txt)")
    args = [
        "--standalone",
        "--nproc-per-node=2",
        "--max-restarts=1",
        str(SCRIPTS / script),
        "{out}",
    ]
    for attempt in range(2):  # once more after torch's exit-time abort (launchers.EXIT_ABORT)
        outcomes = run_side_by_side(tmp_path / f"try{attempt}", args)
        if outcomes["elasticd"].returncode == 0 or EXIT_ABORT not in outcomes["elasticd"].stderr:
            break
    done = outcomes["elasticd"]
    assert done.returncode == 0, done.text()[-6000:]
    expected = {
        f"rank{rank}.json": {
            "loss_is_finite": True,
            "rank": rank,
            "restart_count": 1,
            "steps": 4,
            "world_size": 2,
        }
        for rank in (0, 1)
    }
    assert records(done.out) == expected
    for name, outcome in outcomes.items():
        assert "rank 1: crashing on purpose in attempt 0" in outcome.stderr, name
    torchrun = outcomes["torchrun"]
    ended = torchrun.returncode
    print(f"torchrun: {'hung, killed' if ended < 0 else f'exit {ended}'}")  # pytest -rA shows it
    if ended == 0:
        assert records(torchrun.out) == expected
