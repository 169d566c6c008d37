"""The cause of a failure from the last traceback of a worker's stderr.log (no error file)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from elasticd.supervise.tracebacks import (
    TAIL_BYTES,
    LogCause,
    last_cause,
    last_traceback,
    traceback_from_log,
)
from tests.supervise.support import worker_folder

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


def _ranked(text: str, rank: int = 1) -> str:
    """`text` as torch's excepthook prints it after init_process_group (blank lines bare)."""
    return "\n".join(f"[rank{rank}]: {line}" if line else "" for line in text.split("\n"))


GLOO_ABORT = (
    "terminate called after throwing an instance of 'gloo::IoException'\n"
    "  what():  [../third_party/gloo/gloo/transport/tcp/pair.cc:589] Read error "
    "[127.0.0.1]:41231: Connection reset by peer\n"
)
NCCL_ABORT = (
    "[rank0]:[E1201 10:00:00.123456 77 ProcessGroupNCCL.cpp:616] [Rank 0] Watchdog caught "
    "collective operation timeout: WorkNCCL(SeqNum=3, OpType=ALLREDUCE) ran for 600000 ms\n"
    "[rank0]:[E1201 10:00:00.200000 77 ProcessGroupNCCL.cpp:1537] [PG 0 Rank 0] Process group "
    "watchdog thread terminated with exception: timeout\n"
    "terminate called after throwing an instance of 'c10::DistBackendError'\n"
    "  what():  [PG 0 Rank 0] Process group watchdog thread terminated with exception: timeout\n"
    "Exception raised from checkTimeout at ProcessGroupNCCL.cpp:616 (most recent call first):\n"
    "frame #0: c10::Error::Error() + 0x9a (0x7f in libc10.so)\n"
    "\n"
    "later output\n"
)
RANK_CRASH = (
    'Traceback (most recent call last):\n  File "ddp.py", line 20, in <module>\n    main()\n'
    '  File "ddp.py", line 15, in main\n    raise RuntimeError("rank 1 crashes at step 2")\n'
    "RuntimeError: rank 1 crashes at step 2"
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", None),
        ("loss 0.3\n", None),
        # torch's rank prefix on every line: the exception line as Python wrote it.
        (
            "[rank1]:[W1201 gloo.cpp:1] warn\n" + _ranked(RANK_CRASH) + "\n",
            LogCause("RuntimeError: rank 1 crashes at step 2", RANK_CRASH),
        ),
        # A chained exception, prefixed: the last exception is the error, the chain kept.
        (_ranked(CHAINED) + "\n", LogCause("RuntimeError: x", CHAINED)),
        (_ranked(CAUSED), LogCause("RuntimeError: x", CAUSED)),
        # gloo's C++ abort: the thrown type and the first line of what().
        (
            "step 1\n" + GLOO_ABORT,
            LogCause(
                "gloo::IoException: [../third_party/gloo/gloo/transport/tcp/pair.cc:589] Read "
                "error [127.0.0.1]:41231: Connection reset by peer",
                GLOO_ABORT.rstrip("\n"),
            ),
        ),
        # NCCL's watchdog abort: the what() line, not the log lines before it.
        (
            NCCL_ABORT,
            LogCause(
                "c10::DistBackendError: [PG 0 Rank 0] Process group watchdog thread terminated "
                "with exception: timeout",
                "\n".join(NCCL_ABORT.split("\n")[2:6]),
            ),
        ),
        # A traceback after an abort line is the later cause, and an abort after one too.
        (GLOO_ABORT + SIMPLE, LogCause("ValueError: boom", SIMPLE)),
        (SIMPLE + "\n" + GLOO_ABORT, last_cause(GLOO_ABORT)),
        # Neither: the last error line of torch's C++ log.
        (
            NCCL_ABORT.split("terminate called")[0],
            LogCause(
                "[PG 0 Rank 0] Process group watchdog thread terminated with exception: timeout",
                NCCL_ABORT.split("\n")[1].removeprefix("[rank0]:"),
            ),
        ),
        # A terminate line without what(): not an abort.
        ("terminate called after throwing an instance of 'x'\n", None),
    ],
)
def test_last_cause(text: str, expected: LogCause | None) -> None:
    """A rank's last traceback (rank prefix off, last of a chain), abort or C++ error line."""
    assert last_cause(text) == expected


def test_a_prefixed_log_gives_the_exception_line(tmp_path: Path) -> None:
    """A DDP rank's stderr.log, prefixed by torch's excepthook, names the exception."""
    rank = worker_folder(tmp_path)
    (rank / "stderr.log").write_text("loss 0.1\n" + _ranked(RANK_CRASH) + "\n")
    error = traceback_from_log(rank, timestamp=1.0)
    assert error is not None
    assert (error.message, error.traceback) == (
        "RuntimeError: rank 1 crashes at step 2",
        RANK_CRASH,
    )


def test_the_log_gives_message_traceback_and_source(tmp_path: Path) -> None:
    """The exception line is the message, the traceback kept, the source `log`, the time the exit's."""
    rank = worker_folder(tmp_path)
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
    rank = worker_folder(tmp_path)
    (rank / "stderr.log").write_text(SIMPLE + "\n" + "x" * TAIL_BYTES + "\n")
    assert traceback_from_log(rank, timestamp=0) is None
    (rank / "stderr.log").write_text("x" * (4 * TAIL_BYTES) + "\n" + SIMPLE + "\n")
    error = traceback_from_log(rank, timestamp=0)
    assert error is not None and error.traceback == SIMPLE


def test_what_a_worker_planted_is_not_read(tmp_path: Path) -> None:
    """A link, a FIFO or a hard link in place of stderr.log gives no cause and never blocks."""
    secret = tmp_path / "secret"
    secret.write_text(SIMPLE + "\n")
    rank = worker_folder(tmp_path)
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
