"""Lightning Fabric: ``Fabric(callbacks=[ElasticdFabricCallback()])``.

Fabric calls its callbacks' ``on_after_optimizer_step`` after each optimizer
step: that is a step (counted from the job's last checkpoint after a
restart, ``ELASTICD_CHECKPOINT_STEP`` + 1, else from 1). ``on_after_setup``
hands the callback the ``Fabric``, whose ``save`` it wraps: a save is a
checkpoint in progress until it returns, then the checkpoint of the step in
``state["step"]`` (or ``"global_step"``, ``"iteration"``), else of the steps
counted, at the path saved to.

Imports no framework: a Fabric callback is any object with the hooks' names.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from elasticd.worker.heartbeat import MAX_CHECKPOINT_PATH, checkpointed, checkpointing, ping
from elasticd.worker.integrations.loop import resume_step

__all__ = ["ElasticdFabricCallback"]

#: The keys of a saved state that name its step, in order.
STEP_KEYS = ("step", "global_step", "iteration")


class ElasticdFabricCallback:
    """Reports Fabric's optimizer steps and ``fabric.save`` checkpoints to elasticd."""

    def __init__(self) -> None:
        last = resume_step()
        self.step = 0 if last is None else last
        self._wrapped: set[int] = set()

    def on_after_optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        self.step += 1
        ping(step=self.step)

    def on_after_setup(self, fabric: Any = None, **kwargs: Any) -> None:
        if fabric is None or id(fabric) in self._wrapped:
            return
        self._wrapped.add(id(fabric))
        save = fabric.save

        @functools.wraps(save)
        def saving(path: Any, state: dict[str, Any], *args: Any, **kw: Any) -> Any:
            checkpointing()
            result = save(path, state, *args, **kw)
            checkpointed(_step_of(state, self.step), _short(path))
            return result

        fabric.save = saving


def _step_of(state: Any, counted: int) -> int:
    if isinstance(state, dict):
        for key in STEP_KEYS:
            value = state.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                return value
    return counted


def _short(path: Any) -> str | None:
    """The path when it can be reported (bounded, no NUL), else None."""
    try:
        raw = os.fsencode(path)
    except TypeError:
        return None
    return os.fsdecode(raw) if len(raw) <= MAX_CHECKPOINT_PATH and b"\0" not in raw else None
