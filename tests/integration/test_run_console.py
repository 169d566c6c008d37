"""What `elasticd run` prints of its own (issue 28, item 2): torchrun's few lines, each once.

Real `elasticd run` processes with their embedded daemon and real workers; only stderr's
lines of elasticd's (log lines and `[elasticd]` lines) are counted, not the workers' output.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

CRASH_ONCE = """
import os
print("rank", os.environ["RANK"], "attempt", os.environ["TORCHELASTIC_RESTART_COUNT"], flush=True)
if os.environ["LOCAL_RANK"] == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    raise ValueError("boom")
"""

SLEEPER = """
import os, pathlib, time
pathlib.Path(os.environ["OUT"], f"started-{os.getpid()}").touch()
time.sleep(600)
"""

#: A line of the daemon's log: "2026-11-26 14:10:08,426 INFO elasticd....: ...".
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ [A-Z]+ ")


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTICD_", "PET_"))}
    env.update(ELASTICD_ALLOW_ROOT="true", OUT=str(tmp_path))
    return env


def _argv(tmp_path: Path, *flags: str, script: str) -> list[str]:
    return [sys.executable, "-m", "elasticd", "run", *flags, "--nproc-per-node", "2"] + [
        "--termination-grace",
        "2",
        "--state-dir",
        str(tmp_path / "state"),
        "--",
        "python3",
        script,
    ]


def _ours(stderr: str) -> list[str]:
    """elasticd's own lines: its log lines and its [elasticd] lines (not the workers')."""
    return [
        line
        for line in stderr.splitlines()
        if line.startswith("[elasticd]") or LOG_LINE.match(line)
    ]


def _without_time(line: str) -> str:
    return LOG_LINE.sub("", line)


@pytest.mark.parametrize(
    ("flags", "most"),
    [((), 3), (("--quiet",), 0), (("--verbose",), 60)],
)
def test_a_crash_once_run_prints_a_few_lines_each_once(tmp_path, flags, most):
    """By default: submitted, the restart with its cause, the end; --quiet none; no line twice."""
    (tmp_path / "crash.py").write_text(CRASH_ONCE)
    done = subprocess.run(
        _argv(tmp_path, "--max-restarts", "1", *flags, script="crash.py"),
        env=_env(tmp_path),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=90,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr
    ours = _ours(done.stderr)
    assert len(ours) <= most, done.stderr
    # Each event once: not also as a log line (the events' logger, the workers' starts and
    # exits); and, but for --verbose's every event (two attempts say alike things), no two
    # lines the same.
    for logger in ("elasticd.node.events", "elasticd.supervise.process"):
        assert not [line for line in ours if logger in line], done.stderr
    said = Counter(_without_time(line) for line in ours)
    if flags != ("--verbose",):
        assert [text for text, n in said.items() if n > 1] == [], done.stderr
    assert "ValueError: boom" in done.stderr  # the worker's own traceback, passed on
    if flags == ():
        assert ours[0].startswith("[elasticd] job ") and " submitted: 2 worker(s)" in ours[0]
        assert "rank 1 failed on localhost: ValueError: boom; re-forming the group" in ours[1]
        assert ours[-1].endswith("SUCCEEDED after 1 restart(s)"), ours
    if flags == ("--verbose",):
        kinds = [line.split()[1] for line in ours if line.startswith("[elasticd] ")]
        assert kinds.count("workers.started:") == 2 and "recovery.total:" in kinds, done.stderr


def test_ctrl_c_ends_with_a_line_that_says_the_user_stopped_it(tmp_path):
    """After SIGINT the last line says the job was stopped by the user, not a job state."""
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    err = tmp_path / "stderr"
    with err.open("w") as out:
        proc = subprocess.Popen(
            _argv(tmp_path, "--verbose", script="sleeper.py"),
            env=_env(tmp_path),
            cwd=tmp_path,
            stdout=subprocess.DEVNULL,
            stderr=out,
            stdin=subprocess.DEVNULL,
        )
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("started-*"))) < 2:
            assert time.monotonic() < deadline and proc.poll() is None, err.read_text()
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = err.read_text().splitlines()
    assert lines[-1].startswith("[elasticd] job "), lines
    assert lines[-1].endswith("stopped by the user (Ctrl-C): its workers were stopped; exit 130")
