"""elasticd.worker.record: torch's @record error file, written without importing torch."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
import textwrap
import time
from pathlib import Path

import pytest

from elasticd.supervise.errorfile import read_error_file
from elasticd.worker import record
from elasticd.worker.errors import ENV_VAR

from .support import child_env


def fails() -> None:
    raise ValueError("batch 7 is corrupt")


def test_an_exception_becomes_torchs_error_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file has torch's nesting, message, traceback and integer-second timestamp, and is re-raised."""
    path = tmp_path / "error.json"
    monkeypatch.setenv(ENV_VAR, str(path))

    @record
    def main() -> None:
        fails()

    before = int(time.time())
    with pytest.raises(ValueError, match="batch 7"):
        main()
    data = json.loads(path.read_text())
    assert set(data) == {"message"}
    assert set(data["message"]) == {"message", "extraInfo"}
    assert data["message"]["message"] == "ValueError: batch 7 is corrupt"
    extra = data["message"]["extraInfo"]
    assert set(extra) == {"py_callstack", "timestamp"}
    assert extra["py_callstack"].startswith("Traceback (most recent call last)")
    assert "in fails" in extra["py_callstack"]
    assert isinstance(extra["timestamp"], str) and before <= int(extra["timestamp"]) <= time.time()
    error = read_error_file(path)
    assert error is not None and error.message == "ValueError: batch 7 is corrupt"


def test_exit_zero_returns_none_and_other_exits_pass_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SystemExit(0) returns None; SystemExit(3) and KeyboardInterrupt propagate unrecorded."""
    path = tmp_path / "error.json"
    monkeypatch.setenv(ENV_VAR, str(path))

    @record
    def leave(code: int) -> int:
        raise SystemExit(code)

    @record
    def interrupted() -> None:
        raise KeyboardInterrupt

    assert leave(0) is None
    with pytest.raises(SystemExit):
        leave(3)
    with pytest.raises(KeyboardInterrupt):
        interrupted()
    assert not path.exists()


def test_without_the_variable_nothing_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As with torch, no TORCHELASTIC_ERROR_FILE means no file, and the value passes through."""
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.chdir(tmp_path)

    @record
    def ok(x: int) -> int:
        return x + 1

    assert ok(1) == 2
    with pytest.raises(ValueError, match="corrupt"):
        record(fails)()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
async def test_the_file_matches_torchs_own_record(tmp_path: Path) -> None:
    """torch's @record and ours write the same keys and message for the same failure."""
    code = """
        import sys
        if sys.argv[1] == "torch":
            from torch.distributed.elastic.multiprocessing.errors import record
        else:
            from elasticd.worker import record

        @record
        def main():
            raise RuntimeError("rank 3 lost its GPU")

        main()
    """
    files = {}
    for flavour in ("torch", "elasticd"):
        files[flavour] = tmp_path / f"{flavour}.json"
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            textwrap.dedent(code),
            flavour,
            env=child_env({ENV_VAR: str(files[flavour]), "PYTHONWARNINGS": "ignore"}),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        async with asyncio.timeout(60):
            assert await proc.wait() == 1
    theirs = json.loads(files["torch"].read_text())
    ours = json.loads(files["elasticd"].read_text())
    assert ours["message"]["message"] == theirs["message"]["message"]
    assert set(ours["message"]["extraInfo"]) == set(theirs["message"]["extraInfo"])
    assert (
        ours["message"]["extraInfo"]["py_callstack"].splitlines()[-1]
        == (theirs["message"]["extraInfo"]["py_callstack"].splitlines()[-1])
    )
