"""Where the daemon forks: one long-lived thread, off the event loop (issue 27, point 6).

Creating a process blocks its caller: ``fork`` (or ``vfork``) and, in
``subprocess``, the wait until the child has exec'd its first program, which
on a busy machine is as long as the child waits for a CPU. On the event
loop's thread that stalled every other job's supervision and every API
answer for as long, at every restart (a job crash-looping three times a
second pushed the API's p99 from 5 ms to 91 ms). So the fork happens here:

* :class:`SpawnerThread`: **one** thread per process, started on first use
  and never ended, runs ``subprocess.Popen`` for every start handed to it, in
  order. One thread, and a lasting one, because the parent-death signal
  (``PR_SET_PDEATHSIG``, :mod:`elasticd.supervise.spawn`) belongs to the
  *thread* that forked: a worker forked by a pool thread that later ends
  would be killed with it. This thread ends only with the process (and a
  forked child of the daemon starts without it: ``os.register_at_fork``).
* :func:`in_spawner` hands a start to it and awaits the result; a caller
  cancelled meanwhile still waits for the thread to finish with the
  descriptors it lent it, and the process it started is killed
  (``on_cancel``), so no process and no descriptor is left behind.
* :class:`ChildProcess`: what such a start returns to the loop: the pid, the
  return code (asyncio's convention: ``-N`` for signal N) and ``wait()``,
  which learns of the exit through a pidfd the loop watches (no thread, no
  polling), or, on a kernel without ``pidfd_open``, a thread blocked in
  ``waitpid`` (as asyncio's own watcher does). It reaps exactly its own pid.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import subprocess
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

log = logging.getLogger(__name__)

__all__ = ["ChildProcess", "SpawnerThread", "in_spawner", "spawner"]

T = TypeVar("T")

#: The name of the thread every start runs in (tests look for it).
THREAD_NAME = "elasticd-spawner"


class SpawnerThread:
    """One thread that runs what it is handed, in order, for the life of the process."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def ident(self) -> int | None:
        """The thread's id once it runs (None before the first start)."""
        return self._thread.ident if self._thread is not None else None

    def submit(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        """Run ``fn()`` in the thread; its result or exception on a future of the running loop."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def settle(ok: bool, value: Any) -> None:
            if future.cancelled():
                return
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)

        def job() -> None:
            try:
                result: Any = fn()
                ok = True
            except BaseException as exc:
                result, ok = exc, False
            try:
                loop.call_soon_threadsafe(settle, ok, result)
            except RuntimeError:  # the loop closed meanwhile: nobody waits any more
                log.warning("a start finished after its event loop closed: %r", result)

        self._ensure_running()
        self._jobs.put(job)
        return future

    def _ensure_running(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            self._jobs.get()()

    def _forget_after_fork(self) -> None:
        """In a forked child: the thread did not come along; a new one starts on first use."""
        self._jobs = queue.SimpleQueue()
        self._thread = None
        self._lock = threading.Lock()


#: The process's one spawner thread.
spawner = SpawnerThread()
os.register_at_fork(after_in_child=spawner._forget_after_fork)


async def in_spawner(
    fn: Callable[[], T], on_cancel: Callable[[T], Awaitable[object]] | None = None
) -> T:
    """``fn()`` in the spawner thread, awaited.

    When the caller is cancelled, the thread is still waited for (``fn`` may
    be using descriptors the caller closes once this returns), then
    ``on_cancel(result)`` undoes what it did, then the cancellation goes on.
    """
    future = spawner.submit(fn)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        if future.cancelled():
            raise  # the loop itself is going away
        # The caller was cancelled, maybe after the thread had finished, maybe before:
        # wait for it, then undo what it did, then let the cancellation go on.
        while not future.done():
            try:
                await asyncio.shield(future)
            except asyncio.CancelledError:
                if future.cancelled():
                    raise
            except BaseException:
                break
        if on_cancel is not None and not future.cancelled() and future.exception() is None:
            await on_cancel(future.result())
        raise


class ChildProcess:
    """A process started in the spawner thread, watched from the event loop.

    The same surface as :class:`asyncio.subprocess.Process` where the
    supervisor uses it: ``pid``, ``returncode`` and ``wait()``. Only this
    object reaps its pid.
    """

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self._popen = popen
        self.pid = popen.pid
        self._loop = asyncio.get_running_loop()
        self._exited: asyncio.Future[int] = self._loop.create_future()
        self._pidfd: int | None = None
        try:
            self._pidfd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):  # no pidfd on this kernel: a waiting thread
            threading.Thread(
                target=self._wait_in_thread, name=f"elasticd-waitpid-{self.pid}", daemon=True
            ).start()
        else:
            self._loop.add_reader(self._pidfd, self._pidfd_readable)

    @property
    def returncode(self) -> int | None:
        """None while it runs; its exit code, or ``-N`` when signal N killed it."""
        return self._popen.returncode

    async def wait(self) -> int:
        """Until the process has exited (and is reaped); its return code."""
        return await asyncio.shield(self._exited)

    def _pidfd_readable(self) -> None:
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:  # someone else reaped it: the status is lost
            pid, status = self.pid, 255 << 8
        if pid == 0:
            return  # not yet (a spurious wake-up)
        self._close_pidfd()
        self._settle(status)

    def _wait_in_thread(self) -> None:
        try:
            _, status = os.waitpid(self.pid, 0)
        except ChildProcessError:
            status = 255 << 8
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            self._loop.call_soon_threadsafe(self._settle, status)

    def _settle(self, status: int) -> None:
        code = os.waitstatus_to_exitcode(status)
        self._popen.returncode = code  # so Popen never waits for it, nor warns of it
        if not self._exited.done():
            self._exited.set_result(code)

    def _close_pidfd(self) -> None:
        if self._pidfd is not None:
            with contextlib.suppress(ValueError, RuntimeError):
                self._loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None
