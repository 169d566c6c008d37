"""Progress of the training function, automatic and manual, and raising into the main thread.

Two sources of progress, NVIDIA's semantics:

* **automatic** — every ``interval`` a small thread asks the interpreter to
  run a callback *in the main thread* (``Py_AddPendingCall``). The callback
  only runs when the main thread executes Python bytecode, so its timestamp
  says "the main thread is not stuck inside a C call" (a collective waiting
  for a dead peer, a deadlocked kernel launch). Only available when the
  wrapper runs in the main thread.
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
import threading
import time

from elasticd.worker import heartbeat

__all__ = ["PendingCallProbe", "Progress", "async_raise", "clear_async_exc"]

_SetAsyncExc = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p)(
    ("PyThreadState_SetAsyncExc", ctypes.pythonapi)
)
_PendingCall = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
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


class PendingCallProbe(threading.Thread):
    """Every ``interval`` seconds, ask the main thread to record automatic progress."""

    def __init__(self, progress: Progress, interval: float) -> None:
        super().__init__(name="elasticd-inprocess-probe", daemon=True)
        self.progress = progress
        self.interval = interval
        self._stop = threading.Event()
        self._outstanding = threading.Event()
        # Kept on the instance: the C callback must outlive every pending call.
        self._callback = _PendingCall(self._ran)

    def _ran(self, _arg: object) -> int:
        self.progress.automatic()
        self._outstanding.clear()
        return 0

    def run(self) -> None:
        while not self._stop.wait(self.interval):
            if self.progress.running and not self._outstanding.is_set():
                self._outstanding.set()
                if _AddPendingCall(self._callback, None) != 0:
                    self._outstanding.clear()  # queue full: try again next time

    def stop(self) -> None:
        """End the thread (a pending call already queued still runs, harmlessly)."""
        self._stop.set()
