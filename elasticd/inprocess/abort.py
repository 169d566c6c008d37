"""Aborting a process group so that a rank blocked in a collective gets its thread back.

NCCL has ``ncclCommAbort`` (``ProcessGroup.abort()``). Gloo in torch 2.13
has an ``abort()`` too, but it does not wake a thread blocked in a
collective: measured, ``all_reduce`` waiting for a live but stuck peer only
returns at the process group's timeout (30 min by default). What does wake
it is its TCP connection failing: gloo throws ``Connection closed by peer``
as soon as a pair socket reads EOF, and the peer on the other end gets the
same error.

So :class:`AbortTorchDistributed` does, in order:

1. ``ProcessGroup.abort()`` when torch has it (the NCCL path);
2. ``shutdown(SHUT_RDWR)`` on the process group's **connected** TCP sockets
   (never its listening socket: gloo's listener thread aborts the process
   on an error). Which sockets: those opened during
   :meth:`~elasticd.inprocess.CallWrapper.init_process_group` when the
   training function used it (exact), else every connected TCP socket
   opened since the iteration started, except connections to the daemon
   (the store client's). ``shutdown`` does not close the file descriptors,
   so gloo still owns and closes them;
3. in the main thread only, ``destroy_process_group()`` (destroying a group
   from another thread while a collective runs in it is not safe).

The monitor thread calls it with the main thread possibly blocked; the
wrapper calls it again from the main thread on its way to the restart.
Every step tolerates having been done already.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import urlsplit

from elasticd.inprocess.state import State

__all__ = ["Abort", "AbortTorchDistributed", "SocketTracker", "tracker"]

#: ``state -> state | None``: stop the rank's distributed work so that it can restart.
Abort = Callable[[State], State | None]

_STREAM_FAMILIES = (socket.AF_INET, socket.AF_INET6)


def _socket_inodes() -> dict[int, str]:
    """This process's socket file descriptors and their inode ids ("socket:[123]")."""
    out: dict[int, str] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:"):
            out[int(name)] = target
    return out


def _daemon_peers() -> set[tuple[str, int]]:
    """The addresses of the daemon (``ELASTICD_URL``): connections there are not the group's."""
    url = os.environ.get("ELASTICD_URL")
    if not url:
        return set()
    parts = urlsplit(url)
    if parts.hostname is None:
        return set()
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        infos = socket.getaddrinfo(parts.hostname, port, proto=socket.IPPROTO_TCP)
    except OSError:
        return set()
    return {(str(info[4][0]), int(info[4][1])) for info in infos}


class SocketTracker:
    """Remembers which sockets belong to the current process group (see module doc)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._baseline: dict[int, str] = {}
        self._exact: dict[int, str] | None = None

    def begin_iteration(self) -> None:
        """Sockets open now are not the new group's."""
        with self._lock:
            self._baseline = _socket_inodes()
            self._exact = None

    def record(self, before: dict[int, str]) -> None:
        """The group was created just now: its sockets are those new since ``before``."""
        after = _socket_inodes()
        with self._lock:
            self._exact = {fd: ino for fd, ino in after.items() if before.get(fd) != ino}

    def widen(self) -> None:
        """From now on until the next iteration, every socket opened since it began is
        the group's (an abort that shut down the exact set did not wake the rank)."""
        with self._lock:
            self._exact = None

    def snapshot(self) -> dict[int, str]:
        return _socket_inodes()

    def candidates(self) -> dict[int, str]:
        """The sockets an abort shuts down (connected TCP only is checked at shutdown)."""
        now = _socket_inodes()
        with self._lock:
            if self._exact is not None:
                return {fd: ino for fd, ino in self._exact.items() if now.get(fd) == ino}
            return {fd: ino for fd, ino in now.items() if self._baseline.get(fd) != ino}

    def shutdown(self) -> int:
        """Shut down the group's connected TCP sockets; how many were shut down."""
        skip = _daemon_peers()
        count = 0
        for fd, inode in self.candidates().items():
            try:
                dup = os.dup(fd)
            except OSError:
                continue
            try:
                if _socket_inodes().get(fd) != inode:
                    continue  # the descriptor was closed and reused meanwhile
                sock = socket.socket(fileno=dup)
            except OSError:
                os.close(dup)
                continue
            with sock:
                try:
                    if sock.family not in _STREAM_FAMILIES or sock.type != socket.SOCK_STREAM:
                        continue
                    peer = sock.getpeername()  # raises for a listening socket: never touch those
                except OSError:
                    continue
                if (str(peer[0]), int(peer[1])) in skip:
                    continue
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                    count += 1
        return count


#: The tracker of this process (one wrapped call runs at a time).
tracker = SocketTracker()


class AbortTorchDistributed:
    """The default abort: wake and tear down ``torch.distributed`` (see the module doc)."""

    def __init__(self, *, shutdown_sockets: bool = True) -> None:
        self.shutdown_sockets = shutdown_sockets

    def __call__(self, state: State) -> State:
        dist = _torch_distributed()
        initialized = dist is not None and bool(dist.is_available() and dist.is_initialized())
        if initialized:
            for group in _groups(dist):
                with contextlib.suppress(Exception):
                    group.abort()
        if self.shutdown_sockets:
            tracker.shutdown()
        in_main = threading.current_thread() is threading.main_thread()
        if initialized and in_main:
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        return state

    def __repr__(self) -> str:
        return f"AbortTorchDistributed(shutdown_sockets={self.shutdown_sockets})"


def _torch_distributed() -> Any:
    """``torch.distributed`` if this process imported it; None otherwise (nothing to abort).

    Never imports torch itself: a worker that did not import it has no
    process group, and the import would cost seconds.
    """
    return sys.modules.get("torch.distributed")


def _groups(dist: Any) -> Iterable[Any]:
    """Every process group torch knows in this process, the default one last."""
    c10d = getattr(dist, "distributed_c10d", None)
    world = getattr(getattr(c10d, "_world", None), "pg_map", None)
    groups = list(world.keys()) if isinstance(world, dict) else []
    default = getattr(getattr(dist, "group", None), "WORLD", None)
    others = [g for g in groups if g is not default]
    return [*others, default] if default is not None else others
