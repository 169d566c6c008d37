"""A failed worker's cause from its ``stderr.log`` when it left no error file.

Only an entrypoint decorated with torch's ``@record`` writes an error file;
any other Python worker that raises prints its traceback on stderr and exits
1. The daemon then takes the last traceback of the failed rank's
``stderr.log`` as the cause: the exception line (``ValueError: boom``) is the
message, the traceback the traceback, and the error is marked
``source="log"`` so that a reader knows it was read from the output, not
written by the worker on purpose.

Two parts, as everywhere in the daemon:

* :func:`last_traceback` is pure: the text of the last Python traceback in
  some output, with the chain of exceptions that led to it, or None.
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
exception:" takes the one before it along.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from elasticd.logs import stream_file
from elasticd.supervise.errorfile import MAX_MESSAGE_CHARS, MAX_TRACEBACK_CHARS, WorkerError
from elasticd.supervise.files import open_worker_file

__all__ = ["TAIL_BYTES", "last_traceback", "traceback_from_log"]

#: How much of the end of ``stderr.log`` is read: what a store value holds of a
#: traceback anyway (a deeper one keeps its end, which names the failing line).
TAIL_BYTES = MAX_TRACEBACK_CHARS

_HEADER = "Traceback (most recent call last):"
_CHAINS = (
    "During handling of the above exception, another exception occurred:",
    "The above exception was the direct cause of the following exception:",
)
_NEWLINES = re.compile(r"\r\n|\r(?!\n)")


def last_traceback(text: str) -> str | None:
    """The last complete Python traceback in `text` (with its chain), or None.

    Complete means its exception line is there: a traceback cut off by the
    end of the text (a worker killed while printing it) is not taken.
    """
    lines = _NEWLINES.sub("\n", text).split("\n")
    headers = [i for i, line in enumerate(lines) if line.rstrip() == _HEADER]
    for start in reversed(headers):
        end = _exception_line(lines, start)
        if end is None:
            continue
        first = start
        while (earlier := _chained_before(lines, first, headers)) is not None:
            first = earlier
        return "\n".join(lines[first : end + 1])
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
    found = last_traceback(data.decode("utf-8", "replace"))
    if found is None:
        return None
    message = found.rsplit("\n", 1)[-1].strip()[:MAX_MESSAGE_CHARS]
    return WorkerError(
        message=message,
        traceback=found,
        timestamp=timestamp,
        raw={},
        source="log",
    )
