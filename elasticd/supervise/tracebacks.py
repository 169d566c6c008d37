"""A failed worker's cause from its ``stderr.log`` when it left no error file.

Only an entrypoint decorated with torch's ``@record`` writes an error file;
any other Python worker that raises prints its traceback on stderr and exits
1. The daemon then takes the last traceback of the failed rank's
``stderr.log`` as the cause: the exception line (``ValueError: boom``) is the
message, the traceback the traceback, and the error is marked
``source="log"`` so that a reader knows it was read from the output, not
written by the worker on purpose.

Two parts, as everywhere in the daemon:

* :func:`last_cause` is pure: what some output says the worker died of (its
  last Python traceback, with the chain of exceptions that led to it, or a
  C++ abort), or None; :func:`last_traceback` the traceback's text alone.
* :func:`traceback_from_log` does the IO: it reads at most
  :data:`TAIL_BYTES` from the end of the log, which the worker can write (it
  is in the worker's own folder), so it is opened only through
  :func:`elasticd.supervise.files.open_worker_file` (never through a link,
  never blocking on a FIFO, a regular file with one link), as the error file
  is; what cannot be read safely is simply no cause (the exit code stays the
  message).

What counts as a traceback: a line ``Traceback (most recent call last):`` at
the start of a line, the indented frame lines after it, and the first line
that is not indented: the exception line, where the traceback ends. (Lines
after it, such as the rest of a message that spans lines, are not taken: they
cannot be told from what the program printed next.) A traceback preceded by
Python's "During handling of the above exception, another exception
occurred:" or "The above exception was the direct cause of the following
exception:" takes the one before it along; the message is the last
exception's line, the one that ended the program.

Once a worker called ``init_process_group`` torch's excepthook prefixes every
line it prints with the rank, ``[rank1]: Traceback (most recent call last):``
(and its C++ log lines with ``[rank1]:[E...]``): the prefix is taken off each
line before it is read, so the message is the exception line as Python wrote
it.

A worker that dies in C++ (a gloo or NCCL abort: ``std::terminate`` on an
uncaught ``c10::DistBackendError`` or ``gloo::IoException``, then SIGABRT)
prints no Python traceback but ``terminate called after throwing an instance
of 'T'`` and ``  what():  MESSAGE``: the cause is ``T: MESSAGE`` (the first
line of ``what()``), with the block as its traceback. Of a traceback and an
abort the later one in the log is the cause (the one the worker died of).
With neither, the last error line of torch's C++ log (``[E... file.cpp:N]
MESSAGE``, NCCL's watchdog saying why it aborts) is the message.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from elasticd.logs import stream_file
from elasticd.supervise.errorfile import MAX_MESSAGE_CHARS, MAX_TRACEBACK_CHARS, WorkerError
from elasticd.supervise.files import open_worker_file

__all__ = ["TAIL_BYTES", "LogCause", "last_cause", "last_traceback", "traceback_from_log"]

#: How much of the end of ``stderr.log`` is read: what a store value holds of a
#: traceback anyway (a deeper one keeps its end, which names the failing line).
TAIL_BYTES = MAX_TRACEBACK_CHARS

_HEADER = "Traceback (most recent call last):"
_CHAINS = (
    "During handling of the above exception, another exception occurred:",
    "The above exception was the direct cause of the following exception:",
)
_NEWLINES = re.compile(r"\r\n|\r(?!\n)")
#: torch's excepthook (and its C++ logger) after ``init_process_group``: ``[rank3]: ``.
_RANK_PREFIX = re.compile(r"^\[rank\d{1,7}\]: ?")
_TERMINATE = re.compile(r"^terminate called after throwing an instance of '([^']{1,200})'\s*$")
_WHAT = re.compile(r"^\s*what\(\):\s*(.*)$")
#: glog/c10 error lines: ``[E1201 12:00:00.123456 1234 ProcessGroupNCCL.cpp:1234] message``.
_C10_ERROR = re.compile(r"^\[E[\d :.]*\s*(?:\d+\s+)?[\w./-]+\.(?:cpp|cc|h|hpp):\d+\]\s*(.+)$")
#: How many lines after ``what():`` an abort's block keeps (c10's "Exception raised from"
#: and its frames).
_ABORT_TAIL_LINES = 24


@dataclass(frozen=True)
class LogCause:
    """What a failed worker's output says it died of: one line and the block it ends."""

    message: str
    traceback: str


