"""Stack dumps on request: ``SIGUSR1`` makes a worker print every thread's Python stack.

When py-spy is not installed (or may not attach), the daemon asks a stuck
worker for its stacks by sending it ``SIGUSR1``; :func:`install` registers
``faulthandler`` for that signal, writing to the worker's stderr, which the
daemon already captures into ``stderr.log``. ``faulthandler`` writes from
the C signal handler, so it answers even while the main thread is stuck
inside a C call holding the GIL.

Why ``SIGUSR1``: it is the conventional "user-defined" signal and nothing in
torch or torchrun uses it. Its default action is to *terminate* the
process, so the daemon only sends it to a process whose signal mask shows
that it catches ``SIGUSR1`` (see :func:`elasticd.agent.progress.dump_stacks`).

``chain`` is only set when something already handled ``SIGUSR1``: faulthandler
"chains" by restoring the previous disposition and re-raising the signal, and
with the default disposition that would kill the worker right after its
dump. A handler installed later with ``signal.signal`` replaces this one
(PyTorch Lightning's SLURM auto-requeue does that under SLURM); the daemon
then sees that the signal is handled by someone else and still sends it,
so such a job should run with py-spy installed.

The handler is only registered in processes started by elasticd (the
environment has ``ELASTICD_JOB_ID``), when ``elasticd.worker`` is imported.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys

__all__ = ["STACK_SIGNAL", "install", "installed"]

#: The signal the daemon sends for a stack dump.
STACK_SIGNAL = signal.SIGUSR1

_installed = False


def install() -> bool:
    """Register the stack dump handler (idempotent); False when stderr has no file descriptor."""
    global _installed
    if _installed:
        return True
    stream = sys.__stderr__ if sys.__stderr__ is not None else sys.stderr
    if stream is None:
        return False
    previous = signal.getsignal(STACK_SIGNAL)
    chain = previous not in (signal.SIG_DFL, signal.SIG_IGN, None)
    try:
        faulthandler.register(STACK_SIGNAL, file=stream, all_threads=True, chain=chain)
    except (AttributeError, OSError, RuntimeError, ValueError):
        return False  # no fileno() (replaced stderr), or no signals here
    _installed = True
    return True


def installed() -> bool:
    """Whether :func:`install` registered the handler in this process."""
    return _installed


def under_elasticd() -> bool:
    """Whether this process was started by elasticd as a worker."""
    return bool(os.environ.get("ELASTICD_JOB_ID"))
