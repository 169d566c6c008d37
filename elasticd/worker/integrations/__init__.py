"""One-line integrations: training frameworks report steps and checkpoints to elasticd.

Add one callback; nothing else in the script changes:

* PyTorch Lightning ``Trainer``: ``Trainer(callbacks=[ElasticdCallback()])``
  (:mod:`elasticd.worker.integrations.lightning`);
* Lightning Fabric: ``Fabric(callbacks=[ElasticdFabricCallback()])``
  (:mod:`elasticd.worker.integrations.fabric`): each optimizer step is a step,
  each ``fabric.save`` a checkpoint;
* Hugging Face ``Trainer`` (and accelerate scripts that use it):
  ``Trainer(..., callbacks=[ElasticdTrainerCallback()])``
  (:mod:`elasticd.worker.integrations.huggingface`);
* a hand-written loop: ``ping(step=N)`` each step and ``with checkpoint(N, path):``
  around a save (:mod:`elasticd.worker.integrations.loop`), ``resume_step()``
  for where the job's last checkpoint is.

Each reports through :func:`elasticd.worker.ping`,
:func:`~elasticd.worker.checkpointing` and :func:`~elasticd.worker.checkpointed`
(a memory store each, no system call), and does nothing outside elasticd.
This package imports no framework and no torch: each module imports only its
own framework, when it is imported (the names below are loaded on first use).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "ElasticdCallback",
    "ElasticdFabricCallback",
    "ElasticdTrainerCallback",
    "checkpoint",
    "resume_path",
    "resume_step",
]

_WHERE = {
    "ElasticdCallback": "lightning",
    "ElasticdFabricCallback": "fabric",
    "ElasticdTrainerCallback": "huggingface",
    "checkpoint": "loop",
    "resume_path": "loop",
    "resume_step": "loop",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
