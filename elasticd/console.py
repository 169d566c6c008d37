"""What reaches the launcher's console from a job's workers, and how it looks.

Used by ``elasticd run`` and :func:`elasticd.launch` (the launcher's side:
it writes to the terminal of the user who started it). Which lines come here
at all is :func:`elasticd.models.console_streams` (torchrun's ``redirects``,
``tee`` and ``local_ranks_filter``); this module decides how they look, by
torchrun's rules: a worker's output is printed bare, and a *teed* stream gets
a prefix, ``[<role><local rank>]:`` (``[default0]:``) unless the launcher's
``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`` says otherwise (macros
``${role_name}``, ``${rank}``, ``${local_rank}``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["DEFAULT_PREFIX", "ConsoleLine", "prefix_for", "write_line"]

#: torchrun's prefix for a teed line.
DEFAULT_PREFIX = "[${role_name}${local_rank}]:"


@dataclass(frozen=True)
class ConsoleLine:
    """One line a worker wrote, on its way to the console."""

    job_id: str
    role: str
    rank: int
    local_rank: int
    stream: str  # "stdout" or "stderr"
    data: bytes
    teed: bool  # the stream is teed (also in the log file): prefixed, as torchrun does


def prefix_for(line: ConsoleLine, template: str | None) -> str:
    """The prefix of ``line`` (pure): none unless teed; the template's macros substituted."""
    if not line.teed:
        return ""
    return (
        (template or DEFAULT_PREFIX)
        .replace("${role_name}", line.role)
        .replace("${local_rank}", str(line.local_rank))
        .replace("${rank}", str(line.rank))
    )


def write_line(line: ConsoleLine, environ: Mapping[str, str] | None = None) -> None:
    """Print ``line`` on the launcher's stdout or stderr, as torchrun would."""
    env = os.environ if environ is None else environ
    out = sys.stdout if line.stream == "stdout" else sys.stderr
    text = line.data.decode("utf-8", errors="replace")
    prefix = prefix_for(line, env.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"))
    out.write(prefix + text + ("" if text.endswith("\n") else "\n"))
    out.flush()