def _lines(text: str) -> list[str]:
    """The text's lines, torch's rank prefix taken off each."""
    return [_RANK_PREFIX.sub("", line) for line in _NEWLINES.sub("\n", text).split("\n")]


def last_cause(text: str) -> LogCause | None:
    """What the output says the worker died of: its last traceback or abort, else the last
    C++ error line; None when it says nothing of the kind (see the module's docstring)."""
    lines = _lines(text)
    found = _last_traceback(lines)
    abort = _last_abort(lines)
    if abort is not None and (found is None or abort[0] > found[0]):
        return abort[1]
    if found is not None:
        return found[1]
    for line in reversed(lines):
        if match := _C10_ERROR.match(line):
            return LogCause(message=match.group(1).strip(), traceback=line)
    return None


def last_traceback(text: str) -> str | None:
    """The last complete Python traceback in `text` (with its chain), or None.

    Complete means its exception line is there: a traceback cut off by the
    end of the text (a worker killed while printing it) is not taken.
    """
    found = _last_traceback(_lines(text))
    return found[1].traceback if found is not None else None


def _last_traceback(lines: list[str]) -> tuple[int, LogCause] | None:
    """The last complete traceback (with its chain) and the index of its exception line."""
    headers = [i for i, line in enumerate(lines) if line.rstrip() == _HEADER]
    for start in reversed(headers):
        end = _exception_line(lines, start)
        if end is None:
            continue
        first = start
        while (earlier := _chained_before(lines, first, headers)) is not None:
            first = earlier
        message = lines[end].strip()
        return end, LogCause(message=message, traceback="\n".join(lines[first : end + 1]))
    return None


def _last_abort(lines: list[str]) -> tuple[int, LogCause] | None:
    """The last ``terminate called after throwing`` with its ``what():``, and its index."""
    for i in range(len(lines) - 1, -1, -1):
        match = _TERMINATE.match(lines[i])
        if match is None or i + 1 >= len(lines):
            continue
        what = _WHAT.match(lines[i + 1])
        if what is None:
            continue
        end = i + 2
        while end < len(lines) and end < i + 2 + _ABORT_TAIL_LINES and lines[end].strip():
            end += 1
        message = f"{match.group(1)}: {what.group(1).strip()}".rstrip(": ")
        return i, LogCause(message=message, traceback="\n".join(lines[i:end]))
    return None


def _exception_line(lines: list[str], header: int) -> int | None:
    """The index of the traceback's exception line: the first unindented line after frames."""
    for i in range(header + 1, len(lines)):
        line = lines[i]
        if line and not line[0].isspace():
            # At least one frame is printed before it; a bare "Traceback" line then text is not one.
            return i if i > header + 1 and line.rstrip() != _HEADER else None
    return None


def _chained_before(lines: list[str], header: int, headers: list[int]) -> int | None:
    """The header of the traceback chained to the one at `header`, if Python printed one."""
    i = header - 1
    while i >= 0 and not lines[i].strip():
        i -= 1
    if i < 0 or lines[i].strip() not in _CHAINS:
        return None
    i -= 1
    while i >= 0 and not lines[i].strip():
        i -= 1
    earlier = [h for h in headers if h < i]
    if not earlier or _exception_line(lines, earlier[-1]) != i:
        return None
    return earlier[-1]


def traceback_from_log(worker_dir: Path, *, timestamp: float) -> WorkerError | None:
    """The cause read from the last traceback of ``worker_dir/stderr.log``; None when none.

    `timestamp` is the worker's exit time: the log says nothing reliable of when
    the exception was raised. Never raises for what the worker put there.
    """
    try:
        fd = open_worker_file(worker_dir, stream_file("stderr"))
    except (OSError, ValueError):
        return None  # absent, or something a worker planted: no cause from it
    try:
        size = os.fstat(fd).st_size
        data = os.pread(fd, TAIL_BYTES, max(0, size - TAIL_BYTES))
    except OSError:
        return None
    finally:
        os.close(fd)
    found = last_cause(data.decode("utf-8", "replace"))
    if found is None:
        return None
    return WorkerError(
        message=found.message[:MAX_MESSAGE_CHARS],
        traceback=found.traceback[-MAX_TRACEBACK_CHARS:],
        timestamp=timestamp,
        raw={},
        source="log",
    )
