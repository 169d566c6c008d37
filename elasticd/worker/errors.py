"""``record``: torch's ``@record`` without importing torch.

The daemon reads ``$TORCHELASTIC_ERROR_FILE`` after a failure to report the
root cause (see :mod:`elasticd.supervise.errorfile`). torch's decorator writes
it, but importing torch costs seconds; this one writes the very same JSON::

    {"message": {"message": "<Type>: <msg>",
                 "extraInfo": {"py_callstack": "<traceback>", "timestamp": "<int seconds>"}}}

and behaves like torch's: ``faulthandler`` is enabled for the process (a
segfault still leaves a traceback on stderr), ``SystemExit(0)`` returns
``None``, any other ``Exception`` is written and re-raised, and
``BaseException``s that are not errors (``KeyboardInterrupt``, other
``SystemExit``) pass through unrecorded. Without the environment variable
nothing is written, as with torch.
"""

from __future__ import annotations

import faulthandler
import functools
import json
import os
import time
import traceback
from collections.abc import Callable
from typing import ParamSpec, TypeVar

__all__ = ["error_file_payload", "record", "write_error_file"]

_P = ParamSpec("_P")
_R = TypeVar("_R")

ENV_VAR = "TORCHELASTIC_ERROR_FILE"


def error_file_payload(exc: BaseException, *, now: float | None = None) -> dict[str, object]:
    """The JSON object torch's ``@record`` writes for ``exc`` (call it inside ``except``)."""
    return {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {
                "py_callstack": traceback.format_exc(),
                "timestamp": str(int(time.time() if now is None else now)),
            },
        }
    }


def write_error_file(exc: BaseException) -> str | None:
    """Write the error file for ``exc`` where the environment says; return its path, if any.

    Never raises: failing to report an error must not hide the error.
    """
    path = os.environ.get(ENV_VAR)
    if not path:
        return None
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(error_file_payload(exc), f)
    except (OSError, TypeError, ValueError):
        return None
    return path


def record(fn: Callable[_P, _R]) -> Callable[_P, _R | None]:
    """Decorate the worker's entrypoint so that an uncaught exception becomes its error file."""

    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R | None:
        try:
            faulthandler.enable(all_threads=True)
        except (RuntimeError, ValueError, OSError, AttributeError):
            pass  # no usable stderr (e.g. replaced by an object without a file descriptor)
        try:
            return fn(*args, **kwargs)
        except SystemExit as exit_:
            if exit_.code == 0:
                return None
            raise
        except Exception as exc:
            write_error_file(exc)
            raise

    return wrapper
