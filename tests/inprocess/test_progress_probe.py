"""Automatic progress: the pending-call probe sees bytecode running, and sees a C call blocking."""

from __future__ import annotations

import threading
import time

import pytest

from elasticd.inprocess.errors import RankShouldRestart
from elasticd.inprocess.progress import PendingCallProbe, Progress, async_raise, clear_async_exc


@pytest.mark.skipif(not PendingCallProbe.available(), reason="no POSIX semaphores here")
def test_automatic_progress_follows_the_main_thread() -> None:
    """Progress advances while the main thread runs Python and stalls while it sleeps in C."""
    progress = Progress(auto=True)
    probe = PendingCallProbe(progress, 0.05)
    probe.start()
    try:
        progress.begin()
        started = progress.auto_last
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:  # pure Python: the pending calls run
            sum(range(1000))
        busy = progress.auto_last
        assert busy - started > 0.3
        time.sleep(0.5)  # a C call: no bytecode, so no pending call runs meanwhile
        blocked = progress.auto_last
        assert blocked - busy < 0.15
        last = progress.last()
        assert last is not None and time.monotonic() - last > 0.35
    finally:
        probe.stop()
        probe.join(timeout=5)
        progress.end()
    assert progress.last() is None  # no deadline outside an iteration


def test_an_exception_scheduled_in_another_thread_is_raised_there_or_cleared() -> None:
    """async_raise unwinds a running thread; clear_async_exc drops one it has not raised yet."""
    ready = threading.Event()
    outcome: list[str] = []

    def victim(blocking: bool) -> None:
        try:
            ready.set()
            if blocking:
                time.sleep(0.5)  # in C: the exception waits for the next bytecode
                outcome.append("finished")
                return
            while True:
                time.sleep(0.01)
        except RankShouldRestart:
            outcome.append("unwound")

    for blocking, clear in ((False, False), (True, True)):
        ready.clear()
        thread = threading.Thread(target=victim, args=(blocking,))
        thread.start()
        ready.wait(5)
        assert thread.ident is not None
        assert async_raise(thread.ident, RankShouldRestart)
        if clear:
            clear_async_exc(thread.ident)
        thread.join(5)
    assert outcome == ["unwound", "finished"]
