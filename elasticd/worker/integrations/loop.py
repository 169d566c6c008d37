"""For hand-written training loops: the step, a checkpoint, and where to resume.

::

    from elasticd.worker import ping
    from elasticd.worker.integrations.loop import checkpoint, resume_step

    last = resume_step()                        # the job's last checkpoint, after a restart
    start = 0 if last is None else last + 1     # never `(last or -1) + 1`: step 0 counts
    for step in range(start, total):
        train_one_step()
        ping(step=step)
        if step % 100 == 0:
            with checkpoint(step, path):        # checkpointing() ... checkpointed(step, path)
                torch.save(state, path)

Torch-free; a no-op outside elasticd (``resume_step()`` is then None).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from elasticd.worker.heartbeat import checkpointed, checkpointing

__all__ = ["checkpoint", "resume_path", "resume_step"]


def resume_step() -> int | None:
    """The job's last durable checkpoint step (``ELASTICD_CHECKPOINT_STEP``), None when none."""
    raw = os.environ.get("ELASTICD_CHECKPOINT_STEP", "")
    try:
        return int(raw) if raw else None
    except ValueError:
        return None


def resume_path() -> str | None:
    """Where that checkpoint lies (``ELASTICD_CHECKPOINT_PATH``), when the worker said."""
    return os.environ.get("ELASTICD_CHECKPOINT_PATH") or None


@contextmanager
def checkpoint(step: int, path: str | os.PathLike[str] | None = None) -> Iterator[None]:
    """Around a save: a checkpoint in progress (``checkpoint_timeout`` applies), then, only
    when the block ends without an exception, the checkpoint of ``step`` is durable."""
    checkpointing()
    yield
    checkpointed(step, path)
