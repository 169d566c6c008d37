"""torchrun's rendezvous on elasticd: ``torchrun --rdzv-backend=elasticd``.

``torchrun --rdzv-backend=elasticd --rdzv-endpoint=127.0.0.1:7070
--rdzv-id=JOB --nnodes=2:4 --nproc-per-node=1 train.py`` runs torch's own
agent (its worker processes, restarts and exit barrier) with elasticd's
rendezvous (:mod:`elasticd.rendezvous`) on the daemons' cluster store,
reached through a daemon's ``/store`` API. torch finds the backend through
the ``torchrun.handlers`` entry point (``pyproject.toml``): it calls
:func:`create_handler` with no argument and registers what it returns, the
creator of a handler from torch's ``RendezvousParameters``.

Where it runs, and why it is shaped so:

* **In torchrun's process, on the job's side** of the privilege boundary
  (docs/design.md section 6): as the user who started torchrun, holding only
  the token it was given (``--rdzv-conf token_file=PATH``, else
  ``ELASTICD_TOKEN_FILE``). The daemon never imports this module
  (``tests/unit/test_layering.py``); it imports torch only when torch asks
  for a handler.
* **One node = one torchrun process**, named ``<host>-<pid>-<random>``. It
  holds a lease of its own (``lease_ttl``, 3 s by default), kept alive from
  the backend's thread and revoked on :meth:`shutdown`; its presence key is
  bound to it, so a torchrun that dies is dropped by the others within
  ``lease_ttl``, as a daemon would be.
* **torch's agent is synchronous; the rendezvous is async.** The rendezvous,
  the lease and a watch on the round run on a private event loop in one
  daemon thread; torch's calls block on it. ``num_nodes_waiting`` (called
  every monitor interval) reads a number the watch keeps, so it costs no
  request. When the watch sees that the round must re-form, it says at once
  that this node is heading for the next round (``StoreRendezvous.leaving``),
  before torch gets round to stopping its workers, so the others do not
  presume it dead.
* **The agent's store is fresh every round**: a ``torch.distributed.Store``
  over ``/store`` under ``jobs/<run id>/torchrun/<round>/``
  (:func:`elasticd.keys.torchrun_store_prefix`), so a re-formed group never
  reads what the last one left. ``use_agent_store`` is False: workers get
  ``MASTER_ADDR``/``MASTER_PORT`` of the round (group rank 0's address and a
  port it picked, fresh every round) and build their own store there, as
  torch's c10d backend's workers do with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
  (by default c10d shares its agent's TCPStore with them).
* The rendezvous options are torch's (``--rdzv-conf join_timeout=...,
  last_call_timeout=...``, torch's defaults 600 and 30 s); a re-formation
  after a failure completes as soon as every live node is back, without the
  last call. :meth:`shutdown` closes the rendezvous, as torch's handler does:
  a run id is used once (choose a fresh ``--rdzv-id`` per run, or
  ``DELETE /jobs/<id>`` once it ended).

What operators see (read-only; the daemons never run, cancel or resume
it): the run's job document ``job/<run id>`` with ``launcher: torchrun``
(state, round, the torchrun command, restarts: rounds that ended in a
node's worker failure), written by the torchruns by compare-and-set
(:func:`run_edit`) off torch's path; each torchrun's events under
``ev/<run id>/<node>/`` and its group view (round, rank, master; no
workers: torch's agent owns them). The end is SUCCEEDED when torch's
launcher calls :meth:`shutdown` with nothing raised, FAILED when it calls
it while an error (the workers failed) is on its way out. A torchrun
killed by a signal never calls it (torch's launcher skips it then), so a
run all of whose torchruns were killed keeps its last state; its nodes'
presence keys are gone once their leases expire.

The package, one job per module: :mod:`.config` (torchrun's parameters),
:mod:`.edits` (the run's document: pure edits), :mod:`.core`
(:class:`TorchrunRendezvous`, on the store client's private event loop
thread, :class:`elasticd.store.blocking.LoopThread`) and
:mod:`.torch_adapter` (torch's handler class; the only module that imports
torch, and only when torch asks for a handler).
"""

from elasticd.torchrun_backend.config import (
    BACKEND,
    DEFAULT_PORT,
    BackendConfig,
    address_towards,
    backend_config,
    endpoint_url,
    node_name,
)
from elasticd.torchrun_backend.core import TorchrunRendezvous
from elasticd.torchrun_backend.edits import (
    NEVER_SCHEDULED,
    RunStep,
    run_edit,
    run_spec,
    waiting_nodes,
)
from elasticd.torchrun_backend.torch_adapter import create_handler

__all__ = [
    "BACKEND",
    "DEFAULT_PORT",
    "NEVER_SCHEDULED",
    "BackendConfig",
    "RunStep",
    "TorchrunRendezvous",
    "address_towards",
    "backend_config",
    "create_handler",
    "endpoint_url",
    "node_name",
    "run_edit",
    "run_spec",
    "waiting_nodes",
]
