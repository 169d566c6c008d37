"""Reading the error file a worker leaves behind when it fails.

A worker whose entrypoint is decorated with torch's
``torch.distributed.elastic.multiprocessing.errors.record`` writes, when it
raises, a JSON file at ``$TORCHELASTIC_ERROR_FILE``::

    {"message": {"message": "ValueError: boom",
                 "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "1700000000"}}}

Older and hand-written files put a plain string under ``"message"`` (with an
optional top-level ``"timestamp"``). The file is written by user code in a
folder the worker owns, so it is treated as untrusted input: it is opened
only through :func:`elasticd.supervise.files.open_worker_file` (relative to
the folder's descriptor, ``O_NOFOLLOW | O_NONBLOCK``) and read only when it
is a regular file with no other hard link, parsed as JSON only (never
unpickled), read up to :data:`MAX_ERROR_FILE_BYTES` (its message and
traceback are then cut to :data:`MAX_MESSAGE_CHARS` and
:data:`MAX_TRACEBACK_CHARS`, so a failure always fits a store value), and bad content never
raises: the caller gets a :class:`WorkerError` whose message says what was
wrong, so the failure is still reported, just without the worker's own words.
"""

from __future__ import annotations

import errno
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from elasticd.supervise.files import UnsafeWorkerFile, open_worker_file

__all__ = ["MAX_ERROR_FILE_BYTES", "WorkerError", "read_error_file"]

#: Larger files are not parsed: a traceback is a few KiB; a megabyte is a bug
#: or an attack, and the daemon must not spend its memory on it.
MAX_ERROR_FILE_BYTES = 1 << 20

#: What of a worker's message and traceback is kept: they go into the job
#: document and events in the store, whose values are limited (1 MiB by default).
MAX_MESSAGE_CHARS = 16 * 1024
MAX_TRACEBACK_CHARS = 64 * 1024

#: How much of an unparseable file is quoted back in the message.
_EXCERPT_CHARS = 200


@dataclass(frozen=True)
class WorkerError:
    """What a worker's error file said about its failure."""

    message: str
    traceback: str | None
    timestamp: float
    """Seconds since the epoch: the file's ``extraInfo.timestamp``, else the fallback."""
    raw: dict[str, Any]
    """The parsed JSON object; empty when the file could not be parsed."""
    source: Literal["error_file", "log"] = "error_file"
    """Where it was read: the error file, or the last traceback of ``stderr.log``
    (:mod:`elasticd.supervise.tracebacks`) when the worker wrote no error file."""


def read_error_file(path: Path, *, default_timestamp: float | None = None) -> WorkerError | None:
    """Parse the error file at `path`; None when there is none.

    `default_timestamp` is used when the file carries no usable timestamp
    (the group passes the worker's exit time); without it, the file's
    modification time is used, as torch does.
    """
    try:
        # The worker controls this path: the daemon must neither follow a link to a
        # file the worker could not read itself nor block opening a FIFO planted there.
        fd = open_worker_file(path.parent, path.name)
    except FileNotFoundError:
        return None
    except OSError as exc:
        when = default_timestamp if default_timestamp is not None else time.time()
        if isinstance(exc, UnsafeWorkerFile) and exc.errno == errno.EMLINK:
            # A hard link to a file the worker may not read (fs.protected_hardlinks off):
            # its content would be quoted back in the failure's message.
            return _unreadable(path, "has other hard links and was not read", when)
        if isinstance(exc, UnsafeWorkerFile) and exc.errno == errno.EINVAL:
            return _unreadable(path, "is not a regular file", when)
        return _unreadable(path, f"cannot be opened ({exc.strerror or exc})", when)
    try:
        info = os.fstat(fd)
        fallback = default_timestamp if default_timestamp is not None else info.st_mtime
        try:
            data = _read_at_most(fd, MAX_ERROR_FILE_BYTES + 1)
        except OSError as exc:
            return _unreadable(path, f"cannot be read ({exc.strerror or exc})", fallback)
    finally:
        os.close(fd)

    if len(data) > MAX_ERROR_FILE_BYTES:
        return _unreadable(path, f"is larger than {MAX_ERROR_FILE_BYTES} bytes", fallback)
    try:
        parsed = json.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError):
        text = data[:_EXCERPT_CHARS].decode("utf-8", "replace")
        return _unreadable(path, f"is not valid JSON: {text!r}", fallback)
    if not isinstance(parsed, dict):
        return _unreadable(path, f"holds a JSON {type(parsed).__name__}, not an object", fallback)
    return _from_json(path, parsed, fallback)


def _from_json(path: Path, parsed: dict[str, Any], fallback: float) -> WorkerError:
    body = parsed.get("message")
    if isinstance(body, dict):
        message = _text(body.get("message"))
        extra = body.get("extraInfo")
        extra = extra if isinstance(extra, dict) else {}
        traceback = extra.get("py_callstack")
        timestamp = _timestamp(extra.get("timestamp"))
    else:
        message = _text(body)
        traceback = None
        timestamp = _timestamp(parsed.get("timestamp"))
    if message is None:
        message = f"error file {path} has no message"
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[:MAX_MESSAGE_CHARS] + " [... cut]"
    if isinstance(traceback, str) and len(traceback) > MAX_TRACEBACK_CHARS:
        # The end of a traceback names the failing line: keep that.
        traceback = "[... cut]\n" + traceback[-MAX_TRACEBACK_CHARS:]
    return WorkerError(
        message=message,
        traceback=traceback if isinstance(traceback, str) and traceback else None,
        timestamp=fallback if timestamp is None else timestamp,
        raw=parsed,
    )


def _text(value: object) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value or None
    # Someone wrote a structure where text belongs: keep it readable rather than drop it.
    return json.dumps(value)[:_EXCERPT_CHARS]


def _timestamp(value: object) -> float | None:
    # torch writes str(int(time.time())); accept numbers too. bool is an int in Python: refuse it.
    if isinstance(value, bool):
        return None
    if not isinstance(value, int | float | str):
        return None
    try:
        number = float(value.strip() if isinstance(value, str) else value)
    except (ValueError, OverflowError):
        return None
    return number if math.isfinite(number) and number >= 0 else None


def _read_at_most(fd: int, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while size < limit:
        chunk = os.read(fd, limit - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _unreadable(path: Path, why: str, timestamp: float) -> WorkerError:
    return WorkerError(
        message=f"the worker's error file {path} {why}",
        traceback=None,
        timestamp=timestamp,
        raw={},
    )
