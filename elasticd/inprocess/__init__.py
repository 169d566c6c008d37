"""In-process restart: when any rank fails, every healthy rank restarts the training function
inside the same process, with a new iteration number.

A process restart costs the interpreter, ``import torch``, the CUDA context,
the data loaders and the process group: tens of seconds on a GPU node.
Restarting the *function* costs a new process group. This package rebuilds
the semantics of NVIDIA's ``inprocess.Wrapper`` on elasticd's pieces:

* **coordination through the cluster store**, reached through the daemon
  (:func:`elasticd.worker.client`), not a ``TCPStore`` hosted by a rank that
  may die. Barriers, fault records and the pinned world of each iteration
  are keys under ``jobs/<job>/inprocess/<attempt>/`` (:mod:`.keys`);
  waits are watches, not sleep-and-retry (:mod:`.coordination`);
* **a monitor thread per rank** (:mod:`.monitor`) that watches the fault
  keys and this rank's progress deadlines, and interrupts the function:
  abort the process group (:mod:`.abort` — for gloo this means shutting down
  the group's TCP connections, since gloo's ``abort()`` does not wake a
  blocked collective), then raise :class:`RankShouldRestart` in the main
  thread (:mod:`.progress`);
* **the daemon as the external monitor**: it writes
  ``faults/terminated/<rank>`` when a worker process dies
  (:func:`.keys.report_terminated`), so the survivors restart at once
  instead of waiting for a collective timeout, and it kills a worker whose
  heartbeat passes ``hard_timeout``;
* the hooks, rank assignment (:class:`ShiftRanks` by default), rank filter
  (spares), timeouts and their ordering rules of the original
  (:mod:`.wrapper`, :mod:`.state`).

Usage::

    from elasticd.inprocess import CallWrapper, Wrapper

    @Wrapper(soft_timeout=60, hard_timeout=90)
    def train(call: CallWrapper | None = None):
        call.init_process_group("nccl")       # this iteration's group, on the cluster store
        for step in range(start_step(), steps):
            ...
            call.ping()

Importing this package does not import torch.
"""

from __future__ import annotations

from elasticd.inprocess.abort import Abort, AbortTorchDistributed
from elasticd.inprocess.errors import (
    HealthCheckError,
    InProcessError,
    RankShouldRestart,
    RestartError,
)
from elasticd.inprocess.keys import Layout, report_terminated
from elasticd.inprocess.state import (
    ActiveWorldSizeDivisibleBy,
    FillGaps,
    MaxActiveWorldSize,
    RankAssignment,
    RankFilter,
    ShiftRanks,
    State,
)
from elasticd.inprocess.wrapper import CallWrapper, Wrapper

__all__ = [
    "Abort",
    "AbortTorchDistributed",
    "ActiveWorldSizeDivisibleBy",
    "CallWrapper",
    "FillGaps",
    "HealthCheckError",
    "InProcessError",
    "Layout",
    "MaxActiveWorldSize",
    "RankAssignment",
    "RankFilter",
    "RankShouldRestart",
    "RestartError",
    "ShiftRanks",
    "State",
    "Wrapper",
    "report_terminated",
]
