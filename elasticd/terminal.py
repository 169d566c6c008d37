"""Text a job wrote, made safe to print on an operator's terminal.

A job's error file (its root cause message and traceback), its command
line and every event message it causes come from the job, that is from
whoever submitted it. Printed raw, an escape sequence in them is run by the
operator's terminal: it can retitle the window, clear the screen, hide
lines, or (on some terminals) answer back into the shell. So every text the
CLI prints that a job could have written goes through :func:`printable`:
control characters (C0, DEL, C1: the ESC, BEL and CSI that start those
sequences) are shown escaped, as ``\\x1b``, never sent; newlines and tabs
stay only where the text is a traceback.
"""

from __future__ import annotations

import re

_CONTROLS = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f]")
_CONTROLS_BUT_LINES = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _escaped(match: re.Match[str]) -> str:
    return f"\\x{ord(match.group()):02x}"


def printable(text: object, *, lines: bool = False) -> str:
    """``text`` with its control characters shown escaped (``\\x1b``), never sent.

    With ``lines`` (a traceback) newlines and tabs stay; otherwise the text
    is one line: a newline shows as ``\\x0a`` (tabs stay, they move no line).
    """
    s = str(text)
    return (_CONTROLS_BUT_LINES if lines else _CONTROLS).sub(_escaped, s)
