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

**Retention** (issue 23: every attempt left its files forever). Per job,
the newest ``keep_attempts`` attempt folders stay, and past ``keep_bytes``
the oldest finished ones go too (the newest finished one always stays);
:func:`attempts_to_remove` decides (pure), :meth:`LogLayout.retain` measures
and removes. The newest folder of a job whose agent runs here may be the
running attempt's: it and anything newer are never touched.

Which side of the boundary: the daemon. The folders from the attempt down
are the job's (made by :func:`elasticd.security.prepare_worker_dir`, owned
by the job's user); this module only builds names and lists the job's folder
(``os.listdir``: names, no opens, nothing followed). Opening a file in a
worker folder goes through :func:`elasticd.supervise.files.open_worker_file`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Sequence
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
    "attempts_to_remove",
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


def attempts_to_remove(
    attempts: Sequence[tuple[int, int]],
    keep_attempts: int,
    keep_bytes: int,
    running: int | None,
) -> list[int]:
    """Which attempt folders of one job go (pure).

    ``attempts``: (attempt, bytes) oldest first; ``running``: the attempt that
    may be running (it and newer ones are never removed), None when no agent
    of the job runs here. Keeps the newest ``keep_attempts``; then, while the
    rest holds more than ``keep_bytes`` (0: no bound), removes the oldest
    finished one, but never the newest finished one.
    """
    ordered = sorted(attempts)
    kept = {n for n, _ in ordered[-keep_attempts:]} if keep_attempts > 0 else set()
    live = {n for n, _ in ordered if running is not None and n >= running}
    remove = [n for n, _ in ordered if n not in kept and n not in live]
    if keep_bytes > 0:
        left = [(n, b) for n, b in ordered if n not in remove]
        total = sum(b for _, b in left)
        finished = [(n, b) for n, b in left if n not in live]
        for n, size in finished[:-1]:  # the newest finished one stays
            if total <= keep_bytes:
                break
            remove.append(n)
            total -= size
    return sorted(remove)


def _tree_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (lstat: nothing followed)."""
    total = 0
    stack = [str(path)]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:
            continue
        for entry in entries:
            with contextlib.suppress(OSError):
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                else:
                    total += entry.stat(follow_symlinks=False).st_size
    return total


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

    def job_ids(self) -> list[str]:
        """The job folders under the root (names only; ``.retired`` and other dot names skipped)."""
        try:
            return sorted(n for n in os.listdir(self.root) if not n.startswith("."))
        except OSError:
            return []

    def retain(self, job_id: str, keep_attempts: int, keep_bytes: int, running: bool) -> list[int]:
        """Apply log retention to one job's folder; the attempts removed.

        ``running``: an agent of the job runs here, so its newest folder may
        be the running attempt's and is not touched. Blocking (a thread's work).
        """
        attempts = self.attempts(job_id)
        if not attempts:
            return []
        sized = [(n, _tree_bytes(self.attempt_dir(job_id, n))) for n in attempts]
        decision = attempts_to_remove(
            sized, keep_attempts, keep_bytes, attempts[-1] if running else None
        )
        removed = []
        for n in decision:
            # rmtree works through directory descriptors on Linux: a link a job put in
            # its folder is removed, never followed.
            try:
                shutil.rmtree(self.attempt_dir(job_id, n))
            except OSError:
                continue
            removed.append(n)
        return removed

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
