"""Reading a bearer token from a file: the one way every part of elasticd does it.

Standard library only and free of elasticd imports, because it runs on both
sides of the privilege boundary: in the daemon (its own token, the embedded
store server's), in the client and CLI, and in workers (the token file the
daemon gave them). Each caller turns :class:`TokenFileError` into its own
error type; the message says which file and what is wrong with it.

The file is opened without blocking (a FIFO planted in its place cannot hang
the reader) and must be a regular file; a ``check`` sees the ``fstat`` of
the descriptor that is then read, so what is checked is what is read (the
daemon requires its own token file to be private to it). At most 1 MiB is
read; the token is that text, stripped, and must not be empty.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

__all__ = ["MAX_TOKEN_FILE", "TokenFileError", "read_token_file"]

#: Bytes read at most: a token is a line, not a file to slurp.
MAX_TOKEN_FILE = 1 << 20


class TokenFileError(ValueError):
    """The token file cannot be used; the message names it and says why."""


def read_token_file(
    path: str | os.PathLike[str],
    *,
    what: str = "token file",
    check: Callable[[os.stat_result], None] | None = None,
) -> str:
    """The token in ``path``: regular file, utf-8, stripped, not empty."""
    where = Path(path)
    try:
        fd = os.open(where, os.O_RDONLY | os.O_NOCTTY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise TokenFileError(f"cannot read the {what} {where}: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise TokenFileError(f"the {what} {where} is not a regular file")
        if check is not None:
            check(st)
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as fh:  # a regular file: read(n) returns n bytes or to the end
        raw = fh.read(MAX_TOKEN_FILE)
    try:
        token = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise TokenFileError(f"the {what} {where} is not utf-8 text") from None
    if not token:
        raise TokenFileError(f"the {what} {where} is empty")
    return token
