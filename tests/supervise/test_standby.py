"""The pure decisions of prewarm (issue 27): which programs a standby can run, when a
standby can become a worker, the environment it hands over; and the spec's ``prewarm``."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from elasticd.models import JobSpec
from elasticd.security import Identity
from elasticd.standby_main import environment
from elasticd.supervise.process import WorkerLaunch
from elasticd.supervise.standby import (
    PythonProgram,
    handoff_failure,
    mismatch,
    python_program,
    standby_env,
)

PY = "/opt/venv/bin/python3"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([PY, "train.py", "--lr", "1"], PythonProgram(PY, (), "script", "train.py", ("--lr", "1"))),
        (["python", "-u", "-m", "pkg.main", "x"], PythonProgram("python", ("-u",), "module", "pkg.main", ("x",))),
        (["python3.11", "-X", "dev", "-W", "error", "t.py"], PythonProgram("python3.11", ("-X", "dev", "-W", "error"), "script", "t.py", ())),
        (["python", "-I", "t.py", "-m", "z"], PythonProgram("python", ("-I",), "script", "t.py", ("-m", "z"))),
        (["/bin/sh", "-c", "python t.py"], "is not a Python interpreter"),
        (["pythonw", "t.py"], "is not a Python interpreter"),
        (["python", "-c", "print(1)"], "option '-c'"),
        (["python", "-"], "option '-'"),
        (["python", "-u"], "runs no script or module"),
        (["python", "-m"], "option '-m'"),
    ],
)  # fmt: skip
def test_a_standby_runs_a_script_or_a_module_under_python(
    argv: list[str], expected: PythonProgram | str
) -> None:
    got = python_program(argv)
    if isinstance(expected, str):
        assert isinstance(got, str)
        assert expected in got
    else:
        assert got == expected


def _launch(**changes: object) -> WorkerLaunch:
    fields: dict[str, object] = {
        "local_rank": 0,
        "argv": [PY, "t.py"],
        "env": {"PATH": "/bin", "RANK": "0", "MASTER_PORT": "1", "A": "1"},
        "cwd": "/w",
        "log_dir": Path("/l"),
        "umask": 0o27,
    }
    fields.update(changes)
    return WorkerLaunch(**fields)  # type: ignore[arg-type]


ALICE = Identity("alice", 1000, 1000, "/home/alice", (1000,))
BOB = Identity("bob", 1001, 1001, "/home/bob", (1001,))


@pytest.mark.parametrize(
    ("changes", "identity", "reason"),
    [
        ({}, ALICE, None),
        ({"env": {"PATH": "/bin", "RANK": "5", "MASTER_PORT": "9", "A": "1"}}, ALICE, None),
        ({"local_rank": 1, "log_dir": Path("/other")}, ALICE, None),
        ({"argv": [PY, "u.py"]}, ALICE, "command changed"),
        ({"cwd": "/elsewhere"}, ALICE, "working folder changed"),
        ({}, BOB, "user changed"),
        ({}, None, "user changed"),
        ({"umask": 0o22}, ALICE, "umask changed"),
        ({"env": {"PATH": "/bin", "RANK": "0", "MASTER_PORT": "1", "A": "2"}}, ALICE, "environment changed (A)"),
        ({"env": {"PATH": "/bin", "RANK": "0", "MASTER_PORT": "1"}}, ALICE, "environment changed (A)"),
    ],
)  # fmt: skip
def test_a_standby_becomes_a_worker_only_if_all_but_the_round_is_the_same(
    changes: dict[str, object], identity: Identity | None, reason: str | None
) -> None:
    got = mismatch(_launch(), ALICE, _launch(**changes), identity)
    assert got == reason if reason is None else reason in (got or "")


def test_a_standby_starts_without_the_rounds_variables() -> None:
    env = {"PATH": "/bin", "RANK": "3", "LOCAL_RANK": "1", "ELASTICD_ATTEMPT": "0.0", "X": "y"}
    assert standby_env(env) == {"PATH": "/bin", "X": "y"}


def test_the_hand_off_environment_keeps_what_the_start_shell_did() -> None:
    """The worker's environment, with the start shell's own edits (PWD set, a name unset)."""
    given = {"PATH": "/bin", "PWD": "/old", "GONE": "1", "A": "1"}
    had = {"PATH": "/bin", "PWD": "/w", "A": "1"}
    wanted = {"PATH": "/bin", "PWD": "/old", "GONE": "1", "A": "2", "RANK": "0"}
    assert environment(given, had, wanted) == {"PATH": "/bin", "PWD": "/w", "A": "2", "RANK": "0"}


@pytest.mark.parametrize("name", ["torch", "torch.distributed", "_x.y_2"])
def test_prewarm_takes_dotted_module_names(name: str) -> None:
    assert JobSpec(entrypoint="python", prewarm=[name]).prewarm == [name]


@pytest.mark.parametrize("name", ["", "os;rm", "1a", "a..b", "a.", ".a", "a b", "a-b"])
def test_prewarm_refuses_anything_but_a_module_name(name: str) -> None:
    with pytest.raises(ValidationError, match="prewarm"):
        JobSpec(entrypoint="python", prewarm=[name])


@pytest.mark.parametrize(
    ("exc", "cause"),
    [
        (TimeoutError(), "timed out after 5 s (the standby does not answer: stopped or stuck)"),
        (OSError("the standby ended before it took the worker's place"), "the standby ended"),
        (BrokenPipeError(32, "Broken pipe"), "[Errno 32] Broken pipe"),
        (ConnectionResetError(), "ConnectionResetError"),
        (ValueError(" "), "ValueError"),
    ],
)
def test_a_failed_hand_off_always_names_its_cause(exc: BaseException, cause: str) -> None:
    """The reason a rank starts cold after a failed hand-off names the cause, also for an
    exception whose text is empty (the bound's TimeoutError: issue 34, defect 6)."""
    said = handoff_failure(41, exc, 5.0)
    assert said.startswith("the hand-off to its standby (pid 41) failed: "), said
    assert cause in said, said
    assert not said.endswith(": "), said
