"""The IO around a Slurm step's run: the shared token, and ``elasticd run --nnodes`` refused
outside a step."""

from __future__ import annotations

import stat
import threading

import pytest

from elasticd import cli
from elasticd.errors import ConfigError
from elasticd.slurm import run as slurm_run


def test_tasks_racing_on_a_shared_home_all_get_one_token(tmp_path, monkeypatch):
    """Tasks that start at once on a shared home end with one 0600 token file, the same for
    all, and leave no temporary file behind."""
    monkeypatch.setattr(slurm_run, "DEFAULT_TOKEN", tmp_path / "home" / "slurm-token")
    paths, start = [], threading.Barrier(8)

    def task() -> None:
        start.wait()
        paths.append(slurm_run.shared_token(None))

    threads = [threading.Thread(target=task) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    target = tmp_path / "home" / "slurm-token"
    assert paths == [target] * 8
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert len(target.read_text().strip()) >= 32
    assert [p.name for p in target.parent.iterdir()] == ["slurm-token"]


def test_a_given_token_file_must_exist(tmp_path):
    """--token-file names a file the step's tasks share: a missing one is refused."""
    with pytest.raises(ConfigError, match="no such file"):
        slurm_run.shared_token(tmp_path / "absent")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run", "--nnodes", "2:3", "--", "true"], "runs inside a Slurm step"),
        (["run", "--store-url", "etcd://h:2379", "--", "true"], "go with --nnodes"),
    ],
)
def test_run_nnodes_is_refused_outside_a_slurm_step(argv, message, monkeypatch, capsys):
    """Outside ``srun`` (no SLURM_STEP_ID), --nnodes and its companions exit 2 saying why."""
    for name in ("SLURM_JOB_ID", "SLURM_JOBID", "SLURM_STEP_ID", "SLURM_STEPID"):
        monkeypatch.delenv(name, raising=False)
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err
