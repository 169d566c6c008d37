"""The cause of a failure from the last traceback of a worker's stderr.log (no error file)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from elasticd.supervise.tracebacks import TAIL_BYTES, last_traceback, traceback_from_log

SIMPLE = 'Traceback (most recent call last):\n  File "t.py", line 3, in <module>\n    boom()\nValueError: boom'
CHAINED = (
    'Traceback (most recent call last):\n  File "t.py", line 2, in <module>\n    {}["k"]\n'
    "KeyError: 'k'\n\nDuring handling of the above exception, another exception occurred:\n\n"
    'Traceback (most recent call last):\n  File "t.py", line 4, in <module>\n    raise RuntimeError("x")\n'
    "RuntimeError: x"
)
CAUSED = CHAINED.replace(
    "During handling of the above exception, another exception occurred:",
    "The above exception was the direct cause of the following exception:",
)
SECOND = SIMPLE.replace("ValueError: boom", "OSError: disk")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", None),
        ("loss 0.3\nloss 0.2\n", None),
        (SIMPLE + "\n", SIMPLE),
        (
            "step 1\n" + SIMPLE + "\nexiting\n",
            SIMPLE,
        ),  # what follows the exception line is not taken
        (SIMPLE.replace("\n", "\r\n"), SIMPLE),
        (SIMPLE + "\nlater\n" + SECOND + "\n", SECOND),  # the last one
        ("x\n" + CHAINED + "\n", CHAINED),  # its chain along
        (CAUSED, CAUSED),
        # A chain marker with no complete traceback before it: only the last.
        (
            "During handling of the above exception, another exception occurred:\n\n" + SIMPLE,
            SIMPLE,
        ),
        # Cut off before the exception line (killed while printing): the earlier complete one.
        (SIMPLE + "\n" + 'Traceback (most recent call last):\n  File "t.py"', SIMPLE),
        ('Traceback (most recent call last):\n  File "t.py", line 1', None),
        ("Traceback (most recent call last):\nnot a frame\n", None),
        ("  Traceback (most recent call last):\n  x\nE: y\n", None),  # not at a line's start
        (
            "Traceback (most recent call last):\n"
            '  File "<string>", line 1\n    def (\n        ^\nSyntaxError: invalid syntax\n',
            "Traceback (most recent call last):\n"
            '  File "<string>", line 1\n    def (\n        ^\nSyntaxError: invalid syntax',
        ),
    ],
)
def test_last_traceback(text: str, expected: str | None) -> None:
    """The last complete traceback, with its chain, ends at its exception line."""
    assert last_traceback(text) == expected


def _rank_dir(tmp_path: Path) -> Path:
    rank = tmp_path / "attempt_0" / "0"
    rank.mkdir(parents=True)
    return rank


def test_the_log_gives_message_traceback_and_source(tmp_path: Path) -> None:
    """The exception line is the message, the traceback kept, the source `log`, the time the exit's."""
    rank = _rank_dir(tmp_path)
    (rank / "stderr.log").write_text("warming up\n" + SIMPLE + "\n")
    error = traceback_from_log(rank, timestamp=12.5)
    assert error is not None
    assert (error.message, error.traceback, error.timestamp, error.source) == (
        "ValueError: boom",
        SIMPLE,
        12.5,
        "log",
    )


def test_only_the_tail_is_read(tmp_path: Path) -> None:
    """A traceback before the last TAIL_BYTES of a long log is not seen: the read is bounded."""
    rank = _rank_dir(tmp_path)
    (rank / "stderr.log").write_text(SIMPLE + "\n" + "x" * TAIL_BYTES + "\n")
    assert traceback_from_log(rank, timestamp=0) is None
    (rank / "stderr.log").write_text("x" * (4 * TAIL_BYTES) + "\n" + SIMPLE + "\n")
    error = traceback_from_log(rank, timestamp=0)
    assert error is not None and error.traceback == SIMPLE


def test_what_a_worker_planted_is_not_read(tmp_path: Path) -> None:
    """A link, a FIFO or a hard link in place of stderr.log gives no cause and never blocks."""
    secret = tmp_path / "secret"
    secret.write_text(SIMPLE + "\n")
    rank = _rank_dir(tmp_path)
    log = rank / "stderr.log"
    assert traceback_from_log(rank, timestamp=0) is None  # absent
    log.symlink_to(secret)
    assert traceback_from_log(rank, timestamp=0) is None
    log.unlink()
    os.mkfifo(log)
    assert traceback_from_log(rank, timestamp=0) is None
    log.unlink()
    os.link(secret, log)
    assert traceback_from_log(rank, timestamp=0) is None
