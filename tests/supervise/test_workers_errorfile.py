"""read_error_file: torch's @record format, older formats, and content that must not break it."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from elasticd.supervise.errorfile import MAX_ERROR_FILE_BYTES, WorkerError, read_error_file

EXITED = 1_700_000_999.5

TORCH_FORMAT = {
    "message": {
        "message": "ValueError: boom",
        "extraInfo": {
            "py_callstack": 'Traceback (most recent call last):\n  File "x.py"\nValueError: boom\n',
            "timestamp": "1700000000",
        },
    }
}


def _write(path: Path, content: object) -> Path:
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def test_torch_record_format(tmp_path: Path) -> None:
    """torch's nested format yields its message, traceback and integer-string timestamp."""
    path = _write(tmp_path / "error.json", TORCH_FORMAT)
    assert read_error_file(path, default_timestamp=EXITED) == WorkerError(
        message="ValueError: boom",
        traceback=TORCH_FORMAT["message"]["extraInfo"]["py_callstack"],  # type: ignore[index]
        timestamp=1_700_000_000.0,
        raw=TORCH_FORMAT,
    )


def test_string_message_with_top_level_timestamp(tmp_path: Path) -> None:
    """A plain string message is the message; a top-level timestamp is honoured."""
    path = _write(tmp_path / "error.json", {"message": "it broke", "timestamp": 1700000123})
    error = read_error_file(path, default_timestamp=EXITED)
    assert error is not None
    assert (error.message, error.traceback, error.timestamp) == ("it broke", None, 1700000123.0)


@pytest.mark.parametrize(
    "content",
    [
        {"message": "no time"},
        {"message": {"message": "x", "extraInfo": {"timestamp": "soon"}}},
        {"message": {"message": "x", "extraInfo": {"timestamp": True}}},
        {"message": {"message": "x", "extraInfo": {"timestamp": "1e999"}}},
        {"message": {"message": "x", "extraInfo": {"timestamp": 10**400}}},
        {"message": {"message": "x", "extraInfo": "not a dict"}},
    ],
)
def test_missing_or_bad_timestamp_falls_back_to_the_exit_time(
    tmp_path: Path, content: object
) -> None:
    """Without a usable timestamp in the file, the caller's exit time is used."""
    error = read_error_file(_write(tmp_path / "error.json", content), default_timestamp=EXITED)
    assert error is not None
    assert error.timestamp == EXITED


def test_without_a_fallback_the_file_time_is_used(tmp_path: Path) -> None:
    """With no timestamp in the file and no fallback given, the file's modification time is used."""
    path = _write(tmp_path / "error.json", {"message": "x"})
    os.utime(path, (1_600_000_000, 1_600_000_000))
    error = read_error_file(path)
    assert error is not None
    assert error.timestamp == 1_600_000_000.0


def test_missing_message_is_said_so(tmp_path: Path) -> None:
    """A JSON object without a message gets one saying so, and keeps the raw content."""
    error = read_error_file(_write(tmp_path / "error.json", {"errorCode": 3}), default_timestamp=1)
    assert error is not None
    assert "has no message" in error.message
    assert error.raw == {"errorCode": 3}


def test_absent_file_is_none(tmp_path: Path) -> None:
    """No file means no error, not an error about the file."""
    assert read_error_file(tmp_path / "error.json") is None


@pytest.mark.parametrize(
    ("content", "why"),
    [
        ('{"message": {"message": "cut off', "not valid JSON"),
        ("", "not valid JSON"),
        (b"\xff\xfe\x00garbage", "not valid JSON"),
        ("[1, 2, 3]", "not an object"),
        ("[" * 100_000 + "]" * 100_000, "not valid JSON"),
    ],
    ids=["truncated", "empty", "binary", "array", "deeply-nested"],
)
def test_unparseable_content_is_reported_not_raised(
    tmp_path: Path, content: str | bytes, why: str
) -> None:
    """Garbage yields a WorkerError saying the file was unreadable, with the exit time."""
    path = tmp_path / "error.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    error = read_error_file(path, default_timestamp=EXITED)
    assert error is not None
    assert why in error.message
    assert str(path) in error.message
    assert (error.traceback, error.timestamp, error.raw) == (None, EXITED, {})


def test_a_huge_file_is_not_parsed(tmp_path: Path) -> None:
    """A file over the size cap is refused without being parsed, however valid it is."""
    big = {"message": {"message": "x" * (MAX_ERROR_FILE_BYTES + 1)}}
    error = read_error_file(_write(tmp_path / "error.json", big), default_timestamp=EXITED)
    assert error is not None
    assert "larger than" in error.message
    assert len(error.message) < 500


def test_links_directories_and_fifos_are_refused(tmp_path: Path) -> None:
    """The daemon follows no link the worker planted, and does not block on a FIFO."""
    secret = _write(tmp_path / "secret.json", {"message": "not the worker's"})
    link = tmp_path / "link.json"
    link.symlink_to(secret)
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    for path, why in [(link, "cannot be opened"), (tmp_path, "not a regular file")]:
        error = read_error_file(path, default_timestamp=EXITED)
        assert error is not None
        assert why in error.message
    result: list[WorkerError | None] = []
    reader = threading.Thread(target=lambda: result.append(read_error_file(fifo)), daemon=True)
    reader.start()
    reader.join(timeout=5)
    assert not reader.is_alive(), "read_error_file blocked on a FIFO"
    assert result[0] is not None
    assert "not a regular file" in result[0].message
