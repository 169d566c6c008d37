"""A few seconds of issue #6's load benchmark, as a smoke test of the daemon and of the bench.

The full figures (200 req/s for 60 s, a crash every 10 s, RSS flatness) come
from ``bench/bench_load.py`` itself; see docs/reliability.md. Here: 50 req/s
of the same mixed reads for 5 s, a submission every second and a job that
crashes every second, so every path of the load runs, bounded, in ~15 s.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def test_a_short_mixed_load_with_a_crash_looping_job_has_no_errors(tmp_path: Path) -> None:
    out = tmp_path / "load.json"
    argv = [
        sys.executable,
        str(ROOT / "bench" / "bench_load.py"),
        *("--seconds", "5", "--warmup", "2", "--rate", "50"),
        *("--crash-every", "1", "--submit-every", "1", "--json", str(out)),
    ]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert done.returncode in (0, 1), done.stdout + done.stderr  # 2: it could not measure
    figures = json.loads(out.read_text())["figures"]
    assert figures["errors"] == 0, figures["error_samples"]
    assert figures["reads"] == 250
    assert figures["restarts_during_load"] >= 1
    states = figures["submitted_states"]
    assert len(states) == 5 and set(states.values()) == {"SUCCEEDED"}, states
    assert figures["daemon_exit_code"] == 0
