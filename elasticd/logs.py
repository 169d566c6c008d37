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

A job id may be used again once its job is deleted (or expired), by anyone,
and the deleted job's files stay on disk. So each job folder says which job
it is (:data:`INCARNATION_FILE`, the daemon's, written by :meth:`LogLayout.claim`
when an agent of the job starts here): a folder of an earlier job with that
id is moved aside (to ``<log root>/.retired/``, the daemon's only) before the
new job's first attempt, and the log routes read only a folder that names
the job asked about (:meth:`LogLayout.belongs`), so a new owner of the id
never reads, follows or appends to the previous owner's output.

Which side of the boundary: the daemon. The folders from the attempt down
are the job's (made by :func:`elasticd.security.prepare_worker_dir`, owned
by the job's user); this module only builds names and lists the job's folder
(``os.listdir``: names, no opens, nothing followed). Opening a file in a
worker folder goes through :func:`elasticd.supervise.files.open_worker_file`.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

__all__ = [
    "ERROR_FILE",
    "HEARTBEAT_FILE",
    "INCARNATION_FILE",
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
#: In a job's folder (the daemon's): which job of that id the folder belongs to.
INCARNATION_FILE = ".job"
#: Under the log root (the daemon's, 0700): folders of deleted jobs whose id was used again.
RETIRED = ".retired"
_FILE_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


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

    def belongs(self, job_id: str, incarnation: str) -> bool:
        """Whether the job's folder on this node is that of the job ``incarnation`` names."""
        try:
            fd = os.open(self.job_dir(job_id) / INCARNATION_FILE, _FILE_READ)
        except OSError:
            return False
        try:
            return os.read(fd, 4097).decode("utf-8", "replace") == incarnation
        except OSError:
            return False
        finally:
            os.close(fd)

    def claim(self, job_id: str, incarnation: str) -> None:
        """Make the job's folder this job's; move an earlier job's folder of that id aside.

        Called before the job's first attempt here (and again after a daemon
        restart, when the folder already is the job's and stays as it is).
        """
        if self.belongs(job_id, incarnation):
            return
        job_dir = self.job_dir(job_id)
        if os.path.lexists(job_dir):
            retired = self.root / RETIRED
            with contextlib.suppress(FileExistsError):
                retired.mkdir(mode=0o700)
            os.chmod(retired, 0o700, follow_symlinks=False)
            os.rename(job_dir, retired / f"{job_id}.{time.time_ns()}")
        job_dir.mkdir(mode=0o700)
        fd = os.open(
            job_dir / INCARNATION_FILE,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o600,
        )
        try:
            os.write(fd, incarnation.encode())
        finally:
            os.close(fd)
