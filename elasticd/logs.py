"""The worker log layout: the one owner of where a job's files lie on a node.

::

    <log root>/<job id>/attempt_<n>/<local rank>/stdout.log
                                                /stderr.log
                                                /error.json   (TORCHELASTIC_ERROR_FILE)
                                                /heartbeat    (ELASTICD_HEARTBEAT_FILE)

Every attempt of a job on a node gets a fresh ``attempt_<n>`` folder (``n``
counts up from 0 across daemon restarts), so a restarted group never appends
to, or reads, an earlier attempt's files. The agent places files with
:meth:`LogLayout.worker_dir`; the log routes and the log follower find them
with :meth:`LogLayout.attempts`; nothing else builds these paths (as torch's
``LogsSpecs.reify`` owns torchrun's).

Which side of the boundary: the daemon. The folders from the attempt down
are the job's (made by :func:`elasticd.security.prepare_worker_dir`, owned
by the job's user); this module only builds names and lists the job's folder
(``os.listdir``: names, no opens, nothing followed). Opening a file in a
worker folder goes through :func:`elasticd.supervise.files.open_worker_file`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

__all__ = [
    "ERROR_FILE",
    "HEARTBEAT_FILE",
    "LogLayout",
    "Stream",
    "attempt_of",
    "stream_file",
]

Stream = Literal["stdout", "stderr"]

#: The file a worker's ``TORCHELASTIC_ERROR_FILE`` names (torch's format).
ERROR_FILE = "error.json"
#: The file a worker's ``ELASTICD_HEARTBEAT_FILE`` names.
HEARTBEAT_FILE = "heartbeat"

_ATTEMPT = "attempt_"


def stream_file(stream: Stream) -> str:
    """The name of a worker's log of ``stream`` in its folder."""
    return f"{stream}.log"


def _attempt_number(name: str) -> int | None:
    digits = name.removeprefix(_ATTEMPT)
    if name.startswith(_ATTEMPT) and digits.isdigit() and digits.isascii():
        return int(digits)
    return None


def attempt_of(worker_dir: Path) -> int | None:
    """The attempt a worker folder (``.../attempt_<n>/<local rank>``) belongs to."""
    return _attempt_number(worker_dir.parent.name)


@dataclass(frozen=True)
class LogLayout:
    """Paths under one log root (the daemon's ``logs`` setting)."""

    root: Path

    def job_dir(self, job_id: str) -> Path:
        return self.root / job_id

    def attempt_dir(self, job_id: str, attempt: int) -> Path:
        return self.job_dir(job_id) / f"{_ATTEMPT}{attempt}"

    def worker_dir(self, job_id: str, attempt: int, local_rank: int) -> Path:
        return self.attempt_dir(job_id, attempt) / str(local_rank)

    def log_file(self, job_id: str, attempt: int, local_rank: int, stream: Stream) -> Path:
        return self.worker_dir(job_id, attempt, local_rank) / stream_file(stream)

    def error_file(self, job_id: str, attempt: int, local_rank: int) -> Path:
        return self.worker_dir(job_id, attempt, local_rank) / ERROR_FILE

    def heartbeat_file(self, job_id: str, attempt: int, local_rank: int) -> Path:
        return self.worker_dir(job_id, attempt, local_rank) / HEARTBEAT_FILE

    def attempts(self, job_id: str) -> list[int]:
        """The attempts with a folder on this node, oldest first (names only, no opens)."""
        try:
            names = os.listdir(self.job_dir(job_id))
        except OSError:
            return []
        return sorted(n for n in map(_attempt_number, names) if n is not None)

    def last_attempt(self, job_id: str) -> int:
        """The newest attempt with a folder on this node, -1 if none."""
        return max(self.attempts(job_id), default=-1)
