"""Hugging Face ``Trainer``: ``Trainer(..., callbacks=[ElasticdTrainerCallback()])``.

Each step end reports ``state.global_step``; when the Trainer is about to
save (``control.should_save`` at the step's end) a checkpoint is in
progress; ``on_save`` (called once it is written) reports the checkpoint of
that step at ``<output_dir>/checkpoint-<step>``. Accelerate scripts that use
the ``Trainer`` use the same callback.

Imports ``transformers`` when imported (the callback is a ``TrainerCallback``).
"""

from __future__ import annotations

import os
from typing import Any

from transformers import TrainerCallback

from elasticd.worker.heartbeat import checkpointed, checkpointing, ping
from elasticd.worker.integrations.fabric import _short

__all__ = ["ElasticdTrainerCallback"]

#: transformers' checkpoint folder prefix (``transformers.trainer_utils.PREFIX_CHECKPOINT_DIR``).
PREFIX = "checkpoint"


class ElasticdTrainerCallback(TrainerCallback):
    """Reports the global step and each saved checkpoint of a ``Trainer`` to elasticd."""

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        ping(step=state.global_step)
        if getattr(control, "should_save", False):
            checkpointing()

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        output_dir = getattr(args, "output_dir", None)
        path = os.path.join(output_dir, f"{PREFIX}-{state.global_step}") if output_dir else None
        checkpointed(state.global_step, _short(path) if path else None)
