"""PyTorch Lightning ``Trainer``: ``Trainer(callbacks=[ElasticdCallback()])``.

Each training batch end reports ``trainer.global_step``. A checkpoint is in
progress from ``on_save_checkpoint`` (Lightning builds the checkpoint's
content, then writes it); by the callback's next hook the save has returned,
so the checkpoint of that step is durable, at the path the
``ModelCheckpoint`` callback last wrote when it changed.

Imports ``pytorch_lightning`` (else ``lightning.pytorch``) when imported:
the callback must be a Lightning ``Callback``. A script that uses the other
package makes its own with ``callback_class(lightning.pytorch.Callback)``.
"""

from __future__ import annotations

import importlib
from typing import Any

from elasticd.worker.heartbeat import checkpointed, checkpointing, ping
from elasticd.worker.integrations.fabric import _short

__all__ = ["ElasticdCallback", "callback_class"]


def callback_class(base: type) -> type:
    """An elasticd callback class deriving from Lightning's ``Callback`` ``base``."""

    class ElasticdCallback(base):  # type: ignore[misc]
        """Reports the global step and each checkpoint of a Lightning ``Trainer`` to elasticd."""

        def __init__(self) -> None:
            super().__init__()
            self._pending: tuple[int, dict[int, str]] | None = None

        def on_train_batch_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
            self._flush(trainer)
            ping(step=trainer.global_step)

        def on_save_checkpoint(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
            self._flush(trainer)
            checkpointing()
            self._pending = (trainer.global_step, _saved_paths(trainer))

        def on_train_batch_start(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
            self._flush(trainer)

        def on_train_epoch_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
            self._flush(trainer)

        def on_validation_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
            self._flush(trainer)

        def on_fit_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
            self._flush(trainer)

        def teardown(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
            self._flush(trainer)

        def _flush(self, trainer: Any) -> None:
            """The save begun at ``on_save_checkpoint`` has returned: it is durable."""
            pending, self._pending = self._pending, None
            if pending is None:
                return
            step, before = pending
            after = _saved_paths(trainer)
            changed = [path for key, path in after.items() if path and before.get(key) != path]
            checkpointed(step, _short(changed[-1]) if changed else None)

    return ElasticdCallback


def _saved_paths(trainer: Any) -> dict[int, str]:
    """The file each ``ModelCheckpoint`` last wrote (a private attribute; "" when unknown)."""
    return {
        id(cb): str(getattr(cb, "_last_checkpoint_saved", "") or "")
        for cb in getattr(trainer, "checkpoint_callbacks", ())
    }


def _lightning_callback() -> type:
    for name in ("pytorch_lightning", "lightning.pytorch"):
        try:
            return importlib.import_module(name).Callback  # type: ignore[no-any-return]
        except ImportError:
            continue
    raise ImportError("PyTorch Lightning is not installed (pip install pytorch-lightning)")


ElasticdCallback = callback_class(_lightning_callback())
