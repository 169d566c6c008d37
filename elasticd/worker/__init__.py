"""The worker-side library: what runs *inside* a worker that elasticd started.

What a training script may use, none of which imports torch at
import time (torch is imported only by :func:`store`, which returns a
``torch.distributed.Store``):

* :func:`ping` — "I am making progress". A store into a memory-mapped file the
  daemon created (``ELASTICD_HEARTBEAT_FILE``); microseconds, no system call,
  never blocks, never raises, a no-op outside elasticd. The daemon's
  progress monitor (:mod:`elasticd.agent.progress`) reads these files to
  detect hung workers. See :mod:`elasticd.worker.heartbeat` for the format.
  ``ping(step=N)`` also carries the training step, at the same cost.
* :func:`checkpointing` / :func:`checkpointed` — "a checkpoint begins" and
  "the checkpoint of step N is durable (at path)", through the same file: a
  checkpoint in progress is judged by ``checkpoint_timeout``, and a restarted
  attempt gets the last one in ``ELASTICD_CHECKPOINT_STEP`` /
  ``ELASTICD_CHECKPOINT_PATH``. One-line callbacks for Lightning and Hugging
  Face call them (:mod:`elasticd.worker.integrations`).
* :func:`record` — torch's ``@record`` without torch: an uncaught exception
  becomes ``$TORCHELASTIC_ERROR_FILE`` in torch's exact format, so the
  daemon reports it as the job's root cause.
* :func:`store` — a ``torch.distributed.Store`` backed by the cluster store
  through the daemon's ``/store`` API: it survives the death of any rank,
  so it can coordinate restarts (see :mod:`elasticd.inprocess`) and back
  ``init_process_group(store=...)``.

Importing this package in a process started by elasticd (``ELASTICD_JOB_ID``
set) also registers a ``faulthandler`` stack dump on ``SIGUSR1``
(:mod:`elasticd.worker.stacks`), so the daemon can ask a hung worker for
its stacks when py-spy is not available.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from elasticd.worker import flight as _flight
from elasticd.worker import stacks as _stacks
from elasticd.worker.errors import record, write_error_file
from elasticd.worker.heartbeat import checkpointed, checkpointing, ping

if TYPE_CHECKING:
    from elasticd.worker.store import ClusterStoreClient

__all__ = [
    "checkpointed",
    "checkpointing",
    "client",
    "ping",
    "record",
    "store",
    "write_error_file",
]


def store(namespace: str | None = None, *, timeout: float = 300.0) -> Any:
    """A ``torch.distributed.Store`` over the cluster store, for this job and attempt.

    ``namespace`` defaults to ``jobs/<job>/torch/<attempt>/``; keys are
    stored under it. Usable as ``init_process_group(store=PrefixStore(..., store()))``.
    Imports torch.
    """
    from elasticd.worker.store import torch_store

    return torch_store(namespace=namespace, timeout=timeout)


def client(namespace: str | None = None, *, timeout: float = 300.0) -> ClusterStoreClient:
    """The torch-free client under :func:`store`: blocking get/set/add/wait over ``/store``."""
    from elasticd.worker.store import ClusterStoreClient

    return ClusterStoreClient.from_env(namespace=namespace, timeout=timeout)


if _stacks.under_elasticd():
    _stacks.install()
    _flight.start()
