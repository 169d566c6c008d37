"""One daemon per state folder: an ``flock`` on ``<state_dir>/elasticd.lock`` held for life.

Two daemons on one state folder share its database, its store journal, its
spawn registry and its cgroup subtree (named after the folder): the second
one's start-up sweep kills the first one's live workers as "orphans", both
run the same ranks, and the one that stops first removes the subtree the
other still uses (issue 23). So the folder is locked before anything else
touches it (the database, the store, the sweep, the cgroups), and a second
daemon (``elasticd serve`` or ``elasticd run --state-dir``) refuses to start
with exit 2 and one line naming the holder's pid.

Why ``flock``: the kernel drops the lock when the holder's last descriptor
closes, so a daemon killed with ``kill -9`` leaves no stale lock behind, and
no pid has to be trusted to decide. The pid written into the file after
locking is only there to be *named* in the refusal. The descriptor is
close-on-exec: no worker, health check or helper the daemon starts inherits
the lock (a worker that outlived its daemon must not keep its successor out).
The file is never removed: unlinking a lock file lets a third process lock a
new file of the same name while the second still holds the old one.

Across the daemon's re-exec (issue 34) the lock is never free: its descriptor is
the one handed over (made inheritable for the exec only), and the new image adopts
it (:meth:`StateLock.adopt`: checked to be a locked descriptor of that folder's lock
file) instead of locking again. Were it closed at the exec, a second daemon started
meanwhile would take the folder, kill the live workers as orphans and keep the new
image out.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from pathlib import Path
from types import TracebackType
from typing import Self

from elasticd.errors import ConfigError
from elasticd.security import STATE_FILE_MODE, make_private_dir

#: The lock file's name in the state folder.
LOCK_FILE = "elasticd.lock"


def busy_message(state_dir: Path, holder: str) -> str:
    """The refusal of a second daemon, ``holder`` being the lock file's text (pure)."""
    pid = holder.strip()
    who = f"pid {pid}" if pid.isdigit() else "a process whose pid it has not written yet"
    return (
        f"state folder {state_dir} is in use by another elasticd ({who}); one daemon per "
        f"state folder: stop that one first, or give this one another --state-dir"
    )


class StateLock:
    """The exclusive lock of a state folder: ``acquire()`` (or ``with``), then ``release()``."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = Path(state_dir)
        self.path = self.state_dir / LOCK_FILE
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> Self:
        """Lock the folder (made 0700 if missing) or raise ``ConfigError`` naming the holder."""
        if self._fd is not None:
            return self
        make_private_dir(self.state_dir)
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(self.path, flags, STATE_FILE_MODE)
        except OSError as exc:
            raise ConfigError(f"cannot open the state folder's lock {self.path}: {exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _read(fd)
            mine = _handed_to_me(fd) if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN) else None
            os.close(fd)
            if mine is not None:  # this process's previous image held it: never free, ours
                return self._adopted(mine)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise ConfigError(busy_message(self.state_dir, holder)) from None
            raise ConfigError(f"cannot lock the state folder {self.path}: {exc}") from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError:
            pass  # a full disk: the lock holds all the same, only the pid is not named
        self._fd = fd
        return self

    def _adopted(self, fd: int) -> Self:
        lock = type(self).adopt(self.state_dir, fd)
        self._fd, lock._fd = lock._fd, None
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)  # type: ignore[arg-type]
            os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)  # type: ignore[arg-type]
        return self

    @classmethod
    def adopt(cls, state_dir: Path, fd: int) -> StateLock:
        """The lock of ``state_dir`` held through ``fd`` (handed over by the previous
        program image of this process): checked to be that folder's lock file, still
        locked by it; made close-on-exec again. ``ConfigError`` (the descriptor closed)
        where it is not."""
        lock = cls(state_dir)
        try:
            st, here = os.fstat(fd), os.lstat(lock.path)
            if (st.st_dev, st.st_ino) != (here.st_dev, here.st_ino):
                raise ConfigError(
                    f"the descriptor {fd} handed over is not the lock file {lock.path}"
                )
            # Ours already (the same open file): taking it again is a no-op that must work.
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.set_inheritable(fd, False)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise ConfigError(f"cannot adopt the state folder's lock {lock.path}: {exc}") from None
        except ConfigError:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise
        lock._fd = fd
        return lock

    def fileno(self) -> int:
        """The locked descriptor (a child given a copy holds the lock too, until it exits)."""
        if self._fd is None:
            raise RuntimeError(f"{self.path} is not locked")
        return self._fd

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)  # a later refusal never names a pid that has gone
            os.close(fd)  # closing the last descriptor drops the flock

    def __enter__(self) -> Self:
        return self.acquire()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


def _read(fd: int) -> str:
    with contextlib.suppress(OSError):
        return os.pread(fd, 64, 0).decode(errors="replace")
    return ""


def _handed_to_me(opened: int) -> int | None:
    """Another descriptor of this process on the lock file ``opened`` is (one the previous
    program image handed over in a hand-over this image could not read): None if none.

    Only an inheritable one: a handed descriptor crossed the exec, so it is; a lock this
    image holds itself is close-on-exec, and a second acquire in this process is refused
    as from any other holder."""
    here = os.fstat(opened)
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return None
    for name in names:
        fd = int(name)
        if fd == opened:
            continue
        try:
            st = os.fstat(fd)
        except OSError:
            continue
        same = (st.st_dev, st.st_ino) == (here.st_dev, here.st_ino) and stat.S_ISREG(st.st_mode)
        if same and os.get_inheritable(fd):
            return fd
    return None
