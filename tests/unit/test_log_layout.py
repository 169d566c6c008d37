"""The worker log layout has one owner (issue 13): ``elasticd.logs.LogLayout``."""

from __future__ import annotations

import re
from pathlib import Path

from elasticd.logs import LogLayout, attempt_of, stream_file

ROOT = Path(__file__).resolve().parents[2]


def test_paths_follow_the_documented_layout(tmp_path: Path) -> None:
    logs = LogLayout(tmp_path)
    assert logs.worker_dir("j", 3, 1) == tmp_path / "j" / "attempt_3" / "1"
    assert logs.log_file("j", 3, 1, "stderr") == tmp_path / "j" / "attempt_3" / "1" / "stderr.log"
    assert logs.error_file("j", 0, 0).name == "error.json"
    assert logs.heartbeat_file("j", 0, 0).name == "heartbeat"
    assert stream_file("stdout") == "stdout.log"
    assert attempt_of(logs.worker_dir("j", 12, 0)) == 12
    assert attempt_of(tmp_path / "j" / "other" / "0") is None


def test_attempts_are_listed_by_number_and_junk_is_ignored(tmp_path: Path) -> None:
    logs = LogLayout(tmp_path)
    assert logs.attempts("j") == [] and logs.last_attempt("j") == -1
    for name in ("attempt_10", "attempt_2", "attempt_x", "attempt_", "attempt_\u0661", "junk"):
        (tmp_path / "j" / name).mkdir(parents=True)
    (tmp_path / "j" / "attempt_7").write_text("a file named like an attempt still counts")
    assert logs.attempts("j") == [2, 7, 10]
    assert logs.last_attempt("j") == 10


def test_no_other_module_builds_the_layout() -> None:
    """``attempt_<n>`` folders, ``<stream>.log`` and ``error.json`` are named in elasticd/logs.py only."""
    built = re.compile(
        r"""f["']attempt_\{|["']attempt_["']|f["']\{stream\}\.log|["'](stdout|stderr)\.log["']"""
    )
    offenders = [
        f"{path.relative_to(ROOT)}:{n}"
        for package in ("elasticd", "api")
        for path in sorted((ROOT / package).rglob("*.py"))
        if path.name != "logs.py" or path.parent.name != "elasticd"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if built.search(line) and not line.lstrip().startswith("#")
    ]
    assert offenders == []


def test_a_job_folder_names_its_job_and_an_earlier_jobs_folder_is_moved_aside(
    tmp_path: Path,
) -> None:
    """A deleted job's id taken again: the new job's claim moves the old folder to .retired
    (out of every job id's reach) and starts empty; only the claiming job's folder belongs."""
    logs = LogLayout(tmp_path)
    assert not logs.belongs("j", "first")
    logs.claim("j", "first")
    (tmp_path / "j" / "attempt_0").mkdir()
    (tmp_path / "j" / "attempt_0" / "secret").write_text("the first job's")
    logs.claim("j", "first")  # a daemon restart: the same job keeps its folder
    assert logs.belongs("j", "first") and logs.attempts("j") == [0]
    logs.claim("j", "second")
    assert logs.belongs("j", "second") and not logs.belongs("j", "first")
    assert logs.attempts("j") == []
    (moved,) = (tmp_path / ".retired").iterdir()
    assert (moved / "attempt_0" / "secret").read_text() == "the first job's"
    assert (tmp_path / ".retired").stat().st_mode & 0o777 == 0o700
    (tmp_path / "legacy" / "attempt_0").mkdir(parents=True)  # from before the marker
    assert not logs.belongs("legacy", "any")
