"""Progress of the training function, automatic and manual, and raising into the main thread.

Two sources of progress, NVIDIA's semantics:

* **automatic** — every ``interval`` a small thread asks the interpreter to
  run a call *in the main thread* (``Py_AddPendingCall``). Pending calls only
  run when the main thread executes Python bytecode, so the call having run
  says "the main thread is not stuck inside a C call" (a collective waiting
  for a dead peer, a deadlocked kernel launch). The call is libc's
  ``sem_post``, not Python code (see :class:`PendingCallProbe`). Only
  available when the wrapper runs in the main thread, on POSIX.
* **manual** — :meth:`Progress.ping` (``CallWrapper.ping()``), for loops
  that run Python but make no real progress. It counts only once the
  function pinged in the current iteration.

The time of last progress is the older of the sources that apply; the soft
and hard timeouts are measured from it. Both sources also ping the daemon's
heartbeat (:func:`elasticd.worker.ping`), so the daemon, the external
monitor, sees the same progress.

:func:`async_raise` schedules an exception in another thread
(``PyThreadState_SetAsyncExc``): it is raised at that thread's next
bytecode, which is how the monitor thread unwinds the training function.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
import time

from elasticd.worker import heartbeat

__all__ = ["PendingCallProbe", "Progress", "async_raise", "clear_async_exc"]

_SetAsyncExc = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p)(
    ("PyThreadState_SetAsyncExc", ctypes.pythonapi)
)
_PendingCall = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
# Called through pythonapi (GIL held), which Py_AddPendingCall allows.
_AddPendingCall = ctypes.PYFUNCTYPE(ctypes.c_int, _PendingCall, ctypes.c_void_p)(
    ("Py_AddPendingCall", ctypes.pythonapi)
)


def async_raise(thread_id: int, exc_type: type[BaseException]) -> bool:
    """Raise ``exc_type`` in thread ``thread_id`` at its next bytecode; True if scheduled.

    ``exc_type`` must stay alive (a module-level class): the interpreter
    keeps a reference only until it raises it.
    """
    return bool(_SetAsyncExc(thread_id, id(exc_type)) == 1)


def clear_async_exc(thread_id: int) -> None:
    """Drop an exception scheduled by :func:`async_raise` that was not raised yet."""
    _SetAsyncExc(thread_id, None)


class Progress:
    """When the training function last made progress, by the rules in the module doc."""

    def __init__(self, auto: bool) -> None:
        self.auto = auto
        self._lock = threading.Lock()
        self.running = False
        self.auto_last = 0.0
        self.manual_last: float | None = None
        self.generation = 0

    def begin(self) -> None:
        """The function (re)starts: progress counts from now."""
        now = time.monotonic()
        with self._lock:
            self.running = True
            self.auto_last = now
            self.manual_last = None
            self.generation += 1
        heartbeat.ping()

    def end(self) -> None:
        """The function returned to the wrapper: no deadline applies until the next begin."""
        with self._lock:
            self.running = False

    def ping(self) -> None:
        """Manual progress (``CallWrapper.ping()``)."""
        self.manual_last = time.monotonic()
        heartbeat.ping()

    def automatic(self) -> None:
        """Automatic progress: the main thread ran bytecode."""
        self.auto_last = time.monotonic()
        heartbeat.ping()

    def last(self) -> float | None:
        """The time progress is measured from; None when no rule applies."""
        with self._lock:
            if not self.running:
                return None
            sources = [self.auto_last] if self.auto else []
            if self.manual_last is not None:
                sources.append(self.manual_last)
            if not sources:
                return None
            return min(sources)


class _Semaphore:
    """A POSIX semaphore in ctypes memory; ``post`` is a C function the interpreter can call."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        self._buf = ctypes.create_string_buffer(64)  # >= sizeof(sem_t) on every libc we know
        self._init = libc.sem_init
        self._post = libc.sem_post
        self._timedwait = libc.sem_timedwait
        if self._init(self._buf, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "sem_init failed")
        # The pending call: sem_post(sem) takes one pointer and returns 0, runs no Python.
        self.post = ctypes.cast(libc.sem_post, _PendingCall)
        self.address = ctypes.cast(self._buf, ctypes.c_void_p)

    def wake(self) -> None:
        """Post from Python (to end a wait early)."""
        self._post(self._buf)

    def wait(self, timeout: float) -> bool:
        """Wait for a post up to ``timeout`` seconds (the GIL is released meanwhile)."""
        deadline = time.time() + timeout
        spec = _Timespec(int(deadline), int((deadline % 1) * 1e9))
        return bool(self._timedwait(self._buf, ctypes.byref(spec)) == 0)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class PendingCallProbe(threading.Thread):
    """Every ``interval`` seconds, ask the main thread to show that it runs bytecode.

    The pending call is libc's ``sem_post`` on a semaphore this thread waits
    on: no Python code runs in the main thread for it, so an exception raised
    asynchronously there can never land inside the probe. When the post
    arrives, this thread records automatic progress.
    """

    def __init__(self, progress: Progress, interval: float) -> None:
        super().__init__(name="elasticd-inprocess-probe", daemon=True)
        self.progress = progress
        self.interval = interval
        self._stopping = threading.Event()
        self._sem = _Semaphore()

    @classmethod
    def available(cls) -> bool:
        """Whether this platform has what the probe needs (POSIX unnamed semaphores)."""
        try:
            _Semaphore()
        except (OSError, AttributeError, TypeError):
            return False
        return True

    def run(self) -> None:
        outstanding = False
        while not self._stopping.is_set():
            if not outstanding and self.progress.running:
                outstanding = _AddPendingCall(self._sem.post, self._sem.address) == 0
            if not outstanding:
                self._stopping.wait(self.interval)
            elif self._sem.wait(self.interval):
                outstanding = False
                self.progress.automatic()
                self._stopping.wait(self.interval)

    def stop(self) -> None:
        """End the thread now; a pending call already queued still runs, harmlessly."""
        self._stopping.set()
        self._sem.wake()
