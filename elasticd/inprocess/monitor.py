"""The monitor thread of a wrapped call: faults of other ranks, and this rank's timeouts.

It waits on two things at once without polling:

* **faults** — a long-poll watch of ``faults/`` in the store: another rank
  interrupted the current iteration (it raised, or timed out), or a rank of
  the active world is terminated (its process died and the daemon said so,
  or it left). Either way this rank must restart: the monitor *interrupts*
  it (abort the process group, then raise ``RankShouldRestart`` in the main
  thread; see :meth:`elasticd.inprocess.wrapper.CallWrapper.interrupt`).
* **deadlines** — the watch's timeout is the next progress deadline
  (last progress + ``soft_timeout``, then + ``hard_timeout``), so the thread
  wakes exactly when a timeout could fire, reads progress again, and either
  fires or sleeps until the new deadline. At the soft timeout the rank
  records an interruption (so the others restart too) and interrupts
  itself; at the hard timeout it records itself terminated, then sends
  itself ``SIGTERM`` and, ``termination_grace_time`` later, ``SIGKILL``.

The daemon is the external monitor for what this thread cannot see (the
process dies, or wedges so hard that no Python thread runs): it writes
``faults/terminated/<rank>`` when a worker exits, and kills a worker whose
heartbeat passes the job's ``progress_timeout``.

While no iteration runs, the watch is re-armed every ``soft_timeout / 2``:
the thread cannot be woken locally during a long-poll, and that bound makes
sure the first deadline of a new iteration is never slept through.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from elasticd.inprocess.coordination import Coordinator
from elasticd.inprocess.progress import Progress
from elasticd.worker.store import StoreUnreachable

__all__ = ["IterationView", "Monitor"]

log = logging.getLogger("elasticd.inprocess")


@dataclass(frozen=True)
class IterationView:
    """What the monitor needs to know about the iteration in progress."""

    running: bool
    iteration: int
    active_world: frozenset[int]


class Interrupt(Protocol):
    """Abort the rank's distributed work and unwind its function (``CallWrapper.interrupt``);
    ``again``: even if that iteration was interrupted already (the soft timeout's escalation)."""

    def __call__(self, reason: str, iteration: int, *, again: bool = False) -> None: ...


class Monitor(threading.Thread):
    """See the module docstring."""

    def __init__(
        self,
        coordinator: Coordinator,
        progress: Progress,
        view: Callable[[], IterationView],
        interrupt: Interrupt,
        *,
        soft_timeout: float,
        hard_timeout: float,
        termination_grace_time: float,
    ) -> None:
        super().__init__(name="elasticd-inprocess-monitor", daemon=True)
        self.coordinator = coordinator
        self.progress = progress
        self.view = view
        self.interrupt = interrupt
        self.soft_timeout = soft_timeout
        self.hard_timeout = hard_timeout
        self.grace = termination_grace_time
        self._stopping = threading.Event()
        self._soft_fired_generation = -1
        self._latest_keys: list[str] = []

    def stop(self) -> None:
        """Ask the thread to end (at its next wake-up; closing its client wakes it now)."""
        self._stopping.set()

    def run(self) -> None:
        try:
            self._loop()
        except StoreUnreachable as exc:
            if not self._stopping.is_set():
                log.warning("in-process monitor stopped: the store is unreachable: %s", exc)

    def _loop(self) -> None:
        layout = self.coordinator.layout
        client = self.coordinator.client
        while not self._stopping.is_set():
            now = time.monotonic()
            wake = now + self.soft_timeout / 2
            last = self.progress.last()
            generation = self.progress.generation
            if last is not None:
                silent = now - last
                if silent >= self.hard_timeout:
                    self._hard_timeout(silent)
                    return
                wake = min(wake, last + self.hard_timeout)
                if self._soft_fired_generation != generation:
                    if silent >= self.soft_timeout:
                        self._soft_fired_generation = generation
                        self._soft_timeout(silent)
                    else:
                        wake = min(wake, last + self.soft_timeout)
            entries, revision = client.listing(layout.faults)
            # Published before the view is read: an iteration that starts meanwhile
            # checks these keys itself (fault_in), so no fault falls between the two.
            self._latest_keys = [e.key for e in entries]
            view = self.view()
            if view.running:
                reason = self.fault_in(view)
                if reason is not None:
                    self.interrupt(reason, view.iteration)
            if self._stopping.is_set():
                return
            client.watch(layout.faults, revision, max(0.0, wake - time.monotonic()), prefix=True)

    def fault_in(self, view: IterationView) -> str | None:
        """Why ``view``'s iteration must restart, from the faults seen so far; None if not."""
        faults = self.coordinator.layout.faults
        rank = self.coordinator.rank
        keys = self._latest_keys
        interrupted = f"{faults}interrupted/{self.coordinator.call}/{view.iteration}/"
        terminated = f"{faults}terminated/"
        for key in keys:
            if key.startswith(interrupted):
                tail = key[len(interrupted) :]
                if tail.isdigit() and int(tail) != rank:
                    return f"rank {tail} interrupted iteration {view.iteration}"
            elif key.startswith(terminated):
                tail = key[len(terminated) :]
                if tail.isdigit() and int(tail) in view.active_world:
                    return f"rank {tail} terminated"
        return None

    def _soft_timeout(self, silent: float) -> None:
        view = self.view()
        message = f"no progress for {silent:.1f} s (soft_timeout {self.soft_timeout:g} s)"
        log.warning(
            "elasticd.inprocess: rank %d: soft timeout in iteration %d: %s; interrupting",
            self.coordinator.rank,
            view.iteration,
            message,
        )
        try:
            self.coordinator.record_interrupted(view.iteration, "soft_timeout", message)
        finally:
            # Again if a fault interrupted it already: that interruption did not take.
            self.interrupt(f"soft timeout: {message}", view.iteration, again=True)

    def _hard_timeout(self, silent: float) -> None:
        message = f"no progress for {silent:.1f} s (hard_timeout {self.hard_timeout:g} s)"
        log.error(
            "elasticd.inprocess: rank %d: hard timeout: %s; terminating this process",
            self.coordinator.rank,
            message,
        )
        try:
            self.coordinator.mark_terminated(self.coordinator.rank, f"hard timeout: {message}")
        except StoreUnreachable as exc:
            log.error("elasticd.inprocess: could not record the termination: %s", exc)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(self.grace)
        os.kill(os.getpid(), signal.SIGKILL)
